"""Register-fragment views of the wgmma accumulator, and the packed fp32 -> 16-bit conversion.

A Hopper m64nN accumulator gives each thread `((2, 2, N/8), MMA_M, MMA_N)` fp32 values: mode 0 is
(column pair, row +0/+8, column block of 8). Softmax wants rows and columns; the PV GEMM wants the same registers
in the A-operand order. Both are re-views of the same registers, so nothing moves.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def tma_tiles(atom, smem: cute.Tensor, gmem: cute.Tensor):
    """(shared, global) views for one CTA's TMA copies between `smem` and the tile(s) `gmem` (no multicast): the
    tile's two modes grouped into one, so `cute.copy(atom, g[None, i], s[None, stage])` moves whole tiles."""
    from cutlass.cute.nvgpu import cpasync
    return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, 2),
                                 cute.group_modes(gmem, 0, 2))


def rows_view(acc: cute.Tensor) -> cute.Tensor:
    """(rows, cols) view of a thread's accumulator: rows = (row +0/+8, MMA_M), cols = (pair, N/8 block, MMA_N)."""
    flat = cute.make_layout(acc.layout.shape)  # column-major numbering of the fragment's own shape
    sh, st = flat.shape, flat.stride
    mn = cute.make_layout(
        ((sh[0][1], sh[1]), (sh[0][0], sh[0][2], sh[2])),
        stride=((st[0][1], st[1]), (st[0][0], st[0][2], st[2])),
    )
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


def row_major_order(shape) -> list[int]:
    """Flat indices of an accumulator fragment of static shape ((2, 2, N/8), MMA_M, MMA_N), row by row: each of the
    thread's rows (row +0/+8, MMA_M) with all its columns (pair, N/8 block, MMA_N) before the next row."""
    (pairs, halves, blocks), mma_m, mma_n = shape
    return [p + pairs * (h + halves * (b + blocks * (m + mma_m * n)))
            for m in range(mma_m) for h in range(halves) for n in range(mma_n) for b in range(blocks)
            for p in range(pairs)]


def as_operand_a(acc: cute.Tensor) -> cute.Tensor:
    """Re-view an S accumulator ((2,2,N/8), M, 1) as a wgmma A fragment ((2,2,2), M, N/16) for the P.V GEMM."""
    lay = cute.logical_divide(acc.layout, ((None, None, 2), None, None))
    sh, st = lay.shape, lay.stride
    frg = cute.make_layout(
        ((sh[0][0], sh[0][1], sh[0][2][0]), sh[1], (sh[0][2][1], sh[2])),
        stride=((st[0][0], st[0][1], st[0][2][0]), st[1], (st[0][2][1], st[2])),
    )
    return cute.make_tensor(acc.iterator, frg)


def transpose_smem(t: cute.Tensor) -> cute.Tensor:
    """Swap the first two modes of a (possibly staged) shared-memory tensor: (N, D, stages) -> (D, N, stages)."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


def bshd_view(t: cute.Tensor) -> cute.Tensor:
    """(B, H, S, D) as torch hands it -> (S, D, H, B), the order TMA tiles and per-head slices want."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 3, 1, 0]))


@dsl_user_op
def pack_f32x2(a: Float32, b: Float32, to_bf16: cutlass.Constexpr[bool], *, loc=None, ip=None) -> Int32:
    """Two fp32 -> one register of two bf16/fp16 with a single cvt (the DSL emits two scalar converts)."""
    kind = "bf16x2" if to_bf16 else "f16x2"
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
            f"cvt.rn.{kind}.f32 $0, $2, $1;",
            "=r,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@cute.jit
def convert_to_16bit(src: cute.Tensor, dst: cute.Tensor):
    """fp32 fragment -> bf16/fp16 fragment of the same size, two elements per instruction."""
    dst32 = cute.recast_tensor(dst, Int32)
    to_bf16 = dst.element_type is cutlass.BFloat16
    for i in cutlass.range_constexpr(cute.size(dst32)):
        dst32[i] = pack_f32x2(src[2 * i], src[2 * i + 1], to_bf16)
