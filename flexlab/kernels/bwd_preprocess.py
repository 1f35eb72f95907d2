"""Backward preprocess: per query row, D = rowsum(dO * O) - dLSE and the LSE in base 2, padded to whole Q tiles;
and the fp32 dQ sums the main kernel adds into, zeroed.

The main backward kernel recomputes P = exp2(S * c - LSE2) and needs D for dS = P * (dP - D). Doing both per row
once here keeps the main loop free of reductions over the head dim. Rows are padded to a multiple of the backward
tile so the main kernel reads these buffers without bounds checks; a padded or fully masked row gets LSE2 = +inf,
which makes every P of that row exactly 0 (so it contributes no gradient), and D = 0. Zeroing the dQ sums here, row
by row over the same padded rows, saves the step a separate fill kernel and its launch.

Chained (`BwdConfig.chained_launch`): launched with programmatic dependent launch, so its CTAs may start while the
kernel before it on the stream (which may have written O or dO) drains; each waits for it before touching memory,
then lets the main kernel's launch begin.

One row is handled by `THREADS_PER_ROW` consecutive lanes, each loading D / THREADS_PER_ROW contiguous elements of O
and dO (16-byte vector loads) and reducing with butterfly shuffles.
"""
from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32

LOG2_E = math.log2(math.e)
THREADS_PER_ROW = 8
NUM_THREADS = 128
ROWS_PER_CTA = NUM_THREADS // THREADS_PER_ROW
ZERO_VECTOR = 4  # fp32 zeros per store (16 bytes)


class BwdPreprocess:
    """Compile-time configuration: element type, head dim, whether a gradient flows into the LSE output, and whether
    the backward's kernels are chained (`BwdConfig.chained_launch`)."""

    def __init__(self, dtype, head_dim: int, has_dlse: bool, chained: bool = True):
        if head_dim % (THREADS_PER_ROW * 8):
            raise ValueError(f"head_dim={head_dim} must be a multiple of {THREADS_PER_ROW * 8}")
        self.dtype, self.head_dim, self.has_dlse, self.chained = dtype, head_dim, has_dlse, chained
        self.chunk = head_dim // THREADS_PER_ROW

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mdLSE, mDpsum: cute.Tensor,
                 mLSE2: cute.Tensor, mdQaccum: cute.Tensor, stream: cuda.CUstream):
        """mO/mdO (B, H, Sq, D); mLSE/mdLSE (B, H, Sq) fp32; mDpsum/mLSE2 (B, H, Sq_padded) fp32 outputs;
        mdQaccum (B, H, Sq_padded, D) fp32, zeroed (the main kernel reads it in its own layout of the same
        elements)."""
        grid = [cute.ceil_div(mDpsum.shape[2], ROWS_PER_CTA), mO.shape[1], mO.shape[0]]
        self.kernel(mO, mdO, mLSE, mdLSE, mDpsum, mLSE2, mdQaccum).launch(grid=grid, block=[NUM_THREADS, 1, 1],
                                                                          stream=stream, use_pdl=self.chained)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mdLSE, mDpsum: cute.Tensor,
               mLSE2: cute.Tensor, mdQaccum: cute.Tensor):
        if cutlass.const_expr(self.chained):
            cute.arch.griddepcontrol_wait()  # (the kernel before may write O or dO, or use dq_accum's memory)
            cute.arch.griddepcontrol_launch_dependents()
        tidx = cute.arch.thread_idx()[0]
        row_block, head, batch = cute.arch.block_idx()
        row = row_block * ROWS_PER_CTA + tidx // THREADS_PER_ROW
        part = tidx % THREADS_PER_ROW
        seqlen_q = mO.shape[2]
        # First the CTA's rows of dQ sums, zeroed before any load so the stores are in flight while the loads wait:
        # each pass of the 128 threads writes one contiguous 2 KiB span, 16 bytes per thread.
        for i in cutlass.range_constexpr(ROWS_PER_CTA * self.head_dim // (NUM_THREADS * ZERO_VECTOR)):
            flat = (i * NUM_THREADS + tidx) * ZERO_VECTOR
            zero_row = row_block * ROWS_PER_CTA + flat // self.head_dim
            if zero_row < mDpsum.shape[2]:
                vec = cute.local_tile(mdQaccum[batch, head, zero_row, None], (ZERO_VECTOR,),
                                      ((flat % self.head_dim) // ZERO_VECTOR,))
                vec.store(cute.zeros_like(vec.load()))
        dot = Float32(0.0)
        if row < seqlen_q:
            o = cute.local_tile(mO[batch, head, row, None], (self.chunk,), (part,)).load().to(Float32)
            do = cute.local_tile(mdO[batch, head, row, None], (self.chunk,), (part,)).load().to(Float32)
            dot = (o * do).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        for offset in cutlass.range_constexpr(int(math.log2(THREADS_PER_ROW)) - 1, -1, -1):
            dot = dot + cute.arch.shuffle_sync_bfly(dot, offset=1 << offset)
        if part == 0 and row < mDpsum.shape[2]:
            lse2 = Float32.inf
            d = Float32(0.0)
            if row < seqlen_q:
                lse = Float32(mLSE[batch, head, row])
                if lse != -Float32.inf:
                    lse2 = lse * LOG2_E
                    d = dot
                    if cutlass.const_expr(self.has_dlse):
                        d = dot - Float32(mdLSE[batch, head, row])
            mDpsum[batch, head, row] = d
            mLSE2[batch, head, row] = lse2


def fake_arguments(dtype, head_dim: int, has_dlse: bool):
    """Symbolic-shape stand-ins for compiling without a GPU, in exactly the layouts `bwd_launch.backward` passes
    (TVM-FFI checks every call against them): O/dO TMA-ready (B, H, S, D), the row buffers (B, H, S) with unit last
    stride; the stream is torch's current one (TVM-FFI environment stream)."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

    def bhsd():
        shape = (cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), head_dim)
        stride = (cute.sym_int64(divisibility=8), cute.sym_int64(divisibility=8), cute.sym_int64(divisibility=8), 1)
        return make_fake_tensor(dtype, shape, stride, assumed_align=16)

    def rows():
        return make_fake_compact_tensor(Float32, (cute.sym_int32(), cute.sym_int32(), cute.sym_int32()),
                                        stride_order=(2, 1, 0), assumed_align=4)

    dq_accum = make_fake_compact_tensor(Float32, (cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), head_dim),
                                        stride_order=(3, 2, 1, 0), assumed_align=16)
    return (bhsd(), bhsd(), rows(), rows() if has_dlse else None, rows(), rows(), dq_accum,
            make_fake_stream(use_tvm_ffi_env_stream=True))

