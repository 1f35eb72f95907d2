"""Accumulating captured-tensor gradients (learnable biases) from the backward kernel, fast or bit-reproducible.

Many score elements add into one table entry (every (q, kv) on a diagonal hits the same relative-position bias),
so the adds are atomics. In fp32 their order changes the rounding from run to run. For deterministic mode the buffer
is int64 instead: each value is rounded once to a multiple of 2^-FIXED_POINT_BITS and added as an integer, and
integer addition is associative, so the sum is the same bits in any order. The host turns it back into floats
(`from_fixed_point`). Range: |sum| < 2^(63 - FIXED_POINT_BITS) = 2^31; resolution 2^-32 (2.3e-10).

Generated `score_mod_aux_grad` code calls `add_aux_grad(dst, coord, value)`; the buffer's element type picks the
mode at trace time, so one generated function serves both.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int64

FIXED_POINT_BITS = 32
_SCALE = float(2 ** FIXED_POINT_BITS)
_LIMIT = float(2 ** (62 - FIXED_POINT_BITS))  # clamp before converting so one add cannot overflow int64


@cute.jit
def add_aux_grad(dst: cute.Tensor, coord, value: Float32):
    """dst[coord] += value: an fp32 atomic for fp32 buffers, an exact fixed-point integer atomic for int64 ones."""
    ptr = dst.iterator + cute.crd2idx(coord, dst.layout)
    if cutlass.const_expr(dst.element_type is Int64):
        clamped = cutlass.max(cutlass.min(value, Float32(_LIMIT)), Float32(-_LIMIT))
        cute.arch.atomic_add(ptr, (clamped * Float32(_SCALE)).to(Int64))
    else:
        cute.arch.atomic_add(ptr, value)


def from_fixed_point(buffer):
    """The fp32 gradient an int64 fixed-point buffer holds (torch tensor in, torch tensor out)."""
    import torch
    return (buffer.to(torch.float64) / _SCALE).to(torch.float32)
