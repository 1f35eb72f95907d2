"""torch tensors in, the three backward kernels launched, (dq, dk, dv, captured-tensor grads) back.

preprocess (D, LSE in base 2) -> main kernel (dK, dV, fp32 dQ partial sums, captured-tensor grads) -> postprocess
(dQ = scale * sum). Each kernel is compiled once per configuration against symbolic shapes and kept in memory; the
key names everything that is baked into the machine code (generated mods by hash, tiles, dtype, which optional
inputs exist), never a runtime value.
"""
from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..errors import BackendUnavailableError
from .bwd_config import BwdConfig, default_bwd_config

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class BwdKey:
    """Everything the main backward kernel is specialised on."""

    source_hash: str
    has_score_mod: bool
    has_mask_mod: bool
    has_aux_grad: bool
    aux_tensor_specs: tuple  # ((dtype name, ndim), ...) of the captured tensors as the kernel reads them
    aux_scalar_kinds: tuple  # ("int" | "float", ...)
    aux_grad_ranks: tuple
    dtype: str
    config: BwdConfig
    block_sparse: bool
    deterministic: bool = False
    arch: str = "sm_90a"
    fixed_point_aux_grads: bool = False  # int64 fixed-point captured-tensor grads (deterministic mode)


_COMPILED: dict = {}
_LOCK = threading.Lock()


def _cutlass_dtype(name: str):
    from ..runtime.compile import _cutlass_dtype as convert
    return convert(name)


def _compiled(key, build):
    fn = _COMPILED.get(key)
    if fn is None:
        with _LOCK:
            fn = _COMPILED.get(key)
            if fn is None:
                fn = build()
                _COMPILED[key] = fn
    return fn


def compile_preprocess(dtype: str, head_dim: int, has_dlse: bool, arch: str = "sm_90a", options: str = ""):
    import cutlass.cute as cute
    from .bwd_preprocess import BwdPreprocess, fake_arguments
    dt = _cutlass_dtype(dtype)
    return cute.compile(BwdPreprocess(dt, head_dim, has_dlse), *fake_arguments(dt, head_dim, has_dlse),
                        options=f"--gpu-arch {arch}{options}")


def compile_postprocess(dtype: str, head_dim: int, arch: str = "sm_90a", options: str = ""):
    import cutlass.cute as cute
    from .bwd_postprocess import BwdPostprocess, fake_arguments
    dt = _cutlass_dtype(dtype)
    return cute.compile(BwdPostprocess(dt, head_dim), *fake_arguments(dt, head_dim),
                        options=f"--gpu-arch {arch}{options}")


def compile_main(key: BwdKey, module=None, options: str = ""):
    """`module` is the generated CuTeDSL module (score_mod, mask_mod, score_mod_bwd, score_mod_aux_grad)."""
    import cutlass.cute as cute
    from .bwd_sm90 import FlexBwdSm90, fake_arguments
    dt = _cutlass_dtype(key.dtype)
    score_mod = module.score_mod if key.has_score_mod else None
    kernel = FlexBwdSm90(key.config, dt, score_mod, module.score_mod_bwd if key.has_score_mod else None,
                         module.score_mod_aux_grad if key.has_aux_grad else None,
                         module.mask_mod if key.has_mask_mod else None, has_aux_tensors=bool(key.aux_tensor_specs),
                         deterministic=key.deterministic)
    args = fake_arguments(key.config, dt, key.block_sparse, key.aux_tensor_specs, key.aux_scalar_kinds,
                          key.aux_grad_ranks, key.deterministic, key.fixed_point_aux_grads)
    return cute.compile(kernel, *args, options=f"--gpu-arch {key.arch}{options}")


def q_direction_tensors(block_mask: list, block_size: list, cfg: BwdConfig, seqlen_k: int) -> tuple:
    """The BlockMask's Q-direction lists (per KV block: which Q blocks, partial then full) at the kernel tiles."""
    from ..runtime.sparsity import _split
    q_bs, kv_bs = block_size
    err = cfg.block_mask_error(q_bs, kv_bs)
    if err:
        raise BackendUnavailableError(f"backend='cute' backward: {err}; build the mask with BLOCK_SIZE=128")
    q_num, q_idx, full_num, full_idx = block_mask[4:8]
    if q_num is None:
        raise BackendUnavailableError("the BlockMask has no Q-direction block lists (q_num_blocks); build it with "
                                      "create_block_mask so the backward can skip empty blocks")
    n_kv_tiles = -(-seqlen_k // cfg.tile_n)
    rows, listed = kv_bs // cfg.tile_n, q_bs // cfg.tile_m
    num, idx = _split(q_num, q_idx, rows, listed, n_kv_tiles)
    if full_num is not None:
        fnum, fidx = _split(full_num, full_idx, rows, listed, n_kv_tiles)
    else:
        fnum, fidx = torch.zeros_like(num), torch.zeros_like(idx[..., :1])
    return num, idx, fnum, fidx


_Q_LISTS: "OrderedDict[tuple, tuple]" = OrderedDict()


def _cached_q_direction(block_mask: list, block_size: list, cfg: BwdConfig, seqlen_k: int) -> tuple:
    """`q_direction_tensors`, computed once per mask (entries hold the mask tensors, so their addresses stay theirs;
    the version counters catch in-place edits)."""
    key = (tuple((t.data_ptr(), t._version, tuple(t.shape)) if t is not None else None for t in block_mask[4:8]),
           tuple(block_size), cfg.tile_m, cfg.tile_n, seqlen_k)
    hit = _Q_LISTS.get(key)
    if hit is None:
        hit = (q_direction_tensors(block_mask, block_size, cfg, seqlen_k), tuple(block_mask[4:8]))
        _Q_LISTS[key] = hit
        while len(_Q_LISTS) > 16:
            _Q_LISTS.popitem(last=False)
    _Q_LISTS.move_to_end(key)
    return hit[0]


def visit_ranks(sparse: tuple, num_m_tiles: int) -> torch.Tensor:
    """(Bm, Hm, KV tiles, Q tiles) int32: for each KV tile visiting a Q tile, how many lower KV tiles visit it too.

    Deterministic mode reduces dQ partials in this order; KV tiles that skip a Q tile are not waited for."""
    num, idx, fnum, fidx = sparse
    Bm, Hm, n_kv = num.shape
    visits = torch.zeros((Bm, Hm, n_kv, num_m_tiles + 1), dtype=torch.int32, device=num.device)
    for count, lists in ((num, idx), (fnum, fidx)):
        listed = torch.arange(lists.shape[-1], device=num.device) < count.unsqueeze(-1)
        target = torch.where(listed, lists.long(), torch.full_like(lists, num_m_tiles, dtype=torch.long))
        visits.scatter_(-1, target, 1)
    visits = visits[..., :num_m_tiles]
    return (visits.cumsum(dim=2) - visits).to(torch.int32).contiguous()


def _to_cute(t: torch.Tensor, align: int = 4):
    """A cute tensor view with dynamic shapes/strides (unit stride on the last mode), as the kernels were compiled."""
    from cutlass.cute.runtime import from_dlpack
    # detach: saved forward outputs reach the backward still attached to the graph, and DLPack refuses those
    return from_dlpack(t.detach(), assumed_align=align).mark_layout_dynamic(leading_dim=t.dim() - 1)


def backward(dout, q, k, v, out, lse, dlse, entry, aux_tensors, block_mask, block_size, scale: float,
             aux_scalars, deterministic: bool, arch: str = "sm_90a"):
    """(dq, dk, dv, grads of `entry.grad_slots` in fp32). Inputs come from the autograd formula (validated)."""
    import cuda.bindings.driver as cuda
    from ..runtime.launch import tma_ready

    if q.dtype not in _DTYPES:
        raise BackendUnavailableError(f"backend='cute' backward supports bfloat16/float16, got {q.dtype}")
    B, Hq, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    try:
        cfg = default_bwd_config(D).validate()
    except ValueError as e:
        raise BackendUnavailableError(f"backend='cute' backward: {e}") from None
    g = entry.generated
    has_aux_grad = bool(entry.grad_slots) and g is not None and g.has_score_mod  # a mask has no gradient
    fixed_point = bool(deterministic and has_aux_grad)
    if fixed_point and "add_aux_grad" not in g.source:
        raise BackendUnavailableError(
            "deterministic=True with captured tensors that require grad needs generated code that accumulates through "
            "flexlab.kernels.bwd_aux_grad.add_aux_grad (this code generator emits plain fp32 atomics); use "
            "backend='reference' or turn determinism off")
    q, k, v, dout = (tma_ready(t) for t in (q, k, v, dout))
    out = out.contiguous()
    sparse = None
    pad = cfg.tile_m
    if block_mask:
        sparse = _cached_q_direction(block_mask, block_size, cfg, Skv)
        pad = math.lcm(cfg.tile_m, int(block_size[0]))  # listed Q tiles may run past Sq up to a mask block
    sq_pad = -(-Sq // pad) * pad
    dev = q.device
    lse2 = torch.empty((B, Hq, sq_pad), dtype=torch.float32, device=dev)
    dpsum = torch.empty((B, Hq, sq_pad), dtype=torch.float32, device=dev)
    dq_accum = torch.zeros((B, Hq, sq_pad, D), dtype=torch.float32, device=dev)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    dtype = _DTYPES[q.dtype]
    kernel_aux = list(g.kernel_aux_tensors()) if g is not None else []  # row-major, as bwd_sm90 compiled them
    for name, t in zip(g.aux_tensor_names if g is not None else (), kernel_aux):
        if t.device != dev:
            raise BackendUnavailableError(f"captured tensor '{name}' is on {t.device} but the inputs are on {dev}; "
                                          f"move it with .to({str(dev)!r}) before building the mods")
    grad_dtype = torch.int64 if fixed_point else torch.float32
    grads = [torch.zeros(kernel_aux[i].shape, dtype=grad_dtype, device=dev) for i in entry.grad_slots]
    key = BwdKey(g.hash if g is not None else "", bool(g is not None and g.has_score_mod),
                 bool(g is not None and g.has_mask_mod and sparse is not None), has_aux_grad,
                 tuple((str(t.dtype).removeprefix("torch."), t.dim()) for t in kernel_aux),
                 tuple("float" if kind == "float" else "int" for kind in (g.aux_scalar_kinds if g else ())),
                 tuple(t.dim() for t in grads), dtype, cfg, sparse is not None, bool(deterministic), arch,
                 fixed_point)
    pre = _compiled(("pre", dtype, D, dlse is not None, arch), lambda: compile_preprocess(dtype, D, dlse is not None,
                                                                                          arch))
    main = _compiled(key, lambda: compile_main(key, g.module() if g is not None else None))
    post = _compiled(("post", dtype, D, arch), lambda: compile_postprocess(dtype, D, arch))

    sem = rank = None
    if deterministic:
        sem = torch.zeros((B, Hq, sq_pad // cfg.tile_m, cfg.num_consumer_wgs), dtype=torch.int32, device=dev)
        if sparse is not None:
            rank = visit_ranks(sparse, sq_pad // cfg.tile_m)
    stream = cuda.CUstream(torch.cuda.current_stream(dev).cuda_stream)
    pre(_to_cute(out, 16), _to_cute(dout, 16), _to_cute(lse.contiguous()),
        _to_cute(dlse.contiguous()) if dlse is not None else None, _to_cute(dpsum), _to_cute(lse2), stream)
    scalars = tuple(g.kernel_aux_scalars(aux_scalars)) if g is not None else ()
    main(_to_cute(q, 16), _to_cute(k, 16), _to_cute(v, 16), _to_cute(dout, 16), _to_cute(lse2), _to_cute(dpsum),
         _to_cute(dq_accum, 16), _to_cute(dk, 16), _to_cute(dv, 16), scale, Hq // Hkv,
         tuple(_to_cute(t) for t in sparse) if sparse else None, tuple(_to_cute(t, t.element_size()) for t in kernel_aux), scalars,
         tuple(_to_cute(t, 8 if fixed_point else 4) for t in grads), _to_cute(sem) if sem is not None else None,
         _to_cute(rank) if rank is not None else None, stream)
    post(_to_cute(dq_accum, 16), _to_cute(dq, 16), scale, stream)
    if fixed_point:
        from .bwd_aux_grad import from_fixed_point
        grads = [from_fixed_point(b) for b in grads]
    # The kernel sees a 0-d captured tensor as (1,); hand the gradient back in the captured tensor's own shape.
    return dq, dk, dv, [grad.view(aux_tensors[slot].shape) for grad, slot in zip(grads, entry.grad_slots)]
