"""torch tensors in, kernel launched, (out, lse) back, with as little Python per call as possible.

The steady-state path is: check strides, allocate O and LSE, look the compiled kernel up in a dict, call it through
TVM-FFI (which reads torch's current stream and takes torch tensors directly). Anything slower (compiling, splitting a
BlockMask) is cached.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from ..kernels.config import FwdConfig, default_config
from .compile import CompileKey, KernelMods, cutlass_version, kernel_cache, tvm_ffi_available
from .sparsity import kernel_block_mask

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """TMA needs a unit stride on D, 16-byte aligned other strides and base address; copy only when that fails."""
    ok = (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
          and all(s % 8 == 0 and s > 0 for s in t.stride()[:-1]))
    return t if ok else t.contiguous()


@lru_cache(maxsize=None)
def _static_key_parts() -> tuple[str, bool]:
    return cutlass_version(), tvm_ffi_available()


_KEYS: dict[tuple, CompileKey] = {}


def _key(mods: KernelMods, dtype: str, cfg: FwdConfig, arch: str, sparse: bool) -> CompileKey:
    fast = (mods.source_hash, mods.score_mod is not None, mods.mask_mod is not None, mods.aux_tensor_specs,
            mods.aux_scalar_kinds, dtype, cfg, arch, sparse)
    key = _KEYS.get(fast)
    if key is None:
        version, ffi = _static_key_parts()
        key = CompileKey(mods.source_hash, mods.score_mod is not None, mods.mask_mod is not None,
                         mods.aux_tensor_specs, mods.aux_scalar_kinds, dtype, cfg, arch, sparse, sparse,
                         cutlass_version=version, tvm_ffi=ffi)
        _KEYS[fast] = key
    return key


def _to_cute(t):
    from cutlass.cute.runtime import from_dlpack
    return from_dlpack(t, assumed_align=16 if t.dim() == 4 else 4).mark_layout_dynamic(leading_dim=t.dim() - 1)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mods: KernelMods = KernelMods(),
            aux_tensors: tuple = (), aux_scalars: tuple = (), block_mask=None, scale: float | None = None,
            config: FwdConfig | None = None, arch: str = "sm_90a") -> tuple[torch.Tensor, torch.Tensor]:
    """Run the Hopper forward kernel. q (B, Hq, Sq, D), k/v (B, Hkv, Skv, D) on one CUDA device, bf16/fp16."""
    B, Hq, Sq, D = q.shape
    cfg = config or default_config(D)
    q, k, v = tma_ready(q), tma_ready(k), tma_ready(v)
    out = torch.empty((B, Hq, Sq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, Sq), dtype=torch.float32, device=q.device)
    sparse = order = None
    if block_mask is not None:
        kbm = kernel_block_mask(block_mask, Sq, cfg.tile_m, cfg.tile_n)
        sparse, order = kbm.as_args(), kbm.order
    key = _key(mods, _DTYPE_NAMES[q.dtype], cfg, arch, sparse is not None)
    fn = kernel_cache().get(key, mods)
    scale = D ** -0.5 if scale is None else float(scale)
    qhead_per_kvhead = Hq // k.shape[1]
    if key.tvm_ffi:
        fn(q, k, v, out, lse, scale, qhead_per_kvhead, sparse, order, tuple(aux_tensors), tuple(aux_scalars))
    else:
        import cuda.bindings.driver as cuda
        stream = cuda.CUstream(torch.cuda.current_stream(q.device).cuda_stream)
        conv_sparse = tuple(_to_cute(t) for t in sparse) if sparse is not None else None
        fn(_to_cute(q), _to_cute(k), _to_cute(v), _to_cute(out), _to_cute(lse), scale, qhead_per_kvhead,
           conv_sparse, _to_cute(order) if order is not None else None,
           tuple(_to_cute(t) for t in aux_tensors), tuple(aux_scalars), stream)
    return out, lse
