"""Gradients of flexlab attention: the autograd formula of the forward custom op, and the differentiable entry.

`flex_attention_fwd` saves Q, K, V, O and the LSE; its backward calls `flex_attention_bwd`, which recomputes the
probabilities from the LSE (nothing S x S is kept between the passes) and also returns the gradients of captured
tensors that require grad (learnable biases, ALiBi slopes, ...). A gradient flowing into the returned LSE is folded
into the preprocess term D, so `return_lse=True` outputs are differentiable too.

`differentiable_attention` is what `flexlab.flex_attention` calls for backend="cute" when gradients are needed. In
eager mode it runs `EagerAttention`, a `torch.autograd.Function` over the same op bodies: the custom-op machinery
(schema checks, pytree flattening, alias checks) costs several hundred microseconds of host time per training step,
more than a small step's kernels take. Under torch.compile it calls the custom ops, and it is written so that
`torch.compile(fullgraph=True)` traces it without graph breaks: the mods are resolved to a registry
key by a function Dynamo runs once at trace time (`assume_constant_result`), and the captured tensors are read from
the registry, where Dynamo lifts them to graph inputs. Under torch.compile, captured Python numbers (window sizes,
softcaps) are therefore read when the graph is traced.
"""
from __future__ import annotations

import torch

from . import _ops
from .backends.cute import effective_mask_mod


def _setup_context(ctx, inputs, output):
    q, k, v, aux_tensors, block_mask, block_size, scale, mods, aux_scalars, deterministic = inputs
    out, lse = output
    ctx.set_materialize_grads(False)  # an unused LSE output then costs nothing in the backward
    ctx.num_aux = len(aux_tensors)
    ctx.mask_present = [t is not None for t in block_mask]
    ctx.block_size, ctx.scale, ctx.mods = block_size, scale, mods
    ctx.num_block_size = len(block_size)
    ctx.aux_scalars, ctx.deterministic = aux_scalars, deterministic
    ctx.save_for_backward(q, k, v, out, lse, *aux_tensors, *[t for t in block_mask if t is not None])


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, *rest = ctx.saved_tensors
    aux_tensors, mask_tensors = rest[:ctx.num_aux], iter(rest[ctx.num_aux:])
    block_mask = [next(mask_tensors) if present else None for present in ctx.mask_present]
    dq, dk, dv, aux_grads = _gradients(
        dout, out, aux_tensors, _ops.mod_entry(ctx.mods).grad_slots,
        lambda do: _ops.flex_attention_bwd(do, q, k, v, out, lse, dlse, list(aux_tensors), block_mask, ctx.block_size,
                                           ctx.scale, ctx.mods, ctx.aux_scalars, ctx.deterministic))
    return (dq, dk, dv, aux_grads, _no_grad_like(ctx.mask_present), _no_grad_like([False] * ctx.num_block_size),
            None, None,
            _no_grad_like([False] * len(ctx.aux_scalars)), None)


def _gradients(dout, out, aux_tensors, grad_slots, run_backward) -> tuple:
    """(dq, dk, dv, one gradient or None per captured tensor in its dtype); `run_backward(dout)` is the backward op
    (custom-op path) or its body (eager path) and returns the captured-tensor gradients listed by `grad_slots`."""
    if dout is None:  # only the LSE output was used
        dout = torch.zeros_like(out)
    dq, dk, dv, grads = run_backward(dout.contiguous())
    aux_grads = [None] * len(aux_tensors)
    for slot, g in zip(grad_slots, grads):
        aux_grads[slot] = g.to(aux_tensors[slot].dtype)
    return dq, dk, dv, aux_grads


def _no_grad_like(is_tensor: list[bool]):
    """The 'no gradient' that mirrors a list input: torch treats an all-tensor (or empty) list as a node of the
    input tree and anything else as a leaf, and the backward must return the same tree."""
    return [None] * len(is_tensor) if all(is_tensor) else None


_ops.flex_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


class EagerCall:
    """Everything an eager training call passes to `EagerAttention` besides the tensors autograd must see: the mods'
    registry entry, the block mask (its object and its eight tensors, None where absent), the scale and the mode.

    One plain object instead of a dozen arguments: `Function.apply` pays per argument (functorch unwrapping, input
    bookkeeping), and the block-mask tensors never need gradients, so they need not be Function inputs."""

    __slots__ = ("entry", "block_mask", "mask_tensors", "block_size", "scale", "deterministic", "bound")

    def __init__(self, entry, block_mask, mask_tensors: list, block_size: list, scale: float, deterministic: bool,
                 bound=None):
        self.entry, self.block_mask, self.mask_tensors = entry, block_mask, mask_tensors
        self.block_size, self.scale, self.deterministic = block_size, scale, deterministic
        self.bound = bound  # a `runtime.launch.BoundForward` writing the LSE (warm calls), else None


class EagerAttention(torch.autograd.Function):
    """The custom ops' autograd formula without the custom-op dispatch, for eager mode.

    Inputs: q, k, v, the `EagerCall`, then the captured tensors (so that learnable ones receive gradients)."""

    @staticmethod
    def forward(ctx, q, k, v, call: EagerCall, *aux_tensors):
        result = call.bound(q, k, v, call.scale) if call.bound is not None else None
        if result is None:  # (a bound launch declines a misaligned base address)
            result = _ops.attention_forward(q, k, v, call.entry, call.mask_tensors, call.block_size, call.scale,
                                            bm=call.block_mask)
        out, lse = result
        ctx.set_materialize_grads(False)
        ctx.call = call
        ctx.aux_scalars = list(call.entry.aux_scalars)  # the values this forward ran with
        ctx.num_aux = len(aux_tensors)
        # The block-mask tensors are saved too (not Function inputs: they never need gradients), so that editing
        # them in place before the backward is an error instead of silently different lists.
        ctx.save_for_backward(q, k, v, out, lse, *aux_tensors, *[t for t in call.mask_tensors if t is not None])
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *rest = ctx.saved_tensors
        call = ctx.call
        aux_tensors, saved_masks = rest[:ctx.num_aux], iter(rest[ctx.num_aux:])
        mask_tensors = [None if t is None else next(saved_masks) for t in call.mask_tensors]
        dq, dk, dv, aux_grads = _gradients(
            dout, out, aux_tensors, call.entry.grad_slots,
            lambda do: _ops.attention_backward(do, q, k, v, out, lse, dlse, call.entry, list(aux_tensors),
                                               mask_tensors, call.block_size, call.scale, ctx.aux_scalars,
                                               call.deterministic))
        return (dq, dk, dv, None, *aux_grads)


class WarmTraining:
    """A validated training call, bound: what `flexlab.flex_attention` runs when a later call with gradients has the
    same signature (shapes, strides, dtypes, devices, mods and mask by identity). It skips validation, the backend
    choice and the forward's planning: the forward launches through a `runtime.launch.BoundForward` that writes the
    LSE, inside the same `EagerAttention` as the full path. It re-checks what can change between calls: whether
    gradients are wanted, what the mods capture (`backends.cute.WarmForward.captures_current`), the deterministic
    mode."""

    __slots__ = ("forward", "entry", "generated", "block_mask", "mask_tensors", "block_size", "default_scale")

    def __call__(self, q, k, v, scale, deterministic):
        """(out, lse), or None where the full path must run."""
        if not torch.is_grad_enabled():
            return None
        fwd = self.forward
        low = fwd.lowered
        if low is not None and not fwd.captures_current():
            return None
        if not (q.requires_grad or k.requires_grad or v.requires_grad or
                (low is not None and low.captured_requires_grad())):
            return None  # no gradient wanted: the inference path
        entry = self.entry
        if entry.generated is not self.generated:
            # Another call re-generated the shared entry for other captured values: generate it for the current
            # ones (which `captures_current` found equal to the bound ones, in-place versions aside). Otherwise the
            # entry still holds what it held at binding, so walking the mods' captures a second time is not needed.
            entry.refresh()
            self.generated = entry.generated
        if deterministic is None:
            deterministic = torch.are_deterministic_algorithms_enabled()
        call = EagerCall(entry, self.block_mask, self.mask_tensors, self.block_size,
                         self.default_scale if scale is None else float(scale), bool(deterministic), fwd.bound)
        return EagerAttention.apply(q, k, v, call, *entry.aux_tensors)


def bind_training(query, key, value, score_mod, block_mask) -> WarmTraining | None:
    """`WarmTraining` for a call the full path has just run through `differentiable_attention` in eager mode, or
    None where its forward cannot be bound (`backends.cute.bind_forward`)."""
    from .backends import cute
    forward = cute.bind_forward(query, key, value, score_mod, block_mask, with_lse=True)
    if forward is None:
        return None
    warm = WarmTraining()
    warm.forward = forward
    warm.entry = _ops.mod_entry(_mods_key(score_mod, effective_mask_mod(block_mask)))  # (refreshed by this call)
    warm.generated = warm.entry.generated
    warm.block_mask = block_mask
    warm.mask_tensors, warm.block_size = _block_mask_tensors(block_mask)
    warm.default_scale = query.shape[-1] ** -0.5
    return warm


@_ops.constant_under_compile
def _mods_key(score_mod, mask_mod) -> str:
    """Registry key of the mods; run eagerly even inside torch.compile, whose graph then holds the string."""
    return _ops.register_mods(score_mod, mask_mod)


def _block_mask_tensors(block_mask) -> tuple[list, list]:
    if block_mask is None:
        return [], []
    tensors = [block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
               block_mask.full_kv_indices, block_mask.q_num_blocks, block_mask.q_indices,
               block_mask.full_q_num_blocks, block_mask.full_q_indices]
    return tensors, [int(block_mask.BLOCK_SIZE[0]), int(block_mask.BLOCK_SIZE[1])]


def backward_unsupported_reason(query, block_mask) -> str | None:
    """Why flexlab's Hopper backward cannot differentiate this call (None when it can); no cutlass import.

    For `flexlab.api` to decide between backend="cute" and a fallback before running the forward.
    """
    if block_mask is None:
        return backward_reason(query.dtype, query.shape[-1], None, True)
    return backward_reason(query.dtype, query.shape[-1], block_mask.BLOCK_SIZE, block_mask.q_num_blocks is not None)


def backward_reason(dtype, head_dim: int, block_size, has_q_lists: bool) -> str | None:
    """`backward_unsupported_reason` from plain values (no tensors), for decisions folded at trace time."""
    from .kernels.bwd_config import BWD_HEAD_DIMS, default_bwd_config
    if dtype not in (torch.bfloat16, torch.float16):
        return f"the backward kernel takes bfloat16/float16, got {dtype}"
    if head_dim not in BWD_HEAD_DIMS:
        return f"the backward kernel supports head dims {BWD_HEAD_DIMS}, got {head_dim}"
    if block_size is not None:
        q_bs, kv_bs = (int(x) for x in block_size)
        err = default_bwd_config(head_dim, q_block=q_bs).block_mask_error(q_bs, kv_bs)
        if err:
            return err + "; build the mask with BLOCK_SIZE=128"
        if not has_q_lists:
            return "the block mask has no Q-direction lists (q_num_blocks); build it with create_block_mask"
    return None


def differentiable_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                             return_lse=False, deterministic: bool | None = None):
    """flex_attention through flexlab's custom ops (inputs already validated by `flexlab.api`).

    deterministic: bitwise-reproducible gradients; None follows `torch.are_deterministic_algorithms_enabled()`.
    """
    mask_mod = effective_mask_mod(block_mask)
    key_ = _mods_key(score_mod, mask_mod)
    entry = _ops.mod_entry(key_)
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    mask_tensors, block_size = _block_mask_tensors(block_mask)
    if not torch.compiler.is_compiling():
        call = EagerCall(entry, block_mask, mask_tensors, block_size, scale, bool(deterministic))
        outputs = EagerAttention.apply(query, key, value, call, *entry.aux_tensors)
        return outputs if return_lse else outputs[0]
    out, lse = _ops.flex_attention_fwd(query, key, value, entry.aux_tensors, mask_tensors, block_size, scale, key_,
                                       entry.aux_scalars, bool(deterministic))
    return (out, lse) if return_lse else out
