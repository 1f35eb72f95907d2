"""Online softmax in base 2, one thread's rows of the S accumulator at a time.

Scores arrive in "logit units" u; the kernel keeps m = running max(u) and l = sum exp2((u - m) * log2_scale). Using
exp2 turns every exponential into one FFMA + one `ex2.approx`. Each row lives in a quad of 4 lanes, so row maxima are
reduced with two shuffles; row sums stay thread-local until `finalize`.
"""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .carry import Carried
from .layout import rows_view


class OnlineSoftmax(Carried):
    """Running row max / row sum for one consumer thread. `log2_scale` multiplies scores before exp2."""

    _FIELDS = ("log2_scale", "row_max", "row_sum")

    def __init__(self, log2_scale: Float32, num_rows: int):
        self.log2_scale = log2_scale
        self.row_max = cute.make_rmem_tensor(num_rows, Float32)
        self.row_sum = cute.make_rmem_tensor(num_rows, Float32)

    @cute.jit
    def reset(self):
        self.row_max.fill(-Float32.inf)
        self.row_sum.fill(0.0)

    @cute.jit
    def step(self, acc_s: cute.Tensor, row_scale: cute.Tensor):
        """Turn scores into unnormalised probabilities in place; write how much to shrink O by into row_scale."""
        s_rows = rows_view(acc_s)
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            row = s_rows[r, None].load()
            m_blk = row_max_ilp(s_rows[r, None])
            m_new = cute.arch.fmax(self.row_max[r], cute.arch.warp_reduction_max(m_blk, threads_in_group=4))
            m_prev = self.row_max[r]
            self.row_max[r] = m_new
            # A row masked so far has m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
            m_safe = Float32(0.0) if m_new == -Float32.inf else m_new
            shift = m_safe * self.log2_scale
            p = cute.math.exp2(row * self.log2_scale - shift, fastmath=True)
            scale = cute.math.exp2((m_prev - m_safe) * self.log2_scale, fastmath=True)
            row_scale[r] = scale
            s_rows[r, None].store(p)
            self.row_sum[r] = row_sum_ilp(s_rows[r, None], self.row_sum[r] * scale)

    @cute.jit
    def finalize(self, lse: cute.Tensor, out_scale: cute.Tensor):
        """Quad-reduce the row sums; out_scale = 1/l (0 for empty rows), lse = natural-log logsumexp (-inf if empty)."""
        for r in cutlass.range_constexpr(cute.size(self.row_sum)):
            total = self.row_sum[r]
            total = total + cute.arch.shuffle_sync_bfly(total, offset=2)
            total = total + cute.arch.shuffle_sync_bfly(total, offset=1)
            empty = total == 0.0 or total != total
            out_scale[r] = Float32(0.0) if empty else cute.arch.rcp_approx(total)
            lse_val = (self.row_max[r] * self.log2_scale + cute.math.log2(total, fastmath=True)) * math.log(2.0)
            lse[r] = -Float32.inf if empty else lse_val


@cute.jit
def row_max_ilp(row: cute.Tensor) -> Float32:
    """Max of one row fragment with four independent chains, so the reduction is not one long dependent sequence."""
    n = cute.size(row)
    acc = [row[0], row[1], row[2], row[3]]
    for i in cutlass.range_constexpr(4, n, 4):
        for j in cutlass.range_constexpr(4):
            acc[j] = cute.arch.fmax(acc[j], row[i + j])
    return cute.arch.fmax(cute.arch.fmax(acc[0], acc[1]), cute.arch.fmax(acc[2], acc[3]))


@cute.jit
def row_sum_ilp(row: cute.Tensor, init: Float32) -> Float32:
    """Sum of one row fragment plus `init`, four independent chains."""
    n = cute.size(row)
    acc = [row[0] + init, row[1], row[2], row[3]]
    for i in cutlass.range_constexpr(4, n, 4):
        for j in cutlass.range_constexpr(4):
            acc[j] = acc[j] + row[i + j]
    return (acc[0] + acc[1]) + (acc[2] + acc[3])


@cute.jit
def rescale_rows(acc_o: cute.Tensor, row_scale: cute.Tensor):
    """O[r, :] *= row_scale[r] for every row this thread holds."""
    o_rows = rows_view(acc_o)
    for r in cutlass.range_constexpr(cute.size(row_scale)):
        o_rows[r, None].store(o_rows[r, None].load() * row_scale[r])


