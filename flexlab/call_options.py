"""torch's newer flex_attention arguments, `return_aux` and `kernel_options`, as flexlab reads them.

torch deprecates `return_lse=True` in favour of `return_aux=AuxRequest(lse=True)` and takes tuning knobs for its
own kernels through `kernel_options`; code written for torch passes both, so flexlab takes them too:

- `return_aux`: an `AuxRequest`; the call returns `(out, AuxOutput(lse, max_scores))`, the fields not asked for
  None. `max_scores` is each query row's largest score after score_mod and masking (-inf on a fully masked row),
  as torch defines it; it carries no gradient.
- `kernel_options`: the knobs of torch's kernels (tile sizes, warps, stages, `BACKEND`). They reach torch when the
  torch backend runs the call. flexlab's kernels choose their tiles per head dim and the reference has none, so when
  either runs the call a warning says the knobs went unread.
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch.nn.attention.flex_attention import AuxOutput, AuxRequest

from .errors import FlexlabTypeError, FlexlabValueError

# Outputs torch chooses itself from return_lse / return_aux; it refuses them as knobs, and so does flexlab.
_TORCH_SET_OPTIONS = ("OUTPUT_LOGSUMEXP", "OUTPUT_MAX")


class CallOptions(NamedTuple):
    """A call's checked options: which outputs it returns, and the knobs for torch's kernels (None: none)."""
    want_lse: bool
    want_max: bool
    aux: bool  # return (out, AuxOutput) rather than out or (out, lse)
    kernel_options: dict | None


def check_call_options(return_lse, return_aux, kernel_options) -> CallOptions:
    """Validate `return_lse`, `return_aux` and `kernel_options` together."""
    if not isinstance(return_lse, bool):
        raise FlexlabTypeError(f"return_lse must be True or False, got {return_lse!r}")
    if return_aux is not None:
        if not isinstance(return_aux, AuxRequest):
            raise FlexlabTypeError(
                f"return_aux must be a torch.nn.attention.flex_attention.AuxRequest (or flexlab.AuxRequest), got "
                f"{type(return_aux).__name__}")
        for field in AuxRequest._fields:
            if not isinstance(getattr(return_aux, field), bool):
                raise FlexlabTypeError(f"return_aux.{field} must be True or False, got {getattr(return_aux, field)!r}")
        if return_lse:
            raise FlexlabValueError("pass either return_lse=True or return_aux=AuxRequest(lse=True), not both "
                                    "(return_lse is torch's older spelling of the same request)")
    if kernel_options is not None:
        if not isinstance(kernel_options, Mapping):
            raise FlexlabTypeError(f"kernel_options must be a dict of torch's kernel knobs (e.g. {{'BLOCK_M': 64}}) "
                                   f"or None, got {type(kernel_options).__name__}")
        for name in kernel_options:
            if not isinstance(name, str):
                raise FlexlabTypeError(f"kernel_options keys must be strings, got {name!r}")
            if name in _TORCH_SET_OPTIONS:
                raise FlexlabValueError(f"kernel_options[{name!r}] is set from return_lse / return_aux; use "
                                        "return_aux=AuxRequest(lse=..., max_scores=...) instead")
        kernel_options = dict(kernel_options)
    want_lse = return_lse or (return_aux is not None and return_aux.lse)
    want_max = return_aux is not None and return_aux.max_scores
    return CallOptions(want_lse, want_max, return_aux is not None, kernel_options)


def warn_unread_kernel_options(kernel_options: dict | None, backend: str) -> None:
    """Say that torch's knobs were not used: the call ran flexlab's kernels or the reference, not torch's."""
    if kernel_options and not torch.compiler.is_compiling():  # (said in eager calls; a compiled graph is silent)
        warnings.warn(f"kernel_options {sorted(kernel_options)} tune torch's flex_attention kernels; this call ran "
                      f"flexlab's {backend!r} backend, which does not read them (backend='torch' does)",
                      UserWarning, stacklevel=5)  # (flex_attention's caller)


def call_result(result, options: CallOptions):
    """What flex_attention returns for these options, from what it ran: out, (out, lse) with `want_lse`, or
    (out, lse, max_scores) with `want_max`; returned as out, (out, lse) or (out, AuxOutput(lse, max_scores))."""
    if options.want_max:
        out, lse, max_scores = result
    else:
        (out, lse), max_scores = (result if options.want_lse else (result, None)), None
    if options.aux:
        return out, AuxOutput(lse=lse if options.want_lse else None, max_scores=max_scores)
    return (out, lse) if options.want_lse else out
