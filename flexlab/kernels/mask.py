"""Masking of the S accumulator: the sequence tail (keys past Skv) and the user's mask_mod on partial blocks.

Both write -inf, which the online softmax turns into probability 0. Coordinates come from an identity tensor
partitioned exactly like the accumulator, so element i of `coords` is the (row, col) of element i of `acc_s`.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def keep_or_neg_inf(keep: Boolean, score: Float32, *, loc=None, ip=None) -> Float32:
    """`score` where `keep`, else -inf, as one selp the compiler cannot split: given a conjunction, ptxas then folds
    the conditions into one predicate (ISETP ... AND) and selects once, where LLVM would select once per condition.
    Used for masks the code generator marks `one_select` (`flexlab.codegen.lower_cute.one_select`)."""
    return Float32(llvm.inline_asm(
        T.f32(), [Float32(score).ir_value(loc=loc, ip=ip), Boolean(keep).ir_value(loc=loc, ip=ip)],
        "selp.f32 $0, $1, 0fFF800000, $2;", "=f,f,b",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


def element_indices(coords: cute.Tensor, i: int, q_start: Int32, kv_start: Int32, q_last: Int32, kv_last: Int32,
                    clamp: bool):
    """(q_idx, kv_idx) of accumulator element i, the mods' arguments. With captured tensors (`clamp`) the indices of
    padded rows/columns are clamped to the last valid one, so a mod never reads past a captured buffer; those
    elements are discarded (rows never stored, columns masked by the tail mask). A trace-time helper of the mod
    loops below, in `score_mod` and in the backward's `mod_backward`."""
    q_idx = q_start + coords[i][0]
    kv_idx = kv_start + coords[i][1]
    if clamp:
        q_idx = cutlass.min(q_idx, q_last)
        kv_idx = cutlass.min(kv_idx, kv_last)
    return q_idx, kv_idx


@cute.jit
def mask_kv_tail(acc_s: cute.Tensor, coords: cute.Tensor, kv_start: Int32, seqlen_k: Int32):
    """Keys at or past seqlen_k were zero-filled by TMA; they must not get any probability."""
    limit = seqlen_k - kv_start
    for i in cutlass.range_constexpr(cute.size(acc_s)):
        acc_s[i] = acc_s[i] if coords[i][1] < limit else -Float32.inf


@cute.jit
def apply_mask_mod(acc_s: cute.Tensor, coords: cute.Tensor, mask_mod: cutlass.Constexpr, batch: Int32, head: Int32,
                   q_start: Int32, kv_start: Int32, q_last: Int32, kv_last: Int32, clamp: cutlass.Constexpr[bool],
                   aux_tensors, aux_scalars):
    """Evaluate mask_mod(b, h, q_idx, kv_idx) per element (indices from `element_indices`); False -> -inf."""
    for i in cutlass.range_constexpr(cute.size(acc_s)):
        q_idx, kv_idx = element_indices(coords, i, q_start, kv_start, q_last, kv_last, clamp)
        keep = mask_mod(batch, head, q_idx, kv_idx, aux_tensors, aux_scalars)
        if cutlass.const_expr(getattr(mask_mod, "one_select", False)):
            acc_s[i] = keep_or_neg_inf(keep, acc_s[i])
        else:
            acc_s[i] = acc_s[i] if keep else -Float32.inf


@cute.jit
def mask_mod_bits(bits: cute.Tensor, coords: cute.Tensor, mask_mod: cutlass.Constexpr, batch: Int32, head: Int32,
                  q_start: Int32, kv_start: Int32, q_last: Int32, kv_last: Int32, clamp: cutlass.Constexpr[bool],
                  aux_tensors, aux_scalars):
    """mask_mod of every element of `coords` into bit i % 32 of word i // 32 of `bits` (Uint32 registers).

    Needs no scores, so the kernel can run it while the QK GEMM is still on the tensor cores: the loads of captured
    tensors (a document id per row and per column) then wait behind the GEMM instead of after it.
    """
    n = cute.size(coords)
    for w in cutlass.range_constexpr(cute.size(bits)):
        word = Uint32(0)
        for j in cutlass.range_constexpr(32):
            if cutlass.const_expr(w * 32 + j < n):
                q_idx, kv_idx = element_indices(coords, w * 32 + j, q_start, kv_start, q_last, kv_last, clamp)
                keep = mask_mod(batch, head, q_idx, kv_idx, aux_tensors, aux_scalars)
                word = word | cutlass.select_(keep, Uint32(1 << j), Uint32(0))
        bits[w] = word


@cute.jit
def apply_mask_bits(acc_s: cute.Tensor, bits: cute.Tensor):
    """-inf where `mask_mod_bits` left a 0 bit."""
    for i in cutlass.range_constexpr(cute.size(acc_s)):
        keep = (bits[i // 32] & Uint32(1 << (i % 32))) != Uint32(0)
        acc_s[i] = acc_s[i] if keep else -Float32.inf


# ---------------------------------------------------------------------------- partial-block masks stored as bits
# (`flexlab.runtime.mask_bits` builds them.) A Hopper m64nN accumulator gives a thread the scores of two rows,
# `row` and `row + 8`, columns 8 j + 2 t + e (t = lane % 4, e = 0/1), as element e + 2 h + 4 j of its fragment
# (h = 0/1 for the two rows). The stored row keeps those 32 columns in word t, column 8 j + 2 t + e at bit 2 j + e.
FRAGMENT_ROWS = 2


@cute.jit
def load_fragment_bits(words: cute.Tensor, bits: cute.Tensor, batch: Int32, head: Int32, outer: Int32,
                       position: Int32, row: Int32, word: Int32):
    """This thread's two words (into `words`, FRAGMENT_ROWS Uint32 registers) of stored block `position` of tile
    `outer`: rows `row` and `row + 8`, word `word` (= lane % 4). Issued before the S GEMM is waited for, so the
    loads' latency hides behind it."""
    b = batch % bits.shape[0]
    h = head % bits.shape[1]
    for r in cutlass.range_constexpr(FRAGMENT_ROWS):
        words[r] = Uint32(bits[b, h, outer, position, row + 8 * r, word])


@cute.jit
def apply_fragment_bits(acc_s: cute.Tensor, words: cute.Tensor):
    """-inf where the stored mask has a 0 bit; element e + 2 h + 4 j tests bit 2 j + e of word h."""
    n = cute.size(acc_s)
    if cutlass.const_expr(n not in (32, 64)):
        raise ValueError(f"stored mask bits cover one m64n64 or m64n128 accumulator fragment per thread (32 or 64 "
                         f"scores), got {n}")
    for i in cutlass.range_constexpr(n):
        e, h, j = i % 2, (i // 2) % 2, i // 4
        acc_s[i] = keep_bit_or_neg_inf(words[h], 1 << (2 * j + e), acc_s[i])


@dsl_user_op
def keep_bit_or_neg_inf(word: Uint32, bit: cutlass.Constexpr[int], score: Float32, *, loc=None, ip=None) -> Float32:
    """`score` where `word & bit` is set, else -inf. Written as and + setp + selp so ptxas makes one predicate-
    writing LOP3 and one FSEL per score; the same test in LLVM IR became a shift, an AND and the select."""
    return Float32(llvm.inline_asm(
        T.f32(), [Float32(score).ir_value(loc=loc, ip=ip), Uint32(word).ir_value(loc=loc, ip=ip)],
        "{\n.reg .pred p;\n.reg .b32 t;\nand.b32 t, $2, " + str(int(bit)) + ";\nsetp.ne.u32 p, t, 0;\n"
        "selp.f32 $0, $1, 0fFF800000, p;\n}",
        "=f,f,r", has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


# ---------------------------------------------------------------------------- band masks
# A mask_mod the code generator recognises as a band (`flexlab.codegen.band`: keys lo(q) <= kv_idx < hi(q)) is
# applied per row, not per score: the row's key range becomes a count of the thread's leading elements below each
# bound, two shifts make a word with one bit per element, and each score is kept or set to -inf by its bit (ptxas
# moves several bits into predicates at once with R2P). The thread's elements of one row sit at columns
# 8 j + e (j = 0, 1, ..., e = 0/1) past its first one, in the accumulator layout `apply_fragment_bits` reads.
BAND_MAX_ROW_ELEMENTS = 32  # one 32-bit word per row: tiles up to 128 keys wide


def _band_fits(num_scores: int) -> bool:
    return num_scores % (2 * FRAGMENT_ROWS) == 0 and num_scores // FRAGMENT_ROWS <= BAND_MAX_ROW_ELEMENTS


def band_for(mask_mod, acc_s: cute.Tensor, enabled: bool, by_key: bool = False):
    """The generated band of `mask_mod` (`mask_band`, or `mask_band_by_key` for the backward's key rows) where a
    kernel option `enabled` band masking and this accumulator's rows fit one word each, else None: the caller then
    evaluates mask_mod per score. A trace-time helper shared by the forward and backward steps."""
    band = getattr(mask_mod, "band_by_key" if by_key else "band", None)
    return band if enabled and band is not None and _band_fits(cute.size(acc_s)) else None


@dsl_user_op
def _ones_from(count: Int32, *, loc=None, ip=None) -> Uint32:
    """0xFFFFFFFF << count as PTX computes it: 0 for count >= 32 (a count is never negative here)."""
    return Uint32(llvm.inline_asm(
        T.i32(), [Int32(count).ir_value(loc=loc, ip=ip)], "shl.b32 $0, -1, $1;", "=r,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def _elements_before(limit: Int32) -> Int32:
    """How many of a thread's row elements lie at column offsets (8 j + e) below `limit`."""
    x = cutlass.max(limit, Int32(0))
    return (x >> 3) * 2 + cutlass.min(x & 7, Int32(2))


@cute.jit
def apply_band_mask(acc_s: cute.Tensor, coords: cute.Tensor, band: cutlass.Constexpr, batch: Int32, head: Int32,
                    q_start: Int32, kv_start: Int32, aux_tensors, aux_scalars, by_key: cutlass.Constexpr[bool] = False):
    """-inf outside each row's range `band(b, h, row index, ...)` = (lo, hi); the same result as mask_mod. Rows are
    queries and the range is of keys (`mask_band`), or with `by_key` (the backward's S^T, `coords` still (q, kv))
    rows are keys and the range is of queries (`mask_band_by_key`)."""
    words = cute.make_rmem_tensor(FRAGMENT_ROWS, Uint32)
    band_words(words, cute.size(acc_s), coords, band, batch, head, q_start, kv_start, aux_tensors, aux_scalars,
               by_key)
    apply_band_words(acc_s, words)


@cute.jit
def band_words(words: cute.Tensor, n: cutlass.Constexpr[int], coords: cute.Tensor, band: cutlass.Constexpr,
               batch: Int32, head: Int32, q_start: Int32, kv_start: Int32, aux_tensors, aux_scalars,
               by_key: cutlass.Constexpr[bool] = False):
    """`apply_band_mask`'s words, one per fragment row, into `words`, for an accumulator of `n` scores per thread:
    index arithmetic alone, so a step may form them while its scores are still on the tensor cores."""
    if cutlass.const_expr(not _band_fits(n)):
        raise ValueError(f"a band mask covers up to {BAND_MAX_ROW_ELEMENTS} scores per row of an m64nN accumulator "
                         f"fragment, got {n} scores over {FRAGMENT_ROWS} rows")
    row_axis, col_axis = (1, 0) if by_key else (0, 1)
    row_start, col_start = (kv_start, q_start) if by_key else (q_start, kv_start)
    first_col = col_start + coords[0][col_axis]
    for h in cutlass.range_constexpr(FRAGMENT_ROWS):
        lo, hi = band(batch, head, row_start + coords[2 * h][row_axis], aux_tensors, aux_scalars)
        from_lo = _ones_from(_elements_before(lo - first_col))  # elements at or past lo
        from_hi = _ones_from(_elements_before(hi - first_col))  # elements at or past hi
        words[h] = from_lo & ~from_hi


@cute.jit
def apply_band_words(acc_s: cute.Tensor, words: cute.Tensor):
    """-inf where a `band_words` word has a 0 bit: element e + 2 h + 4 j tests bit 2 j + e of word h."""
    for i in cutlass.range_constexpr(cute.size(acc_s)):
        e, h, j = i % 2, (i // 2) % 2, i // 4
        keep = Boolean(words[h] & (Uint32(1) << (2 * j + e)))
        acc_s[i] = acc_s[i] if keep else -Float32.inf
