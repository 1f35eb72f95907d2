"""Backward postprocess: dQ = scale * dQaccum, fp32 -> the input dtype, dropping the rows padded to whole tiles.

The main kernel adds each KV block's dS K into an fp32 buffer (several CTAs touch one dQ row, so it must stay fp32
until all of them are done); the softmax scale is applied here once instead of on every partial sum. The buffer holds
each query tile's partials in the consumers' register order (`bwd_dq.fragment_order`), so one CTA per query tile
runs the main kernel's consumer threads again: thread t of warpgroup w reads what it wrote there (16-byte loads),
scales and converts it, and puts it in place through shared memory, from where the rows leave with 16-byte stores.
Chained (`BwdConfig.chained_launch`), its CTAs start while the main kernel drains and wait for it before reading.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass.memory import SmemAllocator

from .bwd_dq import dq_fragment_shape, fragment_order, make_dq_tiled_mma
from .layout import convert_to_16bit

CHUNK = 8  # 16-bit elements per 16-byte store


class BwdPostprocess:
    """Compile-time configuration: output dtype, head dim and the main kernel's dQ geometry (`BwdConfig.dq_layout`:
    query rows per tile, consumer warpgroups, whether they split dQ by rows or by columns, whether dQ is transposed),
    and whether it is launched chained to the main kernel (`BwdConfig.chained_launch`)."""

    def __init__(self, dtype, head_dim: int, dq_layout: tuple, chained: bool = True):
        self.dtype, self.head_dim, self.chained = dtype, head_dim, chained
        self.tile_m, self.num_wg, self.split_rows, self.swap_ab = dq_layout
        self.num_threads = 128 * self.num_wg
        if head_dim % CHUNK or (self.tile_m * head_dim // CHUNK) % self.num_threads:
            raise ValueError(f"head_dim={head_dim} with dQ layout {dq_layout} is not supported by the dQ postprocess")
        # Staging rows padded by 16 bytes: a warp's 4-byte stores (8 rows x 4 column pairs) then hit 32 banks.
        self.pitch = head_dim + CHUNK

    @cute.jit
    def __call__(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, scale: Float32, stream: cuda.CUstream):
        """mdQaccum (B, H, Sq_padded, D) fp32; mdQ (B, H, Sq, D) in the input dtype."""
        tiled_mma = make_dq_tiled_mma(self.dtype, self.head_dim, self.num_wg, self.split_rows, self.swap_ab,
                                      self.tile_m)
        grid = [cute.ceil_div(mdQ.shape[2], self.tile_m), mdQ.shape[1], mdQ.shape[0]]
        smem = self.tile_m * self.pitch * self.dtype.width // 8
        self.kernel(mdQaccum, mdQ, scale, tiled_mma).launch(grid=grid, block=[self.num_threads, 1, 1], smem=smem,
                                                            stream=stream, use_pdl=self.chained)

    @cute.kernel
    def kernel(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, scale: Float32, tiled_mma: cute.TiledMma):
        if cutlass.const_expr(self.chained):
            cute.arch.griddepcontrol_wait()  # every dQ partial of the main kernel (and of the cut tiles' parts)
        tidx = cute.arch.thread_idx()[0]
        m_block, head, batch = cute.arch.block_idx()
        tile_m, hd = self.tile_m, self.head_dim
        thr = tiled_mma.get_slice(tidx)
        frag_shape = dq_fragment_shape(thr, tile_m, hd, self.swap_ab)

        # This query tile's num_wg slabs, contiguous in dQaccum; thread tidx reads back its own fragment.
        gtile = cute.local_tile(mdQaccum[batch, head, None, None], (tile_m, hd), (m_block, 0))
        base = cute.make_ptr(Float32, gtile.iterator.toint(), cute.AddressSpace.gmem, assumed_align=16)
        slab_elems = tile_m * hd // self.num_wg
        slab = cute.make_tensor(base + (tidx // 128) * slab_elems, cute.make_layout(slab_elems))
        acc = cute.make_rmem_tensor(frag_shape, Float32)
        cute.autovec_copy(fragment_order(slab, tidx % 128, frag_shape), acc)
        acc.store(acc.load() * scale)
        out = cute.make_rmem_tensor(frag_shape, self.dtype)
        convert_to_16bit(acc, out)

        staged = SmemAllocator().allocate_tensor(self.dtype, cute.make_layout((tile_m, hd), stride=(self.pitch, 1)),
                                                 byte_alignment=16)
        if cutlass.const_expr(self.swap_ab):  # the fragment is of dQ^T: place it through a transposed view
            cute.autovec_copy(out, thr.partition_C(cute.make_tensor(
                staged.iterator, cute.make_layout((hd, tile_m), stride=(1, self.pitch)))))
        else:
            cute.autovec_copy(out, thr.partition_C(staged))
        cute.arch.barrier()

        chunks_per_row = hd // CHUNK
        for i in cutlass.range_constexpr(tile_m * chunks_per_row // self.num_threads):
            idx = i * self.num_threads + tidx
            r, c = idx // chunks_per_row, idx % chunks_per_row
            row = m_block * tile_m + r
            if row < mdQ.shape[2]:
                src = cute.local_tile(staged[r, None], (CHUNK,), (c,))
                cute.local_tile(mdQ[batch, head, row, None], (CHUNK,), (c,)).store(src.load())


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
