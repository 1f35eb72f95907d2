"""torch's own FlexAttention as a backend: compiled Triton kernels on CUDA, torch's eager path on CPU.

torch.compile keeps one cache of compiled variants per code object; every new mod closure or shape is a recompile,
and past `recompile_limit` (8 by default) dynamo silently runs flex_attention eagerly, materializing S×S scores
(~50× slower on an H200). We never let that happen silently: we raise the limit for flex_attention calls made
through flexlab, and make dynamo fail instead of falling back, turning that into a RecompileLimitError that says
what to do.
"""
from __future__ import annotations

import functools
import warnings

import torch
from torch.nn.attention import flex_attention as torch_flex

from ..errors import RecompileLimitError

# Variants a notebook session may reasonably try before we ask the user to reset.
RECOMPILE_LIMIT = 64


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    return torch.compile(torch_flex.flex_attention, dynamic=False)


def _dynamo_config_patch():
    cfg = torch._dynamo.config
    patch = {"recompile_limit": max(RECOMPILE_LIMIT, cfg.recompile_limit)}
    # Raise instead of silently running eagerly once the limit is hit.
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        patch["fail_on_recompile_limit_hit"] = True
    return cfg.patch(patch)


def _is_recompile_limit_error(err: Exception) -> bool:
    text = f"{type(err).__name__}: {err}".lower()
    return "recompile" in text and "limit" in text or "cache_size_limit" in text or "cache size limit" in text


def _unpack(result):
    out, aux = result
    return out, (aux.lse if hasattr(aux, "lse") else aux)


def torch_flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False):
    """Returns (out, lse) from torch's flex_attention (natural-log LSE, fp32)."""
    kwargs = dict(score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)
    if hasattr(torch_flex, "AuxRequest"):
        kwargs["return_aux"] = torch_flex.AuxRequest(lse=True)
    else:
        kwargs["return_lse"] = True
    if query.device.type != "cuda":
        # torch's CPU path is its unfused math; warning about it on every call would only be noise here.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return _unpack(torch_flex.flex_attention(query, key, value, **kwargs))
    try:
        with _dynamo_config_patch():
            return _unpack(_compiled_flex()(query, key, value, **kwargs))
    except Exception as err:  # dynamo wraps the limit error in several types across versions
        if _is_recompile_limit_error(err):
            raise RecompileLimitError(
                f"backend='torch': torch.compile reached its recompile limit ({RECOMPILE_LIMIT}) for "
                "flex_attention after many different mods/shapes; rather than fall back to the slow eager path, "
                "flexlab stops here. Call flexlab.reset_torch_backend() (this runs torch._dynamo.reset()) or use "
                "backend='cute'.") from err
        raise


def reset_torch_backend() -> None:
    """Forget torch.compile's flex_attention variants (and every other dynamo cache in the process)."""
    torch._dynamo.reset()
    _compiled_flex.cache_clear()
