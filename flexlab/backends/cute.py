"""flexlab's own CuTeDSL kernels as a flex_attention backend (Hopper, sm90a).

`is_supported` answers without importing cutlass or touching the GPU beyond asking its compute capability;
`flex_attention_forward` lowers the mods with the code generator (cached per mod), then hands everything to
`flexlab.runtime.launch`; `bind_forward` binds a validated inference call once (`WarmForward`) for `flexlab.api`'s
warm path.
"""
from __future__ import annotations

import importlib.util
import types

import torch
from torch.nn.attention.flex_attention import noop_mask

from .._bounded import put_bounded
from ..errors import BackendUnavailableError, UnsupportedModError

_DTYPES = frozenset((torch.bfloat16, torch.float16))
_HEAD_DIMS = (64, 128, 256)


def _captured_state(fn) -> tuple:
    """Its code object and what a mod reads from outside: closure cells and the globals its code names. Numbers by
    value, tensors by identity and in-place version, anything else by identity. Cheap enough to check on every
    call: where to look is worked out once per function (`_readers`), only the values are read each time."""
    if fn is None:
        return ()
    cells, glb, names = _readers(fn)
    # the code object too: a function whose __code__ was swapped must be traced again even if it reads the same
    state = [getattr(fn, "__code__", None)]
    for cell in cells:
        try:
            state.append(_fingerprint(cell.cell_contents))
        except ValueError:  # an empty cell
            continue
    for name in names:
        value = glb.get(name, _ABSENT)
        if value is not _ABSENT:
            state.append(_fingerprint(value))
    return tuple(state)


_ABSENT = object()


_READERS: dict = {}


def _readers(fn) -> tuple:
    """(closure cells, globals dict, names of the code that are globals) of `fn`, cached per (function, code)."""
    code = getattr(fn, "__code__", None)
    hit = _READERS.get(fn)
    if hit is not None and hit[0] is code:
        return hit[1]
    cells = tuple(getattr(fn, "__closure__", None) or ())
    glb = getattr(fn, "__globals__", {}) if code is not None else {}
    # A name of the code that is not a global now (an attribute such as `torch.where`'s `where`) cannot be one the
    # mod reads later: it would have failed to trace.
    names = tuple(n for n in code.co_names if n in glb) if code is not None else ()
    put_bounded(_READERS, fn, (code, (cells, glb, names)), MOD_CACHE_ENTRIES)
    return cells, glb, names


_BY_VALUE = frozenset((bool, int, float, str))
# Types read by identity that are never numbers or tensors (a mod's globals are mostly modules and functions): their
# exact type is checked first, because `isinstance(v, torch.Tensor)` alone costs about half a microsecond.
_BY_IDENTITY = frozenset((types.ModuleType, types.FunctionType, types.BuiltinFunctionType, type))


def _fingerprint(v):
    kind = type(v)
    if kind in _BY_VALUE:
        return v
    if kind in _BY_IDENTITY:
        return id(v)
    if isinstance(v, (bool, int, float, str)):  # their subclasses (IntEnum, ...) by value too
        return v
    if isinstance(v, torch.Tensor):
        return (id(v), v._version)
    return id(v)


class _Lowered:
    """A generated mod pair ready for the runtime: kernel mods, captured tensors in kernel dtypes, scalar values."""

    def __init__(self, g, state, mask_mod=None):
        from ..runtime.compile import KernelMods
        from ..runtime.mask_bits import store_for
        self.state = state
        module = g.module()
        self.aux_tensors = tuple(g.kernel_aux_tensors())  # detached kernel copies
        self.captured = tuple(g.aux_tensors)  # the user's tensors: whether they require grad is read per call
        self.aux_scalars = tuple(int(v) if k != "float" else float(v) for v, k in zip(g.aux_scalars,
                                                                                     g.aux_scalar_kinds))
        specs = tuple((str(t.dtype).removeprefix("torch."), t.dim()) for t in self.aux_tensors)
        kinds = tuple("float" if k == "float" else "int" for k in g.aux_scalar_kinds)
        # Keyed by the generated text, not only the traced graph (`GeneratedMods.source_hash`).
        self.mods = KernelMods(module.score_mod if g.has_score_mod else None,
                               module.mask_mod if g.has_mask_mod else None, g.source_hash, specs, kinds)
        self._per_device: dict = {}
        self._generated = g
        self._captured_ids = frozenset(id(t) for t in self.captured)
        self._layout = _layouts(self.captured)
        # Partial-block masks stored as bits where mask_mod reads captured tensors (`runtime.mask_bits`); the store
        # dates its entries by the captured tensors' versions, so an in-place edit rebuilds them.
        self.stored_masks = store_for(g, mask_mod, watch=tuple(g.mask_aux_tensors))

    def only_versions_moved(self, old: tuple, new: tuple, tensor_ids: frozenset | None = None) -> bool:
        """Whether two `_mods_state`s of these mods differ at most in the in-place versions of the tensors they
        capture (of those in `tensor_ids`, by identity, where given), with the captured tensors' shapes, strides,
        dtypes and devices as this lowering found them."""
        ids = self._captured_ids if tensor_ids is None else tensor_ids
        return _only_versions_moved(old, new, ids) and _layouts(self.captured) == self._layout

    def in_place_ids(self, kernel_tensors: tuple) -> frozenset:
        """Ids of the captured tensors whose in-place edits leave a launch bound with `kernel_tensors` (`tensors_on`
        of some device) valid: the kernel reads their own memory, and no stored mask bits come from their values
        (the next launch simply reads the new values)."""
        from_bits = {id(t) for t in self._generated.mask_aux_tensors} if self.stored_masks is not None else set()
        return frozenset(id(c) for t, c in zip(kernel_tensors, self.captured)
                         if t.data_ptr() == c.data_ptr() and t.dtype == c.dtype and id(c) not in from_bits)

    def follow_in_place_edits(self, state: tuple) -> bool:
        """Adopt `state` without tracing again when it differs from this lowering's only in the in-place versions of
        tensors the mods capture (`only_versions_moved`; an optimizer step on a learnable bias): the generated code
        never depends on captured values, so only the kernel's copies of them are re-read
        (`GeneratedMods.kernel_aux_tensors` converts again only where it had to convert). False where anything
        else changed."""
        if not self.only_versions_moved(self.state, state):
            return False
        self.aux_tensors = tuple(self._generated.kernel_aux_tensors())
        self._per_device = {}
        self.state = state
        return True

    def captured_requires_grad(self) -> bool:
        """Whether a tensor the mods capture requires grad now (read from the user's tensors at every call)."""
        return any(t.requires_grad for t in self.captured)

    def tensors_on(self, device) -> tuple:
        """Captured tensors on the inputs' device (copied once per device, not per call)."""
        hit = self._per_device.get(device)
        if hit is None:
            hit = tuple(t if t.device == device else t.to(device) for t in self.aux_tensors)
            self._per_device[device] = hit
        return hit


def _layouts(tensors) -> tuple:
    return tuple((t.shape, t.stride(), t.dtype, t.device) for t in tensors)


def _only_versions_moved(old: tuple, new: tuple, tensor_ids: frozenset) -> bool:
    """Whether two `_mods_state`s differ at most in the version of tensors in `tensor_ids` (by identity)."""
    if len(old) != len(new):
        return False
    for old_fn, new_fn in zip(old, new):
        if len(old_fn) != len(new_fn):
            return False
        for a, b in zip(old_fn, new_fn):
            if a == b:
                continue
            if not (type(a) is tuple and type(b) is tuple and a[0] == b[0] and a[0] in tensor_ids):
                return False
    return True


_LOWERED: dict = {}
# Mods defined afresh at every call (a closure inside a model's forward) make a new entry each time: the per-mod
# caches keep the newest entries only, so such a loop does not hold every mod it ever saw (and what they capture).
MOD_CACHE_ENTRIES = 512


def _mods_state(score_mod, mask_mod) -> tuple:
    """What a lowering of this mod pair depends on besides the functions themselves (`_captured_state` of each)."""
    return _captured_state(score_mod), _captured_state(mask_mod)


def _lowered(score_mod, mask_mod) -> _Lowered:
    """Generate once per mod pair; re-trace only when something the mods capture changed (a new scalar value, a
    rebound captured tensor). An in-place edit of a captured tensor only refreshes the kernel's copies of them
    (`_Lowered.follow_in_place_edits`). The compiled kernel is reused unless the structure changed."""
    state = _mods_state(score_mod, mask_mod)
    key = (score_mod, mask_mod)
    hit = _LOWERED.get(key)
    if hit is not None and hit.state != state and hit.follow_in_place_edits(state):
        return hit
    if hit is None or hit.state != state:
        from ..codegen import generate  # the code generator: readable CuTeDSL source for the mods
        # fastmath: hardware approximations (tanh.approx, ex2.approx, ...) whose error is far below the bf16/fp16
        # rounding of P, the same trade FA4 makes for its soft-cap.
        hit = _Lowered(generate(score_mod, mask_mod, fastmath=True), state, mask_mod)
        put_bounded(_LOWERED, key, hit, MOD_CACHE_ENTRIES)
    return hit


def _real_mask(mask_mod):
    """`mask_mod`, or None when it masks nothing (absent, or torch's noop_mask)."""
    return None if mask_mod is None or mask_mod is noop_mask else mask_mod


def effective_mask_mod(block_mask):
    """The block mask's mask_mod, or None where it masks nothing (no mask, or torch's noop_mask)."""
    return None if block_mask is None else _real_mask(block_mask.mask_mod)


_DEVICE_REASON: dict = {}


def _device_reason(device) -> str:
    """"" when this device has a flexlab kernel and the DSL is installed, else why not (cached per device)."""
    if device.type != "cuda":
        return f"needs CUDA tensors, got {device}"
    reason = _DEVICE_REASON.get(device)
    if reason is None:
        from ..runtime.arch import forward_arch, supported_names
        cap = torch.cuda.get_device_capability(device)
        if forward_arch(cap) is None:
            reason = f"no kernel for compute capability {cap[0]}.{cap[1]}; kernels exist for {supported_names()}"
        elif importlib.util.find_spec("cutlass") is None:
            reason = "nvidia-cutlass-dsl is not installed (pip install nvidia-cutlass-dsl==4.8.1)"
        else:
            reason = ""
        _DEVICE_REASON[device] = reason
    return reason


def support_reason(device, dtype, head_dim: int, v_head_dim: int, score_mod, mask_mod, block_size) -> str:
    """"" when the forward kernel runs these inputs, else why not. Takes no tensors (only what the decision needs),
    so `flexlab.api` can have torch.compile fold it into a constant at trace time."""
    return support_and_captured_grad(device, dtype, head_dim, v_head_dim, score_mod, mask_mod, block_size)[0]


def support_and_captured_grad(device, dtype, head_dim: int, v_head_dim: int, score_mod, mask_mod,
                              block_size) -> tuple[str, bool]:
    """(`support_reason`, whether a tensor the mods capture requires grad), lowering the mods once: checking what
    they capture is the larger part of a warm call's host time."""
    reason = _device_reason(device)
    if reason:
        return reason, False
    if dtype not in _DTYPES:
        return f"dtype {dtype} unsupported; use bfloat16 or float16", False
    if head_dim not in _HEAD_DIMS or v_head_dim != head_dim:
        return (f"head dim {head_dim} (value {v_head_dim}) unsupported; supported: {_HEAD_DIMS}, equal for q/k/v",
                False)
    mask_mod = _real_mask(mask_mod)
    low = None
    if score_mod is not None or mask_mod is not None:
        try:
            low = _lowered(score_mod, mask_mod)
        except UnsupportedModError as e:
            return str(e), False
        except ImportError as e:
            return f"the code generator cannot run: {e}", False
    if block_size is not None:
        # the tile the launcher will pick depends on the mods (`kernels.config.default_config`)
        reason = (_mask_reason(block_size, head_dim) if low is None else
                  _mask_reason(block_size, head_dim, low.mods.score_mod is not None, bool(low.aux_tensors)))
        if reason:
            return reason, False
    return "", low is not None and low.captured_requires_grad()


def is_supported(q, k, v, score_mod, block_mask, scale, enable_gqa) -> tuple[bool, str]:
    reason = support_reason(q.device, q.dtype, q.shape[-1], v.shape[-1], score_mod,
                            None if block_mask is None else block_mask.mask_mod,
                            None if block_mask is None else block_mask.BLOCK_SIZE)
    return not reason, reason


def kernel_mods(score_mod, mask_mod):
    """The `KernelMods` backend="cute" compiles for these mods (a noop mask counts as none), for tools that build
    or inspect kernels outside a launch (precompilation, the compile report)."""
    from ..runtime.compile import KernelMods
    mask_mod = _real_mask(mask_mod)
    if score_mod is None and mask_mod is None:
        return KernelMods()
    return _lowered(score_mod, mask_mod).mods


def stores_mask_bits(score_mod, mask_mod) -> bool:
    """Whether launches with this mask_mod (in a BlockMask) read partial-block masks from stored bits
    (`runtime.mask_bits`) rather than evaluating it, where the kernel's tiles allow."""
    mask_mod = _real_mask(mask_mod)
    return mask_mod is not None and _lowered(score_mod, mask_mod).stored_masks is not None


def captured_requires_grad(score_mod, mask_mod) -> bool:
    """Whether a tensor the mods capture requires grad (a learnable bias table, per-head slopes, ...). Mods the code
    generator cannot lower (which other backends still run) are searched for captured tensors without tracing."""
    mask_mod = _real_mask(mask_mod)
    if score_mod is None and mask_mod is None:
        return False
    try:
        return _lowered(score_mod, mask_mod).captured_requires_grad()
    except (UnsupportedModError, ImportError):
        from ..codegen.captures import captured_tensors
        return any(t.requires_grad for t in captured_tensors(score_mod, mask_mod))


_MASK_REASON: dict = {}


def _mask_reason(block_size, head_dim: int, has_score_mod: bool = False, captured_tensors: bool = False) -> str:
    # a BlockMask's BLOCK_SIZE is a tuple of ints: tuple() returns it as is
    key = (tuple(block_size), head_dim, has_score_mod, captured_tensors)
    reason = _MASK_REASON.get(key)
    if reason is None:
        from ..kernels.config import default_config
        from ..runtime.sparsity import block_size_incompatibility
        cfg = default_config(head_dim, True, has_score_mod, captured_tensors=captured_tensors)
        reason = block_size_incompatibility(tuple(int(x) for x in block_size), cfg.tile_m, cfg.tile_n) or ""
        _MASK_REASON[key] = reason
    return reason


_LAUNCH = None


def _load_launch():
    """`runtime.launch`, imported on first use (an import statement in the warm path costs ~1 us a call)."""
    global _LAUNCH
    from ..runtime import launch
    _LAUNCH = launch
    return launch


def flex_attention_forward(q, k, v, score_mod, block_mask, scale, enable_gqa, captures_checked: bool = False,
                           with_lse: bool = True):
    """(out in q's dtype, lse fp32 natural log (B, Hq, Sq)); lse is None with `with_lse=False`, which runs a kernel
    that never writes it.

    Inputs arrive validated by flexlab.api, which has already asked `is_supported`; this path does no re-checking
    beyond the device so that a warm call stays within microseconds of host time. `captures_checked`: the caller
    lowered these mods (`support_reason`) earlier in the same call, so their captured values are not read again.
    """
    if q.device.type != "cuda":
        raise BackendUnavailableError(f"backend='cute' needs CUDA tensors, got {q.device}")
    forward = (_LAUNCH or _load_launch()).forward
    mask_mod = effective_mask_mod(block_mask)
    if score_mod is None and mask_mod is None:
        return forward(q, k, v, block_mask=block_mask, scale=scale, with_lse=with_lse)
    low = _LOWERED.get((score_mod, mask_mod)) if captures_checked else None
    if low is None:
        low = _lowered(score_mod, mask_mod)
    return forward(q, k, v, low.mods, low.tensors_on(q.device), low.aux_scalars, block_mask, scale,
                   with_lse=with_lse, stored_masks=low.stored_masks)


class WarmForward:
    """A validated inference call, bound (`runtime.launch.BoundForward`): what `flexlab.flex_attention` runs when a
    later call has the same signature. It re-checks only what can change between calls of one signature: whether
    gradients are wanted (then the differentiable path runs) and what the mods capture (a changed capture goes back
    to the full path, which lowers the mods again and binds anew; an in-place edit of a tensor the kernel reads in
    place changes nothing bound)."""

    __slots__ = ("bound", "score_mod", "mask_mod", "lowered", "state", "in_place")

    def __call__(self, q, k, v, scale):
        """(out, lse), or None where the full path must run."""
        grad = torch.is_grad_enabled()
        if grad and (q.requires_grad or k.requires_grad or v.requires_grad):
            return None
        low = self.lowered
        if low is not None:
            if not self.captures_current():
                return None
            if grad and low.captured_requires_grad():
                return None
        return self.bound(q, k, v, scale)

    def captures_current(self) -> bool:
        """Whether what the mods capture is what this launch was bound with (or differs only by in-place edits of
        tensors the kernel reads in place)."""
        state = _mods_state(self.score_mod, self.mask_mod)
        if state == self.state:
            return True
        if self.in_place and self.lowered.only_versions_moved(self.state, state, self.in_place):
            self.state = state
            return True
        return False


def bind_forward(q, k, v, score_mod, block_mask, with_lse: bool = True) -> WarmForward | None:
    """`WarmForward` for a call the full path has just validated and found forward-only, or None where it cannot be
    bound (see `runtime.launch.bind`)."""
    if q.device.type != "cuda":
        return None
    launch = _LAUNCH or _load_launch()
    mask_mod = effective_mask_mod(block_mask)
    low = None
    if score_mod is None and mask_mod is None:
        bound = launch.bind(q, k, v, block_mask=block_mask, with_lse=with_lse)
    else:
        low = _LOWERED.get((score_mod, mask_mod))
        if low is None:
            return None
        bound = launch.bind(q, k, v, low.mods, low.tensors_on(q.device), low.aux_scalars, block_mask, with_lse,
                            stored_masks=low.stored_masks)
    if bound is None:
        return None
    warm = WarmForward()
    warm.bound, warm.score_mod, warm.mask_mod, warm.lowered = bound, score_mod, mask_mod, low
    warm.state = low.state if low is not None else ()
    warm.in_place = low.in_place_ids(bound.aux_tensors) if low is not None else frozenset()
    return warm
