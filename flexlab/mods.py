"""Evaluate user score_mod / mask_mod functions on index grids, the way torch's FlexAttention does.

A mod is written for scalars (0-d tensors). To evaluate it on a (B, H, Q, KV) grid we vmap it over each index
dimension, exactly like torch's own dense path, so anything torch accepts we accept: captured tensors indexed with
index tensors, `torch.where`, Python control flow on non-tensor values. Every host-side consumer (reference backend,
block-mask builder, visualizer) goes through here, so there is one definition of "what the user's mod means".
"""
from __future__ import annotations

import functools
import inspect
import weakref
from typing import Callable

import torch

from .errors import FlexlabTypeError, FlexlabValueError

ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

_SCORE_ARGS = "(score, b, h, q_idx, kv_idx)"
_MASK_ARGS = "(b, h, q_idx, kv_idx)"


_ARITY: "weakref.WeakKeyDictionary[Callable, int | None]" = weakref.WeakKeyDictionary()


def positional_arity(fn: Callable) -> int | None:
    """Number of required positional parameters, None when it can't be told (C functions, *args), -1 with a
    required keyword-only parameter.

    Cached per function object: `inspect.signature` costs tens of microseconds, and this runs on every call."""
    try:
        return _ARITY[fn]
    except (KeyError, TypeError):
        pass
    n = _signature_arity(fn)
    try:
        _ARITY[fn] = n
    except TypeError:  # not weak-referenceable
        pass
    return n


def _signature_arity(fn: Callable) -> int | None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    count = 0
    for p in sig.parameters.values():
        if p.kind == p.VAR_POSITIONAL:
            return None
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty:
            count += 1
        if p.kind == p.KEYWORD_ONLY and p.default is p.empty:
            return -1  # never callable with positional arguments alone
    return count


def mod_name(fn: Callable) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _check_mod(fn, arg: str, n_args: int, signature: str, returns: str, other_hint: str) -> None:
    if fn is None:
        return
    if not callable(fn):
        raise FlexlabTypeError(f"{arg} must be a callable {signature} -> {returns}, got {type(fn).__name__}")
    n = positional_arity(fn)
    if n == -1:
        raise FlexlabTypeError(f"{arg} {mod_name(fn)!r} has a keyword-only argument without a default; a "
                               f"{arg.split('.')[-1]} is called with {n_args} positional arguments: {signature}")
    if n is not None and n != n_args:
        hint = other_hint if n == 9 - n_args else ""  # 4 <-> 5: the other kind of mod
        raise FlexlabTypeError(f"{arg} {mod_name(fn)!r} takes {n} positional argument(s); a "
                               f"{arg.split('.')[-1]} takes {n_args}: {signature}{hint}")


def check_score_mod(score_mod, arg: str = "score_mod") -> None:
    """Raise a TypeError naming the function if it cannot be a score_mod."""
    _check_mod(score_mod, arg, 5, _SCORE_ARGS, "Tensor",
               " (that looks like a mask_mod: pass it through create_block_mask(...) as block_mask=)")


def check_mask_mod(mask_mod, arg: str = "mask_mod") -> None:
    """Raise a TypeError naming the function if it cannot be a mask_mod."""
    _check_mod(mask_mod, arg, 4, _MASK_ARGS, "bool Tensor", " (that looks like a score_mod: pass it as score_mod=)")


def _as_tensor_result(fn: Callable, role: str) -> Callable:
    """`fn` whose result is a tensor: a Python number becomes a 0-d tensor (as the code generator takes it, e.g. a
    mask_mod that returns True); anything else is refused naming the mod."""
    def result(*args):
        out = fn(*args)
        if isinstance(out, torch.Tensor):
            return out
        if isinstance(out, (bool, int, float)):
            return torch.tensor(out)
        raise FlexlabTypeError(f"{role} {mod_name(fn)!r} returned {type(out).__name__}; it must return a 0-d tensor "
                               f"or a Python number")
    return result


def _evaluated(role: str, fn: Callable, vmapped: Callable, args: tuple, n_batch_dims: int) -> torch.Tensor:
    """`fn` (its result made a tensor: `_as_tensor_result`) vmapped by `vmapped` and called on `args`, the result
    checked to hold one value per index point; an error raised inside the mod gets a note naming it (Python 3.11+),
    its type kept."""
    try:
        out = vmapped(_as_tensor_result(fn, role))(*args)
    except Exception as err:
        if hasattr(err, "add_note") and not isinstance(err, FlexlabTypeError):
            err.add_note(f"(raised while evaluating {role} {mod_name(fn)!r} on index tensors, as torch's "
                         f"FlexAttention does)")
        raise
    if out.dim() != n_batch_dims:
        raise FlexlabValueError(f"{role} {mod_name(fn)!r} must return one value (a 0-d tensor) per index point; it "
                                f"returned shape {tuple(out.shape[n_batch_dims:])} per point")
    return out


def _vmap_bhqkv(fn: Callable, leading: tuple) -> Callable:
    """vmap `fn` over its (b, h, q_idx, kv_idx) arguments, innermost (kv) first; `leading` maps extra args."""
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)):
        fn = torch.vmap(fn, in_dims=leading + dims, out_dims=0)
    return fn


def _index_mode():
    # Lets mods index captured tensors with 0-d index tensors (table[q_idx]) under vmap, as torch does.
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    return TransformGetItemToIndex()


def evaluate_mask_mod(mask_mod: MaskMod, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor,
                      kv: torch.Tensor) -> torch.Tensor:
    """Evaluate `mask_mod` on the grid b × h × q × kv (1-D int index tensors) → bool (len b, len h, len q, len kv)."""
    with _index_mode():
        out = _evaluated("mask_mod", mask_mod, lambda f: _vmap_bhqkv(f, ()), (b, h, q, kv), 4)
    if out.dtype != torch.bool:
        raise FlexlabTypeError(f"mask_mod {mod_name(mask_mod)!r} must return a bool tensor, got {out.dtype}")
    return out.expand(len(b), len(h), len(q), len(kv))


def evaluate_mask_mod_pointwise(mask_mod: MaskMod, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor,
                                kv: torch.Tensor) -> torch.Tensor:
    """Evaluate `mask_mod` at the points (b[i], h[i], q[i], kv[i]) of four equally long 1-D int tensors -> bool (n,)
    (where a grid would be wasteful: the scores of scattered blocks)."""
    with _index_mode():
        out = _evaluated("mask_mod", mask_mod, lambda f: torch.vmap(f, in_dims=(0, 0, 0, 0), out_dims=0),
                         (b, h, q, kv), 1)
    if out.dtype != torch.bool:
        raise FlexlabTypeError(f"mask_mod {mod_name(mask_mod)!r} must return a bool tensor, got {out.dtype}")
    return out.expand(b.shape[0])


def evaluate_score_mod(score_mod: ScoreMod, scores: torch.Tensor, b: torch.Tensor, h: torch.Tensor,
                       q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Apply `score_mod` to `scores` of shape (len b, len h, len q, len kv); differentiable."""
    with _index_mode():
        out = _evaluated("score_mod", score_mod, lambda f: _vmap_bhqkv(f, (0,)), (scores, b, h, q, kv), 4)
    if not out.is_floating_point():  # (a Python int, as the code generator casts it)
        out = out.to(scores.dtype)
    return out.expand_as(scores) if out.shape != scores.shape else out


@functools.lru_cache(maxsize=None)
def _arange(n: int, device: str) -> torch.Tensor:
    return torch.arange(n, device=device)


def index_grid(B: int, H: int, Q_LEN: int, KV_LEN: int, device) -> tuple[torch.Tensor, ...]:
    dev = str(torch.device(device))
    return _arange(B, dev), _arange(H, dev), _arange(Q_LEN, dev), _arange(KV_LEN, dev)


def probe_mods_at_origin(score_mod: ScoreMod | None, mask_mod: MaskMod | None, device) -> None:
    """Evaluate the mods at the single index point (0, 0, 0, 0) through flexlab's checks, so a mod whose result is
    wrong (a vector per point, a float mask) is named in flexlab's words where another library's error would not.
    Raises the FlexlabError (or the mod's own error) if the mods fail there; returns None if they pass."""
    zero = index_grid(1, 1, 1, 1, device)
    if mask_mod is not None:
        evaluate_mask_mod(mask_mod, *zero)
    if score_mod is not None:
        evaluate_score_mod(score_mod, torch.zeros(1, 1, 1, 1, device=device), *zero)
