"""Online softmax in base 2, one thread's rows of the S accumulator at a time.

Scores arrive in "logit units" u; the kernel keeps m = running max(u) and l = sum exp2((u - m) * log2_scale). Using
exp2 turns every exponential into one FFMA + one `ex2.approx`. Each row lives in a quad of 4 lanes, so row maxima are
reduced with two shuffles; row sums stay thread-local until `finalize`.

`ex2.approx` runs on the MUFU unit, 16 results per clock per SM on Hopper against 128 FMAs: at D=64 a 128x128 tile's
16K exponentials take as long as its two GEMMs. `exp2_fma` computes 2^x on the FMA pipe instead (a floor by rounded
add, a cubic for the fraction, the integer part added into the exponent bits), so a kernel can move part of the
exponentials off MUFU (`FwdConfig.exp2_poly`).

Lazy rescaling (`FwdConfig.lazy_rescale`): the max that exponentials subtract is a reference, not necessarily the
true running max. A warp moves its rows' references only when some row's max grew by more than
`RESCALE_THRESHOLD` (in log2 units) over its reference; otherwise probabilities may reach 2^RESCALE_THRESHOLD,
which fp32 sums and 16-bit P hold at full relative precision, and the O accumulator is left alone. After the first
few KV blocks a row's max rarely jumps that far, so most steps skip the O rescale: head_dim / 2 multiplies per thread
per step (128 at D=256). O / l and the log-sum-exp are exact for any reference.
"""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .carry import Carried
from .layout import rows_view

# 2^f on [0, 1] as 1 + f*(C1 + f*(C2 + f*C3)): minimax relative error 1.03e-4 with p(1) = 2 exactly, so the result is
# continuous where floor(x) steps (coefficients fitted by linear programming on 4001 points, rounded to fp32).
EXP2_POLY = (0.6954241991043091, 0.22630836069583893, 0.07826747000217438)
_ROUND_MAGIC = 12582912.0  # 1.5 * 2^23: adding it leaves floor(x) in the low mantissa bits (|x| < 2^22)
# Lazy rescaling: how far (log2 units) a row's max may outgrow its reference before the warp moves it; 2^8 = 256 is
# the most a probability then reaches.
RESCALE_THRESHOLD = 8.0


class OnlineSoftmax(Carried):
    """Running row max / row sum for one consumer thread. `log2_scale` multiplies scores before exp2."""

    _FIELDS = ("log2_scale", "row_max", "row_sum")

    def __init__(self, log2_scale: Float32, num_rows: int, exp2_poly: int = 0, exp2: bool = True, lazy: bool = False):
        """`exp2_poly`: of every 8 scores of a row fragment, how many use `exp2_fma` instead of MUFU; `exp2=False`
        drops the exponential altogether (a timing ablation: probabilities are then wrong); `lazy`: lazy rescaling
        (module docstring)."""
        self.log2_scale = log2_scale
        self.row_max = cute.make_rmem_tensor(num_rows, Float32)
        self.row_sum = cute.make_rmem_tensor(num_rows, Float32)
        self.exp2_poly = exp2_poly  # trace-time constants, not carried as IR values
        self.exp2 = exp2
        self.lazy = lazy

    @cute.jit
    def reset(self):
        self.row_max.fill(-Float32.inf)
        self.row_sum.fill(0.0)

    @cute.jit
    def step(self, acc_s: cute.Tensor, row_scale: cute.Tensor, eager: cutlass.Constexpr[bool] = False):
        """Turn scores into unnormalised probabilities in place; write how much to shrink O by into row_scale.
        Lazy: returns a warp-uniform flag, true when the warp moved its references (row_scale then not all 1); the
        caller may skip the O rescale when it is false. Otherwise (or with `eager`: this step moves every reference
        to the true max, which any step may) returns None."""
        s_rows = rows_view(acc_s)
        num_rows = cute.size(self.row_max)
        m_prev = [self.row_max[r] for r in range(num_rows)]
        m_new = [cute.arch.fmax(m_prev[r], cute.arch.warp_reduction_max(row_max_ilp(s_rows[r, None]),
                                                                           threads_in_group=4))
                 for r in range(num_rows)]
        moved = None
        if cutlass.const_expr(self.lazy and not eager):
            # A row with no reference yet (-inf) grows by +inf as soon as it sees a score, so it always takes one:
            # the scale is > 0 (the launcher refuses others; at 0 the growth would read inf * 0 = NaN, false).
            grew = Int32(0)
            for r in cutlass.range_constexpr(num_rows):
                grows = (m_new[r] - m_prev[r]) * self.log2_scale > Float32(RESCALE_THRESHOLD)
                grew = grew | cutlass.select_(grows, Int32(1), Int32(0))
            moved = cute.arch.vote_any_sync(grew != 0)
            m_new = [cutlass.select_(moved, m_new[r], m_prev[r]) for r in range(num_rows)]
        for r in cutlass.range_constexpr(num_rows):
            row = s_rows[r, None].load()
            self.row_max[r] = m_new[r]
            # A row masked so far has m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
            m_safe = Float32(0.0) if m_new[r] == -Float32.inf else m_new[r]
            shift = m_safe * self.log2_scale
            if cutlass.const_expr(not self.exp2):
                s_rows[r, None].store(row * self.log2_scale - shift)
            elif cutlass.const_expr(self.exp2_poly == 0):
                s_rows[r, None].store(cute.math.exp2(row * self.log2_scale - shift, fastmath=True))
            else:
                s_rows[r, None].store(row * self.log2_scale - shift)
                exp2_mixed(s_rows[r, None], self.exp2_poly)
            scale = cute.math.exp2((m_prev[r] - m_safe) * self.log2_scale, fastmath=True)
            row_scale[r] = scale
            self.row_sum[r] = row_sum_ilp(s_rows[r, None], self.row_sum[r] * scale)
        return moved

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
def exp2_mixed(row: cute.Tensor, per8: cutlass.Constexpr[int]):
    """row[j] <- 2^row[j] in place: `per8` of every 8 elements on the FMA pipe, the rest with ex2.approx."""
    for j in cutlass.range_constexpr(cute.size(row)):
        if cutlass.const_expr(j % 8 < per8):
            row[j] = exp2_fma(row[j])
        else:
            row[j] = cute.math.exp2(row[j], fastmath=True)


@cute.jit
def exp2_fma(x: Float32) -> Float32:
    """2^x for x < 128 without MUFU: x = j + f (j = floor(x), 0 <= f < 1), 2^f from EXP2_POLY, j added to the
    exponent. Inputs below -127 (and -inf) give 0; lazy rescaling passes x up to RESCALE_THRESHOLD."""
    x = cute.arch.fmax(x, Float32(-127.0))
    shifted = _add_round_down(x, Float32(_ROUND_MAGIC))  # MAGIC + floor(x), exactly
    frac = x - (shifted - Float32(_ROUND_MAGIC))
    c1, c2, c3 = EXP2_POLY
    poly = Float32(1.0) + frac * (Float32(c1) + frac * (Float32(c2) + frac * Float32(c3)))
    return _add_exponent(poly, shifted)


@dsl_user_op
def _add_round_down(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """a + b rounded toward -inf (an FADD on the FMA pipe)."""
    return Float32(llvm.inline_asm(
        T.f32(), [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
        "add.rm.ftz.f32 $0, $1, $2;", "=f,f,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def _add_exponent(mantissa: Float32, shifted: Float32, *, loc=None, ip=None) -> Float32:
    """Bits of `mantissa` plus (low bits of `shifted`) << 23: multiplies by 2^floor(x) through the exponent field."""
    return Float32(llvm.inline_asm(
        T.f32(), [Float32(mantissa).ir_value(loc=loc, ip=ip), Float32(shifted).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .b32 m, s, e, o;\n\tmov.b32 m, $1;\n\tmov.b32 s, $2;\n\tshl.b32 e, s, 23;\n\t"
        "add.s32 o, m, e;\n\tmov.b32 $0, o;\n\t}", "=f,f,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


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
