"""flexlab's own CuTeDSL kernels as a flex_attention backend (Hopper, sm90a).

`is_supported` answers without importing cutlass or touching the GPU beyond asking its compute capability;
`flex_attention_forward` lowers the mods with the code generator (cached per mod), then hands everything to
`flexlab.runtime.launch`.
"""
from __future__ import annotations

import importlib.util

import torch

from ..errors import BackendUnavailableError, UnsupportedModError

_DTYPES = (torch.bfloat16, torch.float16)
_HEAD_DIMS = (64, 128)


def _generated(score_mod, mask_mod):
    """The code generator's result for this (score_mod, mask_mod) pair, cached on the function objects."""
    key = (score_mod, mask_mod)
    hit = _GENERATED.get(key)
    if hit is None:
        from ..codegen import generate  # the code generator: readable CuTeDSL source for the mods
        hit = generate(score_mod, mask_mod)
        _GENERATED[key] = hit
    elif hasattr(hit, "refresh"):
        hit = hit.refresh()  # re-read captured values (scalars may have changed since the first call)
    return hit


_GENERATED: dict = {}


def _is_noop_mask(mask_mod) -> bool:
    from torch.nn.attention.flex_attention import noop_mask
    return mask_mod is None or mask_mod is noop_mask


def _kernel_mods(score_mod, block_mask):
    """(KernelMods, aux_tensors, aux_scalars) for the runtime."""
    from ..runtime.compile import KernelMods
    mask_mod = None if block_mask is None or _is_noop_mask(block_mask.mask_mod) else block_mask.mask_mod
    if score_mod is None and mask_mod is None:
        return KernelMods(), (), ()
    g = _generated(score_mod, mask_mod)
    module = g.module()
    aux_tensors = tuple(g.aux_tensors)
    aux_scalars = tuple(g.aux_scalars)
    specs = tuple((str(t.dtype).removeprefix("torch."), t.dim()) for t in aux_tensors)
    kinds = tuple("int" if isinstance(s, (bool, int)) else "float" for s in aux_scalars)
    mods = KernelMods(module.score_mod if g.has_score_mod else None, module.mask_mod if g.has_mask_mod else None,
                      g.hash, specs, kinds)
    return mods, aux_tensors, aux_scalars


def is_supported(q, k, v, score_mod, block_mask, scale, enable_gqa) -> tuple[bool, str]:
    if q.device.type != "cuda":
        return False, f"needs CUDA tensors, got {q.device}"
    from ..runtime.arch import forward_arch, supported_names
    cap = torch.cuda.get_device_capability(q.device)
    if forward_arch(cap) is None:
        return False, f"no kernel for compute capability {cap[0]}.{cap[1]}; kernels exist for {supported_names()}"
    if q.dtype not in _DTYPES:
        return False, f"dtype {q.dtype} unsupported; use bfloat16 or float16"
    if q.shape[-1] not in _HEAD_DIMS or v.shape[-1] != q.shape[-1]:
        return False, f"head dim {q.shape[-1]} (value {v.shape[-1]}) unsupported; supported: {_HEAD_DIMS}, equal for q/k/v"
    if importlib.util.find_spec("cutlass") is None:
        return False, "nvidia-cutlass-dsl is not installed (pip install nvidia-cutlass-dsl==4.8.1)"
    if block_mask is not None:
        from ..kernels.config import default_config
        from ..runtime.sparsity import incompatibility
        cfg = default_config(q.shape[-1])
        reason = incompatibility(block_mask, cfg.tile_m, cfg.tile_n)
        if reason:
            return False, reason
    mask_mod = None if block_mask is None or _is_noop_mask(block_mask.mask_mod) else block_mask.mask_mod
    if score_mod is not None or mask_mod is not None:
        if importlib.util.find_spec("flexlab.codegen") is None:
            return False, "the code generator (flexlab.codegen) is not available"
        try:
            _generated(score_mod, mask_mod)
        except UnsupportedModError as e:
            return False, str(e)
        except ImportError as e:
            return False, f"the code generator cannot run: {e}"
    return True, ""


def flex_attention_forward(q, k, v, score_mod, block_mask, scale, enable_gqa):
    """(out in q's dtype, lse fp32 natural log (B, Hq, Sq)). Inputs arrive validated by flexlab.api."""
    ok, reason = is_supported(q, k, v, score_mod, block_mask, scale, enable_gqa)
    if not ok:
        raise BackendUnavailableError(f"backend='cute' cannot run this call: {reason}")
    from ..runtime.launch import forward
    mods, aux_tensors, aux_scalars = _kernel_mods(score_mod, block_mask)
    return forward(q, k, v, mods, aux_tensors, aux_scalars, block_mask, scale)


