"""torch custom ops for flexlab attention: schemas, fake implementations, and one implementation per device.

A custom op is opaque to torch.compile: Dynamo puts it in the graph as one node, and AOTAutograd runs its fake
implementation to learn output shapes, so no graph break happens however complex the kernel behind it is. The
schema can only carry tensors, numbers, bools and strings, so a (score_mod, mask_mod) pair travels as the string key
of a `ModEntry` registered here, and everything that is data travels as tensors: the captured tensors of the mods
(so autograd sees the learnable ones) and the eight index tensors of the block mask.

Implementations: on CUDA the forward is `flexlab.backends.cute` and the backward is flexlab's Hopper backward kernel
(`kernels/bwd_launch`); on CPU both run dense math (the reference forward and `kernels/bwd_reference`, the backward
kernel's algorithm), so the ops, their autograd formula and their tracing are testable without a GPU.
"""
from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from typing import Callable, Optional

import torch
from torch import Tensor
from torch._guards import CompileContext  # loaded by `import torch` itself, unlike Dynamo

from .errors import FlexlabValueError


def constant_under_compile(fn: Callable) -> Callable:
    """`torch._dynamo.assume_constant_result`, without importing Dynamo (a second or more) when flexlab is imported.

    Dynamo runs a function so marked eagerly while tracing and puts its result in the graph as a constant.
    """
    fn._dynamo_marked_constant = True  # the mark torch's decorator sets; tests/test_import.py holds them equal
    return fn


NUM_MASK_TENSORS = 8  # kv_num, kv_idx, full_kv_num, full_kv_idx, q_num, q_idx, full_q_num, full_q_idx


class ModEntry:
    """One registered (score_mod, mask_mod) pair, its generated code, and plain lists of what it captures.

    The lists are plain attributes so that Dynamo, tracing `differentiable_attention`, only reads them.
    """

    def __init__(self, key: str, score_mod: Optional[Callable], mask_mod: Optional[Callable]):
        self.key, self.score_mod, self.mask_mod = key, score_mod, mask_mod
        self.generated = None
        self.aux_tensors: list[Tensor] = []
        self.aux_scalars: list[float] = []
        self.grad_slots: list[int] = []  # positions in aux_tensors whose gradient the backward computes
        self.stored_masks = None
        self._state = None
        self.refresh()

    def refresh(self) -> None:
        """Generate again when something the mods capture changed (a new window size, a rebound tensor)."""
        if self.score_mod is None and self.mask_mod is None:
            return
        state = (_rebinding_state(self.score_mod), _rebinding_state(self.mask_mod))
        if self.generated is not None and state == self._state:
            return
        from .codegen import generate
        # fastmath, as the forward kernel's mods: the backward must recompute exactly the scores the LSE came from.
        g = generate(self.score_mod, self.mask_mod, fastmath=True)
        self.generated, self._state = g, state
        # Partial-block masks stored as bits for the backward (`runtime.mask_bits`), where mask_mod reads captured
        # tensors; its cache follows in-place edits of them through their version counters.
        from .runtime.mask_bits import store_for
        self.stored_masks = store_for(g, self.mask_mod, watch=tuple(g.mask_aux_tensors))
        self.aux_tensors = list(g.aux_tensors)
        self.aux_scalars = [float(v) for v in g.aux_scalars]
        self.grad_slots = [i for i, rg in enumerate(g.aux_requires_grad) if rg]


def _rebinding_state(fn) -> tuple:
    """What must not change for the generated code to stay valid: captured numbers by value, everything else
    (tensors included) by identity. In-place updates of a captured tensor (an optimizer step on a learnable bias)
    do not count: the kernels read captured tensors at run time."""
    if fn is None:
        return ()
    values = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    code, glb = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
    if code is not None:
        values += [glb[n] for n in code.co_names if n in glb]
    return tuple(v if isinstance(v, (bool, int, float, str)) else id(v) for v in values)


_ENTRIES: dict[str, ModEntry] = {}
_KEYS: dict[tuple, str] = {}
_PINNED: set[str] = set()  # keys a torch.compile graph holds as constants: never dropped
_NEXT_KEY = itertools.count()
_LOCK = threading.Lock()
# Entries registered in eager mode that are kept: a model that defines its mods afresh at every step registers a
# new pair each time. Dropping the oldest is safe there, because the eager autograd path keeps its entry object for
# the backward (`autograd.EagerAttention`); keys registered while torch.compile traces are pinned instead.
EAGER_ENTRIES_KEPT = 256


def dynamo_compiling() -> bool:
    """Whether torch.compile is at work, also inside a function it runs eagerly as a constant while tracing.

    There `torch.compiler.is_compiling()` is True only on torch versions that hold it for the whole compile session;
    Dynamo's compile context is set on every version.
    """
    return torch.compiler.is_compiling() or CompileContext.try_get() is not None


def register_mods(score_mod: Optional[Callable], mask_mod: Optional[Callable]) -> str:
    """The registry key of this (score_mod, mask_mod) pair; the same function objects get the same key for as long
    as the entry is kept (always, once a torch.compile graph holds it)."""
    pair = (score_mod, mask_mod)
    key = _KEYS.get(pair)
    compiling = dynamo_compiling()
    if key is None:
        with _LOCK:
            key = _KEYS.get(pair)
            if key is None:
                key = f"mods{next(_NEXT_KEY)}"
                _ENTRIES[key] = ModEntry(key, score_mod, mask_mod)
                _KEYS[pair] = key
                if compiling:
                    _PINNED.add(key)
                _drop_oldest_eager_entries()
                return key
    if compiling:
        _PINNED.add(key)
    _ENTRIES[key].refresh()
    return key


def _drop_oldest_eager_entries() -> None:
    eager = [k for k in _ENTRIES if k not in _PINNED]
    for key in eager[:max(0, len(eager) - EAGER_ENTRIES_KEPT)]:
        entry = _ENTRIES.pop(key)
        _KEYS.pop((entry.score_mod, entry.mask_mod), None)


def mod_entry(key: str) -> ModEntry:
    entry = _ENTRIES.get(key)
    if entry is None:
        raise FlexlabValueError(f"no flexlab mods registered under {key!r}; keys come from register_mods()")
    return entry


_MASKS: "OrderedDict[tuple, tuple]" = OrderedDict()
_MASKS_KEPT = 16


def rebuild_block_mask(block_mask: list[Optional[Tensor]], block_size: list[int], mask_mod, q_len: int,
                       kv_len: int):
    """A torch BlockMask from the op's tensor list (None when the list is empty).

    The same tensors give the same BlockMask object, so the kernels' per-mask caches (tile-split block lists) hit
    in a training loop that reuses its mask. Entries hold their tensors, so an address in the key cannot be reused
    by another mask while cached; the in-place version counter catches edits.
    """
    if not block_mask:
        return None
    from torch.nn.attention.flex_attention import BlockMask, noop_mask
    kv_num, kv_idx, full_num, full_idx = block_mask[:4]
    key = (tuple((t.data_ptr(), t._version, tuple(t.shape)) if t is not None else None for t in block_mask[:4]),
           tuple(block_size), mask_mod, q_len, kv_len)
    hit = _MASKS.get(key)
    if hit is not None:
        _MASKS.move_to_end(key)
        return hit[0]
    bm = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=tuple(block_size),
                                  mask_mod=mask_mod or noop_mask, seq_lengths=(q_len, kv_len), compute_q_blocks=False)
    _MASKS[key] = (bm, tuple(block_mask[:4]))
    while len(_MASKS) > _MASKS_KEPT:
        _MASKS.popitem(last=False)
    return bm


# ----------------------------------------------------------------------------------------------------- forward
def attention_forward(q: Tensor, k: Tensor, v: Tensor, entry: ModEntry, block_mask: list[Optional[Tensor]],
                      block_size: list[int], scale: float, bm=None) -> tuple[Tensor, Tensor]:
    """The forward op's body, also called directly by the eager autograd path (`autograd.EagerAttention`), which
    passes the BlockMask object `bm` it already holds."""
    if bm is None:
        bm = rebuild_block_mask(block_mask, block_size, entry.mask_mod, q.shape[2], k.shape[2])
    enable_gqa = q.shape[1] != k.shape[1]
    if q.is_cuda:
        from .backends.cute import flex_attention_forward
        out, lse = flex_attention_forward(q, k, v, entry.score_mod, bm, scale, enable_gqa)
        return out, lse.float()
    from .kernels.bwd_reference import dense_forward, kept_pairs
    keep = kept_pairs(bm, entry.generated, q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.device)
    return dense_forward(q, k, v, scale, entry.generated, keep)


@torch.library.custom_op("flexlab::flex_attention_fwd", mutates_args=())
def flex_attention_fwd(q: Tensor, k: Tensor, v: Tensor, aux_tensors: list[Tensor],
                       block_mask: list[Optional[Tensor]], block_size: list[int], scale: float, mods: str,
                       aux_scalars: list[float], deterministic: bool) -> tuple[Tensor, Tensor]:
    """(out (B, Hq, Sq, D) in q's dtype, lse (B, Hq, Sq) fp32, natural log). `deterministic` is for the backward."""
    return attention_forward(q, k, v, mod_entry(mods), block_mask, block_size, scale)


@flex_attention_fwd.register_fake
def _(q, k, v, aux_tensors, block_mask, block_size, scale, mods, aux_scalars, deterministic):
    B, Hq, Sq, _ = q.shape
    return q.new_empty((B, Hq, Sq, v.shape[-1])), q.new_empty((B, Hq, Sq), dtype=torch.float32)


# ----------------------------------------------------------------------------------------------------- backward
def attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       dlse: Optional[Tensor], entry: ModEntry, aux_tensors: list[Tensor],
                       block_mask: list[Optional[Tensor]], block_size: list[int], scale: float,
                       aux_scalars: list[float], deterministic: bool):
    """The backward op's body, also called directly by the eager autograd path."""
    if q.is_cuda:
        from .kernels.bwd_launch import backward
        return backward(dout, q, k, v, out, lse, dlse, entry, aux_tensors, block_mask, block_size, scale,
                        aux_scalars, deterministic)
    from .kernels.bwd_reference import dense_backward, kept_pairs
    bm = rebuild_block_mask(block_mask, block_size, entry.mask_mod, q.shape[2], k.shape[2])
    keep = kept_pairs(bm, entry.generated, q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.device)
    dq, dk, dv, aux_grads = dense_backward(dout, q, k, v, out, lse, dlse, scale, entry.generated, keep)
    return dq, dk, dv, aux_grads


@torch.library.custom_op("flexlab::flex_attention_bwd", mutates_args=())
def flex_attention_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       dlse: Optional[Tensor], aux_tensors: list[Tensor], block_mask: list[Optional[Tensor]],
                       block_size: list[int], scale: float, mods: str, aux_scalars: list[float],
                       deterministic: bool) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """(dq, dk, dv, grads of the captured tensors listed by `ModEntry.grad_slots`, fp32)."""
    return attention_backward(dout, q, k, v, out, lse, dlse, mod_entry(mods), aux_tensors, block_mask, block_size,
                              scale, aux_scalars, deterministic)


@flex_attention_bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, aux_tensors, block_mask, block_size, scale, mods, aux_scalars, deterministic):
    slots = mod_entry(mods).grad_slots
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            [aux_tensors[i].new_empty(aux_tensors[i].shape, dtype=torch.float32) for i in slots])
