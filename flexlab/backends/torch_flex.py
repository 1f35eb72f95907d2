"""torch's own FlexAttention as a backend: compiled Triton kernels on CUDA, torch's eager path on CPU.

torch.compile keeps one cache of compiled variants per code object; every new mod closure or shape is a recompile,
and past `recompile_limit` (8 by default) dynamo silently runs flex_attention eagerly, materializing S×S scores
(~50× slower on an H200). We never let that happen silently: we raise the limit for flex_attention calls made
through flexlab, and make dynamo fail instead of falling back, turning that into a RecompileLimitError that says
what to do.
"""
from __future__ import annotations

import copy
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


# Smaller Triton tiles (forward and backward) for mods whose captured tensors push torch's default configs past the
# 227 KiB of shared memory a Hopper SM has ("No valid triton configs ... out of resource").
SMALL_TILE_OPTIONS = {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 1,
                      "BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32}


def _is_out_of_resources(err: Exception) -> bool:
    text = str(err)
    return "No valid triton configs" in text or "out of resource" in text


def _defaults_as_closure(mod, n_args: int):
    """The same mod with its default-argument values moved into closure cells.

    dynamo guards a mod's closure cells but not its `__defaults__`, so `lambda score, ..., w=w: ...` redefined with a
    new `w` silently reuses the graph compiled for the old one. Calling the original with every argument explicit,
    from a closure that holds the values, makes a new value a guarded change (a recompile, not a stale result).
    """
    defaults = getattr(mod, "__defaults__", None)
    if not defaults or getattr(mod, "__kwdefaults__", None):
        return mod
    values = tuple(defaults)
    if n_args == 5:
        def with_captured_defaults(score, b, h, q_idx, kv_idx):
            return mod(score, b, h, q_idx, kv_idx, *values)
    else:
        def with_captured_defaults(b, h, q_idx, kv_idx):
            return mod(b, h, q_idx, kv_idx, *values)
    with_captured_defaults.__name__ = getattr(mod, "__name__", "mod")
    return with_captured_defaults if mod.__code__.co_argcount == n_args + len(values) else mod


def _guardable(score_mod, block_mask):
    if score_mod is not None and hasattr(score_mod, "__code__"):
        score_mod = _defaults_as_closure(score_mod, 5)
    if block_mask is not None and hasattr(block_mask.mask_mod, "__code__"):
        fixed = _defaults_as_closure(block_mask.mask_mod, 4)
        if fixed is not block_mask.mask_mod:
            block_mask = copy.copy(block_mask)
            block_mask.mask_mod = fixed
    return score_mod, block_mask


def _unpack(result):
    """(out, lse, max_scores or None) from torch's (out, AuxOutput)."""
    out, aux = result
    return out, aux.lse, aux.max_scores


def _cpu_flex_attention(query, key, value, **kwargs):
    """torch's CPU path: its unfused math, run directly. (Without the flag torch first traces every new mod with
    dynamo, about a second per closure, only to run the same math; we never take torch's CPU backward.)"""
    previous = getattr(torch_flex, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", False)
    torch_flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return torch_flex.flex_attention(query, key, value, **kwargs)
    finally:
        torch_flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = previous


def torch_flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                         kernel_options=None, max_scores=False):
    """Returns (out, lse, max_scores) from torch's flex_attention (natural-log LSE, fp32; max_scores None unless
    asked for). `kernel_options`: the caller's knobs for torch's kernels."""
    kwargs = dict(score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                  return_aux=torch_flex.AuxRequest(lse=True, max_scores=max_scores))
    if kernel_options:
        kwargs["kernel_options"] = kernel_options
    if query.device.type != "cuda":
        if not torch.is_grad_enabled():  # (torch's CPU path refuses inputs that require grad even under no_grad)
            query, key, value = query.detach(), key.detach(), value.detach()
        try:
            return _unpack(_cpu_flex_attention(query, key, value, **kwargs))
        except Exception as err:
            _raise_if_mods_are_at_fault(err, score_mod, block_mask, query.device)
            raise
    kwargs["score_mod"], kwargs["block_mask"] = _guardable(score_mod, block_mask)
    try:
        with _dynamo_config_patch():
            try:
                return _unpack(_compiled_flex()(query, key, value, **kwargs))
            except Exception as err:
                if not _is_out_of_resources(err):
                    raise
                if "kernel_options" in kwargs:  # (the caller's own tiles: theirs to change)
                    raise
                warnings.warn("backend='torch': torch's default Triton tiles for this mod need more shared memory "
                              f"than the GPU has; retrying with kernel_options={SMALL_TILE_OPTIONS}", stacklevel=5)
                return _unpack(_compiled_flex()(query, key, value, kernel_options=SMALL_TILE_OPTIONS, **kwargs))
    except Exception as err:  # dynamo wraps the limit error in several types across versions
        if _is_recompile_limit_error(err):
            raise RecompileLimitError(
                f"backend='torch': torch.compile reached its recompile limit ({RECOMPILE_LIMIT}) for "
                "flex_attention after many different mods/shapes; rather than fall back to the slow eager path, "
                "flexlab stops here. Call flexlab.reset_torch_backend() (this runs torch._dynamo.reset()) or use "
                "backend='cute'.") from err
        _raise_if_mods_are_at_fault(err, score_mod, block_mask, query.device)
        raise


def _raise_if_mods_are_at_fault(err: Exception, score_mod, block_mask, device) -> None:
    """torch reports a mod with a wrong result (a vector per index point, say) as a shape error deep in its own
    code; if the mods fail flexlab's one-point check, that error, naming the mod, is raised instead."""
    from ..errors import FlexlabError
    from ..mods import probe_mods_at_origin
    try:
        probe_mods_at_origin(score_mod, block_mask.mask_mod if block_mask is not None else None, device)
    except FlexlabError as ours:
        raise ours from err
    except Exception:  # (the mod itself raises at the origin: torch's own error already says so)
        return


def reset_torch_backend() -> None:
    """Forget torch.compile's flex_attention variants (and every other dynamo cache in the process)."""
    torch._dynamo.reset()
    _compiled_flex.cache_clear()
