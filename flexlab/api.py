"""`flexlab.flex_attention`: torch's FlexAttention signature, validated inputs, a choice of backends."""
from __future__ import annotations

import numbers
import warnings

import torch
from torch.nn.attention.flex_attention import BlockMask

from . import _ops
from ._bounded import put_bounded
from .backends import cute  # torch only: cutlass loads when a kernel is first built
from .call_options import call_result, check_call_options, warn_unread_kernel_options
from .errors import BackendUnavailableError, FallbackWarning, FlexlabTypeError, FlexlabValueError
from .mods import check_mask_mod, check_score_mod
from .runtime.launch import kernel_takes_scale

BACKENDS = ("auto", "reference", "torch", "cute")
_FLOAT_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))


def _validate(query, key, value, score_mod, block_mask, scale, enable_gqa, backend, return_lse=False,
              deterministic=None):
    if backend not in BACKENDS:
        raise FlexlabValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    # (flags by type, not truthiness: enable_gqa="no" would otherwise turn grouped-query attention on)
    for name, flag in (("enable_gqa", enable_gqa), ("return_lse", return_lse)):
        if not isinstance(flag, bool):
            raise FlexlabTypeError(f"{name} must be True or False, got {flag!r}")
    if deterministic is not None and not isinstance(deterministic, bool):
        raise FlexlabTypeError(f"deterministic must be True, False or None, got {deterministic!r}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise FlexlabTypeError(f"{name} must be a torch.Tensor of shape (B, H, S, D), got {type(t).__name__}")
        if t.dim() != 4:
            raise FlexlabValueError(f"{name} must be 4-D (B, H, S, D), got shape {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise FlexlabTypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
        if t.numel() == 0:
            raise FlexlabValueError(f"{name} is empty (shape {tuple(t.shape)})")
    if not (query.dtype == key.dtype == value.dtype):
        raise FlexlabTypeError(f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
    if not (query.device == key.device == value.device):
        raise FlexlabValueError(
            f"query, key and value must be on one device, got {query.device}, {key.device}, {value.device}")
    B, Hq, Sq, D = query.shape
    Bk, Hkv, Skv, Dk = key.shape
    Bv, Hv, Sv, _ = value.shape
    if Bk != Bv or Hkv != Hv or Skv != Sv:  # (ints: slicing torch.Size costs more than the whole check)
        raise FlexlabValueError(f"key and value must agree in (B, H, S), got key {tuple(key.shape)} and value "
                                f"{tuple(value.shape)}")
    if Bk != B:
        raise FlexlabValueError(f"query and key must have the same batch size, got {B} and {Bk}")
    if Dk != D:
        raise FlexlabValueError(f"query and key must have the same head dim D, got {D} and {Dk}")
    if Hq != Hkv:
        if not enable_gqa:
            raise FlexlabValueError(
                f"query has {Hq} heads but key/value have {Hkv}; pass enable_gqa=True for grouped-query attention")
        if Hq % Hkv != 0:
            raise FlexlabValueError(
                f"enable_gqa=True needs query heads ({Hq}) to be a multiple of key/value heads ({Hkv})")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        raise FlexlabTypeError(f"scale must be a float or None, got {type(scale).__name__}")
    check_score_mod(score_mod)
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise FlexlabTypeError(
                f"block_mask must be a BlockMask (from flexlab.create_block_mask or torch's), got "
                f"{type(block_mask).__name__}")
        check_mask_mod(block_mask.mask_mod, "block_mask.mask_mod")
        if tuple(block_mask.seq_lengths) != (Sq, Skv):
            raise FlexlabValueError(
                f"block_mask was built for (Q_LEN, KV_LEN) = {tuple(block_mask.seq_lengths)} but the inputs have "
                f"({Sq}, {Skv}); build it with create_block_mask(mask_mod, B, H, {Sq}, {Skv})")
        lists = block_mask.kv_num_blocks.shape
        mb, mh = lists[0], lists[1]
        if mb not in (1, B) or mh not in (1, Hq):
            raise FlexlabValueError(
                f"block_mask has (B, H) = ({mb}, {mh}); it must be 1 or match the query's ({B}, {Hq})")
        if block_mask.kv_num_blocks.device != query.device:
            raise FlexlabValueError(f"block_mask is on {block_mask.kv_num_blocks.device} but query is on "
                                    f"{query.device}; build it with device={str(query.device)!r} or call .to()")


_WARM: dict = {}  # call signature -> backends.cute.WarmForward
_WARM_TRAIN: dict = {}  # call signature -> autograd.WarmTraining
_WARM_ENTRIES = 256


def forget_warm_calls() -> None:
    """Drop the warm entries of repeated calls (inference and training), so the next call of each signature is
    validated and planned again: after a policy knob changed (`runtime.launch.forget_plans`)."""
    _WARM.clear()
    _WARM_TRAIN.clear()


def _signature(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse, backend):
    """Everything `_validate` and the backend choice read from a call, except gradient state and what the mods
    capture (`WarmForward` re-checks those); None for inputs that are not plain tensors. The mods and the block mask
    enter by identity: a warm entry holds them, so their ids cannot be reused while it lives."""
    tensor = torch.Tensor
    if (type(query) is not tensor or type(key) is not tensor or type(value) is not tensor
            or not kernel_takes_scale(scale)):
        return None  # (a scale the kernels cannot take always goes through the backend choice)
    return (query.shape, key.shape, value.shape, query.stride(), key.stride(), value.stride(), query.dtype,
            key.dtype, value.dtype, query.device, key.device, value.device, id(score_mod), id(block_mask),
            type(scale), enable_gqa, return_lse, backend)


def _needs_grad(query, key, value, score_mod) -> bool:
    """Whether the call must be differentiable: Q, K or V requires grad, or a tensor the score_mod captures does
    (a learnable bias table trained with Q, K and V frozen)."""
    if not torch.is_grad_enabled():
        return False
    if query.requires_grad or key.requires_grad or value.requires_grad:
        return True
    return score_mod is not None and cute.captured_requires_grad(score_mod, None)


def _cute_plan(query, key, value, score_mod, block_mask) -> tuple[str, bool]:
    """(why flexlab's kernels cannot run this call or "", whether the call needs their backward).

    Gradients are wanted for Q, K, V or for a tensor the mods capture (a learnable bias). Everything is decided by
    `_cute_plan_static` from plain values, which torch.compile runs once at trace time and keeps as a constant."""
    qkv_grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    if block_mask is None:
        mask_mod = block_size = None
        has_q_lists = True
    else:
        mask_mod, block_size = block_mask.mask_mod, tuple(block_mask.BLOCK_SIZE)
        has_q_lists = block_mask.q_num_blocks is not None
    plan = _cute_plan_static(query.device, query.dtype, query.shape[-1], value.shape[-1], score_mod, mask_mod,
                             block_size, has_q_lists, qkv_grad, torch.is_grad_enabled())
    return plan[:-1], plan[-1] == "1"


@_ops.constant_under_compile
def _cute_plan_static(device, dtype, head_dim, v_head_dim, score_mod, mask_mod, block_size, has_q_lists,
                      qkv_grad: bool, grad_enabled: bool) -> str:
    """The reason string with "1" (backward needed) or "0" appended: one string, so Dynamo folds it as a constant."""
    reason, captured_grad = cute.support_and_captured_grad(device, dtype, head_dim, v_head_dim, score_mod, mask_mod,
                                                           block_size)
    needs_grad = not reason and (qkv_grad or (grad_enabled and captured_grad))
    if needs_grad:
        from .autograd import backward_reason
        reason = backward_reason(dtype, head_dim, block_size, has_q_lists) or ""
    return reason + ("1" if needs_grad else "0")


def _choose_backend(backend, query, key, value, score_mod, block_mask, deterministic,
                    scale=None, want_max: bool = False) -> tuple[str, bool]:
    """(backend to run, whether the cute backend must run its differentiable path)."""
    if backend == "auto" and query.device.type != "cuda":
        # torch's CPU flex_attention has no backward and no max_scores; the dense reference has both
        return ("reference" if want_max or _needs_grad(query, key, value, score_mod) else "torch"), False
    if backend not in ("auto", "cute"):
        return backend, False
    if want_max:
        reason, needs_grad = "return_aux asks for max_scores, which flexlab's kernels do not write", False
    elif not kernel_takes_scale(scale):
        # the kernels' online softmax keeps each row's largest raw score, which a negative scale makes the smallest
        # scaled one (exponentials could overflow); at scale 0 a row's first rescale factor is exp2(-inf * 0) = NaN
        reason, needs_grad = f"scale={scale} is not a finite positive number; flexlab's kernels need scale > 0", False
    else:
        reason, needs_grad = _cute_plan(query, key, value, score_mod, block_mask)
    if not reason:
        return "cute", needs_grad
    if backend == "cute":
        raise BackendUnavailableError(f"backend='cute' cannot run this call: {reason}")
    if deterministic and _needs_grad(query, key, value, score_mod):
        raise BackendUnavailableError(
            f"deterministic=True needs flexlab's backward kernel, which cannot run this call: {reason}")
    if not torch.compiler.is_compiling():  # (a slower path taken on a GPU is said, never silent)
        warnings.warn(f"backend='auto' runs torch's flex_attention for this call, not flexlab's kernels: {reason}",
                      FallbackWarning, stacklevel=5)  # (flex_attention's caller, past _attention and _run)
    return "torch", False


def flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod=None,
                   block_mask: BlockMask | None = None, scale: float | None = None, enable_gqa: bool = False,
                   return_lse: bool = False, kernel_options: dict | None = None, *, return_aux=None,
                   backend: str = "auto", deterministic: bool | None = None):
    r"""FlexAttention with torch's semantics and a choice of backends.

    Shapes: ``query (B, Hq, Sq, D)``, ``key (B, Hkv, Skv, D)``, ``value (B, Hkv, Skv, Dv)``; output
    ``(B, Hq, Sq, Dv)``; LSE ``(B, Hq, Sq)`` in natural log.

    Mods follow torch's conventions::

        def score_mod(score, b, h, q_idx, kv_idx):   # score is already scaled
            return score + bias[h, q_idx - kv_idx]
        def mask_mod(b, h, q_idx, kv_idx):           # True keeps the pair; used via create_block_mask
            return q_idx >= kv_idx

    Args:
        score_mod: modifies each scaled score; captured tensors may require grad.
        block_mask: a ``BlockMask`` from ``flexlab.create_block_mask`` or torch's; its mask_mod masks pairs.
        scale: score scale, default ``1/sqrt(D)``.
        enable_gqa: allow ``Hq`` to be a multiple of ``Hkv`` (grouped-query attention).
        return_lse: also return the log-sum-exp of each row (torch's older spelling of
            ``return_aux=AuxRequest(lse=True)``).
        kernel_options: knobs of torch's kernels, passed to them when the torch backend runs the call; flexlab's
            kernels and the reference do not read them (a warning says so).
        return_aux: an ``AuxRequest``: return ``(out, AuxOutput(lse, max_scores))``; ``max_scores`` is each row's
            largest score after score_mod and masking (no gradient). flexlab's kernels write the LSE but not
            ``max_scores``, which ``auto`` gets from torch's kernels (with a ``FallbackWarning``).
        backend: ``"reference"`` (dense fp32/fp64 math, any device), ``"torch"`` (torch's compiled
            flex_attention on CUDA, its own path on CPU), ``"cute"`` (flexlab's CuTeDSL kernels, Hopper), or
            ``"auto"`` (cute where it supports the call, forward and backward, else torch, with a
            ``FallbackWarning`` saying why on a GPU; on CPU with gradients, reference).
        deterministic: bitwise-reproducible gradients from the cute backward (ordered dQ accumulation,
            fixed-point captured-tensor grads); None follows ``torch.are_deterministic_algorithms_enabled()``.

    Fully masked rows give output 0 and LSE -inf.
    """
    if return_aux is None and kernel_options is None:
        return _attention(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse, backend,
                          deterministic)
    options = check_call_options(return_lse, return_aux, kernel_options)
    return call_result(_attention(query, key, value, score_mod, block_mask, scale, enable_gqa, options.want_lse,
                                  backend, deterministic, options.want_max, options.kernel_options), options)


def _attention(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse, backend, deterministic,
               want_max: bool = False, kernel_options: dict | None = None):
    """out, (out, lse) with `return_lse`, or (out, lse, max_scores) with `want_max`: from a warm entry where the
    call repeats one (return_aux=AuxRequest(lse=...) alone is return_lse by another name), else from `_run`."""
    sig = None
    if not (want_max or kernel_options or torch.compiler.is_compiling()):
        # warm path: a signature validated before and run forward-only by flexlab's kernel
        sig = _signature(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse, backend)
        if sig is not None:
            warm = _WARM.get(sig)
            if warm is not None:
                result = warm(query, key, value, scale)
                if result is not None:
                    return result if return_lse else result[0]
            # ... or validated before and run with gradients through flexlab's kernels
            train = _WARM_TRAIN.get(sig)
            if train is not None:
                result = train(query, key, value, scale, deterministic)
                if result is not None:
                    return result if return_lse else result[0]
    out, lse, max_scores = _run(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse, backend,
                                deterministic, sig, want_max=want_max, kernel_options=kernel_options)
    if want_max:
        return out, lse, max_scores
    return (out, lse) if return_lse else out


def _run(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse, backend, deterministic, sig, *,
         want_max: bool = False, kernel_options: dict | None = None):
    """A call past the warm entries: validate, choose the backend, run it; (out, lse, max_scores or None). `sig`
    (None under torch.compile, with max_scores or kernel_options) keys the warm entry a cute call leaves behind."""
    _validate(query, key, value, score_mod, block_mask, scale, enable_gqa, backend, return_lse, deterministic)
    if scale is not None:
        scale = float(scale)  # (a Fraction or numpy scalar passes as a real number; the backends take floats)
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    chosen, cute_grad = _choose_backend(backend, query, key, value, score_mod, block_mask, deterministic, scale,
                                        want_max)
    max_scores = None
    if chosen != "torch":
        warn_unread_kernel_options(kernel_options, chosen)
    if chosen == "reference":
        from .backends.reference import reference_attention
        compute = torch.float64 if query.dtype == torch.float64 else torch.float32
        out, lse, *row_max = reference_attention(query, key, value, score_mod, block_mask, scale, enable_gqa,
                                                 compute, with_max=want_max)
        stats = torch.float64 if query.dtype == torch.float64 else torch.float32
        out, lse = out.to(query.dtype), lse.to(stats)
        max_scores = row_max[0].to(stats) if want_max else None
    elif chosen == "torch":
        if query.device.type != "cuda" and _needs_grad(query, key, value, score_mod):
            raise BackendUnavailableError(
                "backend='torch' on CPU has no backward (torch's CPU flex_attention is forward-only); use "
                "backend='reference' or 'auto' for gradients on CPU")
        if query.device.type != "cuda" and want_max:
            raise BackendUnavailableError(
                "backend='torch' on CPU cannot return max_scores (torch's CPU flex_attention refuses it); use "
                "backend='reference' or 'auto'")
        from .backends.torch_flex import torch_flex_attention
        out, lse, max_scores = torch_flex_attention(query, key, value, score_mod, block_mask, scale, enable_gqa,
                                                    kernel_options=kernel_options, max_scores=want_max)
    else:
        if cute_grad or torch.compiler.is_compiling():
            # through the custom ops: autograd for the backward kernels, and one opaque node for torch.compile
            from .autograd import bind_training, differentiable_attention
            out, lse = differentiable_attention(query, key, value, score_mod, block_mask, scale, enable_gqa,
                                                return_lse=True, deterministic=deterministic)
            if sig is not None and cute_grad:  # (never under torch.compile: sig is None there)
                train = bind_training(query, key, value, score_mod, block_mask)
                if train is not None:
                    put_bounded(_WARM_TRAIN, sig, train, _WARM_ENTRIES)
        else:
            # a kernel that writes no LSE when the caller does not want it (one allocation less per call)
            warm = (cute.bind_forward(query, key, value, score_mod, block_mask, with_lse=return_lse)
                    if sig is not None else None)
            result = warm(query, key, value, scale) if warm is not None else None
            if result is not None:
                out, lse = result
                put_bounded(_WARM, sig, warm, _WARM_ENTRIES)
            else:  # `_choose_backend` has just lowered the mods (reading their captures) in this call
                out, lse = cute.flex_attention_forward(query, key, value, score_mod, block_mask, scale, enable_gqa,
                                                       captures_checked=True, with_lse=return_lse)
    return out, lse, max_scores
