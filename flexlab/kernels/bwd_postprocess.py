"""Backward postprocess: dQ = scale * dQaccum, fp32 -> the input dtype, dropping the rows padded to whole tiles.

The main kernel adds each KV block's dS K into an fp32 buffer (several CTAs touch one dQ row, so it must stay fp32
until all of them are done); the softmax scale is applied here once instead of on every partial sum. Each thread
converts 8 consecutive elements: two 16-byte loads, one 16-byte store.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import Float32

from .layout import convert_to_16bit

ELEMS_PER_THREAD = 8
NUM_THREADS = 128


class BwdPostprocess:
    """Compile-time configuration: output dtype and head dim."""

    def __init__(self, dtype, head_dim: int):
        if head_dim % ELEMS_PER_THREAD or NUM_THREADS % (head_dim // ELEMS_PER_THREAD):
            raise ValueError(f"head_dim={head_dim} is not supported by the dQ postprocess")
        self.dtype, self.head_dim = dtype, head_dim
        self.threads_per_row = head_dim // ELEMS_PER_THREAD
        self.rows_per_cta = NUM_THREADS // self.threads_per_row

    @cute.jit
    def __call__(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, scale: Float32, stream: cuda.CUstream):
        """mdQaccum (B, H, Sq_padded, D) fp32; mdQ (B, H, Sq, D) in the input dtype."""
        grid = [cute.ceil_div(mdQ.shape[2], self.rows_per_cta), mdQ.shape[1], mdQ.shape[0]]
        self.kernel(mdQaccum, mdQ, scale).launch(grid=grid, block=[NUM_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, scale: Float32):
        tidx = cute.arch.thread_idx()[0]
        row_block, head, batch = cute.arch.block_idx()
        row = row_block * self.rows_per_cta + tidx // self.threads_per_row
        part = tidx % self.threads_per_row
        if row < mdQ.shape[2]:
            acc = cute.local_tile(mdQaccum[batch, head, row, None], (ELEMS_PER_THREAD,), (part,))
            vals = cute.make_rmem_tensor(ELEMS_PER_THREAD, Float32)
            vals.store(acc.load() * scale)
            out = cute.make_rmem_tensor(ELEMS_PER_THREAD, self.dtype)
            convert_to_16bit(vals, out)
            cute.local_tile(mdQ[batch, head, row, None], (ELEMS_PER_THREAD,), (part,)).store(out.load())


def fake_arguments(dtype, head_dim: int):
    """Symbolic-shape stand-ins for compiling without a GPU, in exactly the layouts `bwd_launch.backward` passes
    (TVM-FFI checks every call against them): the contiguous fp32 accumulator, dQ shaped like the TMA-ready Q; the
    stream is torch's current one (TVM-FFI environment stream)."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

    accum = make_fake_compact_tensor(Float32, (cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), head_dim),
                                     stride_order=(3, 2, 1, 0), assumed_align=16)
    shape = (cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), head_dim)
    stride = (cute.sym_int64(divisibility=8), cute.sym_int64(divisibility=8), cute.sym_int64(divisibility=8), 1)
    dq = make_fake_tensor(dtype, shape, stride, assumed_align=16)
    return accum, dq, Float32(1.0), make_fake_stream(use_tvm_ffi_env_stream=True)
