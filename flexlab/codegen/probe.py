"""A small Hopper test kernel that runs generated mods the way attention kernels do, on register fragments.

Each CTA (one warpgroup) loads a 64x16 score tile into a fragment laid out like a wgmma accumulator, derives every
element's (q_idx, kv_idx) from an identity tensor partitioned the same way, and calls the four generated functions
on each element: score_mod, mask_mod, score_mod_bwd and score_mod_aux_grad. CI compiles it for sm_90a on CPU with
fake tensors (the generated source must lower to PTX); on a GPU, `run_probe` compares it with the torch evaluator.
Positions past the logical sequence lengths are evaluated too, as in real padded tiles; callers zero `grad` there.

Importing this module imports cutlass; `flexlab.codegen` itself does not.
"""
from __future__ import annotations


import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass import BFloat16, Float32, Int32
from cutlass.cute.nvgpu import OperandMajorMode
from cutlass.cute.runtime import from_dlpack, make_fake_compact_tensor

from .generated import GeneratedMods

TILE_M, TILE_N = 64, 16  # one m64n16 wgmma accumulator: 8 Float32 values per thread of a warpgroup
NUM_THREADS = 128
COMPILE_OPTIONS = "--gpu-arch sm_90a"

_TORCH_TO_CUTE = {torch.float32: cutlass.Float32, torch.float16: cutlass.Float16, torch.bfloat16: cutlass.BFloat16,
                  torch.int32: cutlass.Int32, torch.int16: cutlass.Int16, torch.int8: cutlass.Int8,
                  torch.uint8: cutlass.Uint8}
_KERNEL_DTYPE = {torch.float64: torch.float32, torch.int64: torch.int32, torch.bool: torch.uint8}

_compiled: dict[tuple, object] = {}
compile_count = 0  # how many times cute.compile ran in this process (tests check that scalars never add one)


@cute.kernel
def _probe_kernel(mS: cute.Tensor, mGrad: cute.Tensor, mOut: cute.Tensor, mKeep: cute.Tensor, mDScore: cute.Tensor,
                  num_heads: Int32, aux_tensors: list, aux_scalars: list, aux_grads: list,
                  tiled_mma: cute.TiledMma, mods: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    m_block, n_block, bh = cute.arch.block_idx()
    b = bh // num_heads
    h = bh - b * num_heads
    thr_mma = tiled_mma.get_slice(tidx)
    tile, coord = (TILE_M, TILE_N), (m_block, n_block)
    tSgS = thr_mma.partition_C(cute.local_tile(mS[bh, None, None], tile, coord))
    tSgG = thr_mma.partition_C(cute.local_tile(mGrad[bh, None, None], tile, coord))
    tSgO = thr_mma.partition_C(cute.local_tile(mOut[bh, None, None], tile, coord))
    tSgK = thr_mma.partition_C(cute.local_tile(mKeep[bh, None, None], tile, coord))
    tSgD = thr_mma.partition_C(cute.local_tile(mDScore[bh, None, None], tile, coord))
    acc = cute.make_rmem_tensor(tiled_mma.partition_shape_C(tile), Float32)  # stands in for S = Q K^T
    acc.store(tSgS.load())
    tScS = thr_mma.partition_C(cute.domain_offset((m_block * TILE_M, n_block * TILE_N),
                                                  cute.make_identity_tensor(tile)))
    for i in cutlass.range_constexpr(cute.size(acc)):
        q_idx, kv_idx = tScS[i][0], tScS[i][1]
        score, grad = acc[i], tSgG[i]
        tSgO[i] = mods.score_mod(score, b, h, q_idx, kv_idx, aux_tensors, aux_scalars)
        keep = mods.mask_mod(b, h, q_idx, kv_idx, aux_tensors, aux_scalars)
        tSgK[i] = Float32(cutlass.select_(keep, Float32(1.0), Float32(0.0)))
        tSgD[i] = mods.score_mod_bwd(grad, score, b, h, q_idx, kv_idx, aux_tensors, aux_scalars)
        mods.score_mod_aux_grad(grad, score, b, h, q_idx, kv_idx, aux_tensors, aux_scalars, aux_grads)


@cute.jit
def _probe_host(mS: cute.Tensor, mGrad: cute.Tensor, mOut: cute.Tensor, mKeep: cute.Tensor, mDScore: cute.Tensor,
                num_heads: Int32, aux_tensors: list, aux_scalars: list, aux_grads: list, mods: cutlass.Constexpr):
    tiled_mma = sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K,
                                                  Float32, atom_layout_mnk=(1, 1, 1), tiler_mn=(TILE_M, TILE_N))
    grid = [cute.ceil_div(mS.shape[1], TILE_M), cute.ceil_div(mS.shape[2], TILE_N), mS.shape[0]]
    _probe_kernel(mS, mGrad, mOut, mKeep, mDScore, num_heads, aux_tensors, aux_scalars, aux_grads, tiled_mma,
                  mods).launch(grid=grid, block=[NUM_THREADS, 1, 1])


def _kernel_dtype(t: torch.Tensor) -> torch.dtype:
    return _KERNEL_DTYPE.get(t.dtype, t.dtype)


def _fake(dtype: torch.dtype, rank: int, divisibility: int = 1):
    shape = tuple(cute.sym_int32(divisibility=divisibility) for _ in range(rank))
    size = torch.empty((), dtype=dtype).element_size()
    return make_fake_compact_tensor(_TORCH_TO_CUTE[dtype], shape, stride_order=tuple(reversed(range(rank))),
                                    assumed_align=size)


def compile_probe(gen: GeneratedMods, options: str = COMPILE_OPTIONS):
    """Compile the probe kernel for `gen` (sm_90a, fake tensors), cached on gen.hash: scalars are runtime args."""
    global compile_count
    aux_meta = tuple((_kernel_dtype(t), max(t.dim(), 1)) for t in gen.aux_tensors)
    key = (gen.hash, aux_meta, options)
    if key not in _compiled:
        tile_fake = lambda: make_fake_compact_tensor(  # noqa: E731
            Float32, (cute.sym_int32(), cute.sym_int32(divisibility=TILE_M), cute.sym_int32(divisibility=TILE_N)),
            stride_order=(2, 1, 0), assumed_align=16)
        aux = [_fake(dtype, rank) for dtype, rank in aux_meta]
        grads = [_fake(torch.float32, max(t.dim(), 1)) for t, rg in zip(gen.aux_tensors, gen.aux_requires_grad)
                 if rg]
        from ..runtime.compile import dsl_compile
        _compiled[key] = dsl_compile(_probe_host, tile_fake(), tile_fake(), tile_fake(), tile_fake(), tile_fake(),
                                     Int32(1), aux, gen.kernel_aux_scalars(), grads, gen.module(), options=options)
        compile_count += 1
    return _compiled[key]


def _to_cute(t: torch.Tensor, align: int | None = None):
    """A dynamic-layout view matching the fake tensors the probe was compiled with."""
    return from_dlpack(t, assumed_align=align or t.element_size()).mark_layout_dynamic(leading_dim=t.dim() - 1)


def run_probe(gen: GeneratedMods, B: int, H: int, seqlen_q: int, seqlen_kv: int, *, scalars=None,
              device: str = "cuda", seed: int = 0) -> dict[str, torch.Tensor]:
    """Run the probe kernel on random scores/grads; returns kernel outputs and the evaluator's, on valid positions.

    Keys: score, keep, dscore (kernel) and ref_score, ref_keep, ref_dscore; aux_grads / ref_aux_grads lists.
    """
    compiled = compile_probe(gen)
    gen_ = torch.Generator(device="cpu").manual_seed(seed)
    Mp = -(-seqlen_q // TILE_M) * TILE_M
    Np = -(-seqlen_kv // TILE_N) * TILE_N
    scores = torch.randn(B * H, Mp, Np, generator=gen_) * 4
    grad = torch.randn(B * H, Mp, Np, generator=gen_)
    grad[:, seqlen_q:, :] = 0  # padded positions: callers pass grad = 0 there
    grad[:, :, seqlen_kv:] = 0
    scores, grad = scores.to(device), grad.to(device)
    out, keep, dscore = (torch.zeros_like(scores) for _ in range(3))
    aux = [t.to(device) for t in gen.kernel_aux_tensors()]
    with_grad = [t for t, rg in zip(gen.aux_tensors, gen.aux_requires_grad) if rg]
    aux_grads = [torch.zeros(t.shape if t.dim() else (1,), dtype=torch.float32, device=device) for t in with_grad]
    compiled(*[_to_cute(t, 16) for t in (scores, grad, out, keep, dscore)], Int32(H), [_to_cute(t) for t in aux],
             gen.kernel_aux_scalars(scalars), [_to_cute(t) for t in aux_grads])
    torch.cuda.synchronize()

    sl = (slice(None), slice(0, seqlen_q), slice(0, seqlen_kv))
    shape4 = (B, H, seqlen_q, seqlen_kv)
    # The reference runs in float32 like the kernel: the question here is "same IR, same numbers", and float32
    # keeps discontinuous ops (floor, %, int casts) from flipping at boundaries because of a wider type.
    s32 = scores[sl].reshape(shape4)
    g32 = grad[sl].reshape(shape4)
    idx = dict(b=torch.arange(B, device=device).view(B, 1, 1, 1), h=torch.arange(H, device=device).view(1, H, 1, 1),
               q_idx=torch.arange(seqlen_q, device=device).view(1, 1, -1, 1),
               kv_idx=torch.arange(seqlen_kv, device=device).view(1, 1, 1, -1))
    ref_score = gen.evaluate_score_mod(s32, **idx, scalars=scalars)
    ref_keep = gen.evaluate_mask_mod(**idx, scalars=scalars)
    ref_dscore = gen.evaluate_score_mod_bwd(g32, s32, **idx, scalars=scalars)
    ref_aux = gen.evaluate_aux_grads(g32, s32, **idx, scalars=scalars)
    return {
        "score": out[sl].reshape(shape4), "keep": keep[sl].reshape(shape4) > 0.5, "dscore": dscore[sl].reshape(shape4),
        "ref_score": ref_score.expand(shape4), "ref_keep": ref_keep.expand(shape4),
        "ref_dscore": ref_dscore.expand(shape4),
        "aux_grads": [g.reshape(t.shape) for g, t in zip(aux_grads, with_grad)],
        "ref_aux_grads": ref_aux,
    }
