"""Apply a generated element-wise score_mod to the S accumulator in registers (inlined: no call in the PTX).

The mod sees the score already multiplied by the softmax scale (torch's convention), plus the batch, the query head
and the absolute (q_idx, kv_idx) of each element; captured tensors/scalars are passed through as runtime arguments.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .mask import element_indices


@cute.jit
def apply_score_mod(acc_s: cute.Tensor, coords: cute.Tensor, score_mod: cutlass.Constexpr, scale: Float32,
                    batch: Int32, head: Int32, q_start: Int32, kv_start: Int32, q_last: Int32, kv_last: Int32,
                    clamp: cutlass.Constexpr[bool], aux_tensors, aux_scalars):
    """acc_s[i] <- score_mod(acc_s[i] * scale, b, h, q_idx, kv_idx); indices from `mask.element_indices`."""
    for i in cutlass.range_constexpr(cute.size(acc_s)):
        q_idx, kv_idx = element_indices(coords, i, q_start, kv_start, q_last, kv_last, clamp)
        acc_s[i] = Float32(score_mod(acc_s[i] * scale, batch, head, q_idx, kv_idx, aux_tensors, aux_scalars))
