"""`generate()`: trace -> IR -> derivative -> CuTeDSL source, packaged for the kernels and the notebook.

`GeneratedMods` is what a kernel compiles against. Its `hash` is the JIT cache key: a sha256 of the graph's
structure (ops, constants, captured-tensor dtypes and ranks, scalar kinds) and the generator version, never of
captured scalar values or tensor data, so a new window size or softcap reuses the compiled kernel.
"""
from __future__ import annotations

import copy
import functools
import hashlib
import html
import linecache
import sys
import types

import torch

from .captures import same_capture
from .derivative import Derivative, differentiate
from .frontend import trace
from .ir import BOOL, FLOAT, INT, KIND_NAMES
from .lower_cute import emit_module
from .lower_torch import Env, clamp_index, evaluate

GENERATOR_VERSION = "4"

_MODULES: dict[str, types.ModuleType] = {}

#: dtype a captured tensor has in the kernel: 64-bit types narrow to 32 bits, bool is stored as uint8.
_KERNEL_DTYPE = {torch.float64: torch.float32, torch.int64: torch.int32, torch.bool: torch.uint8}


def row_major(t: torch.Tensor) -> torch.Tensor:
    """`t` with exactly row-major strides (unit stride on the last mode), copied only when it has other ones.

    `contiguous()` is not enough: torch ignores the strides of size-1 modes, so an expanded (1,) tensor keeps stride
    0 and a (5, 1) transpose keeps (1, 5), while a kernel compiled for a static unit stride reads them wrongly."""
    expected, step = [], 1
    for size in reversed(t.shape):
        expected.append(step)
        step *= max(int(size), 1)
    if tuple(t.stride()) == tuple(reversed(expected)):
        return t
    return t.clone(memory_format=torch.contiguous_format)


class GeneratedMods:
    """Generated CuTeDSL for one (score_mod, mask_mod) pair plus everything a kernel needs to call it.

    Scalars reach the kernel as `Int32` (int), `Float32` (float) and `Int32` 0/1 (bool); `kernel_aux_scalars()`
    builds them. Captured tensors reach it converted by `kernel_aux_tensors()` (see `_KERNEL_DTYPE`).
    """

    def __init__(self, traced, deriv: Derivative, source: str, key: str, names: tuple[str, str], fns: tuple,
                 fastmath: bool):
        self._fns = fns
        self.fastmath = fastmath
        self._scalar_values = [s.value for s in traced.graph.aux_scalars]
        self._traced = traced
        self._graph = traced.graph
        self._deriv = deriv
        self.source = source
        self.hash = key
        self._names = names
        self._kernel_aux = None  # (version counters of the captured tensors, their kernel views)

    @functools.cached_property
    def source_hash(self) -> str:
        """sha256 of the generated text. `hash` names the traced graph and stays put when the code generator's output
        for that graph changes; compiled kernels kept on disk are keyed by this one, so they never outlive the text."""
        return hashlib.sha256(self.source.encode()).hexdigest()

    def refresh(self) -> "GeneratedMods":
        """The mods as they are now: new values of captured numbers without tracing again (same source and hash);
        a full `generate` only if something structural changed (a rebound tensor or function, a baked number, a
        number changing type).
        """
        try:
            if not all(same_capture(read(), value) for read, value in self._traced.watch):
                return generate(*self._fns, fastmath=self.fastmath)
            values = [read() for read in self._traced.scalar_readers]
        except (KeyError, IndexError, ValueError, NameError):  # a slot vanished: trace again
            return generate(*self._fns, fastmath=self.fastmath)
        if not all(type(new) is type(old) for new, old in zip(values, self._scalar_values)):
            return generate(*self._fns, fastmath=self.fastmath)
        if values == self._scalar_values:
            return self
        fresh = copy.copy(self)
        fresh._scalar_values = values
        return fresh

    # -- what the kernels read ------------------------------------------------------------------------------------
    @property
    def has_score_mod(self) -> bool:
        """False when there is no score_mod or it returns the score unchanged."""
        root = self._traced.score_root
        return root is not None and not (self._graph.nodes[root].op == "input")

    @property
    def score_grad_is_identity(self) -> bool:
        """True when d(score_mod)/d(score) is 1 everywhere (an additive bias such as ALiBi): the backward then uses
        dS as it is, and need not keep the pre-mod scores."""
        d = self._deriv.d_score
        if d is None or not self.has_score_mod:
            return False
        node = self._graph.nodes[d]
        return node.op == "input" and node.attr[0] == "grad"

    @property
    def aux_grad_reads_score(self) -> bool:
        """Whether a captured tensor's gradient (its value or where it goes) depends on the score: a weight that
        multiplies the score does, an additive bias does not. When none does, and the score gradient is the identity,
        the backward keeps no pre-mod scores."""
        graph = self._graph

        def is_score(node) -> bool:
            return node.op == "input" and node.attr[0] == "score"

        return any(graph.depends_on(i, is_score)
                   for t in self._deriv.aux_terms for i in (t.value, *graph.nodes[t.load].args))

    @property
    def has_mask_mod(self) -> bool:
        """False when there is no mask_mod or it keeps every position."""
        root = self._traced.mask_root
        return root is not None and not (self._graph.is_const(root) and self._graph.const_value(root) is True)

    @functools.cached_property
    def mask_op_count(self) -> int:
        """Operations (not inputs or constants) in the mask_mod's expression: a measure of how many registers its
        per-element evaluation keeps live, which the kernels' tile choice reads."""
        if not self.has_mask_mod:
            return 0
        return self._graph.op_count(self._traced.mask_root)

    def mask_reads(self, what: str) -> bool:
        """Whether the mask_mod's value depends on `what`: "b", "h", "q_idx", "kv_idx" (its index arguments) or
        "tensor" (a load from a captured tensor). The launchers read it to decide whether a partial block's mask is
        worth storing as bits (`runtime.mask_bits`) and over which batch and head modes it varies."""
        if not self.has_mask_mod:
            return False
        if what == "tensor":
            return self._graph.depends_on(self._traced.mask_root, lambda n: n.op == "load")
        return self._graph.depends_on(self._traced.mask_root, lambda n: n.op == "input" and n.attr[0] == what)

    @property
    def aux_tensors(self) -> list[torch.Tensor]:
        return [t.tensor for t in self._graph.aux_tensors]

    @property
    def mask_aux_tensors(self) -> list[torch.Tensor]:
        """The captured tensors the mask_mod reads (a subset of `aux_tensors`): stored mask bits depend on their
        values only, so an in-place edit of a learnable score bias leaves them valid."""
        if not self.has_mask_mod:
            return []
        slots = {self._graph.nodes[i].attr[0] for i in self._graph.needed([self._traced.mask_root])
                 if self._graph.nodes[i].op == "load"}
        return [t.tensor for i, t in enumerate(self._graph.aux_tensors) if i in slots]

    @property
    def aux_tensor_names(self) -> list[str]:
        return [t.name for t in self._graph.aux_tensors]

    @property
    def aux_requires_grad(self) -> list[bool]:
        return [t.requires_grad for t in self._graph.aux_tensors]

    @property
    def aux_scalars(self) -> list:
        return list(self._scalar_values)

    @property
    def aux_scalar_names(self) -> list[str]:
        return [s.name for s in self._graph.aux_scalars]

    @property
    def aux_scalar_kinds(self) -> list[str]:
        """"int", "float" or "bool" per scalar; the kernel types are Int32, Float32 and Int32 (0/1)."""
        return [KIND_NAMES[s.kind] for s in self._graph.aux_scalars]

    @property
    def baked_scalars(self) -> dict:
        """Captured numbers that steer Python control flow in the mod, compiled in as constants."""
        return dict(self._traced.baked)

    @property
    def user_locations(self) -> list:
        """The user's source lines the generated code came from (`Loc(file, line, function, text)`, trace order,
        no repeats): what the `# function: line` comments in `.source` quote, for viewers that link back."""
        seen, out = set(), []
        for loc in self._graph.locs:
            if loc is not None and loc not in seen:
                seen.add(loc)
                out.append(loc)
        return out

    def kernel_aux_tensors(self) -> list[torch.Tensor]:
        """Captured tensors as the kernel reads them: row-major (`row_major`), 64-bit narrowed to 32,
        bool as uint8, 0-d as (1,).

        Cached until a captured tensor changes in place (its version counter moves): a launch calls this on every
        step, and the int64 range check reads the data back from the GPU, which would stall the host each time.
        (An edit through `.data` bypasses the counter; the forward's `_captured_state` shares that blind spot.)"""
        state = tuple((id(t.tensor), t.tensor._version) for t in self._graph.aux_tensors)
        hit = self._kernel_aux
        if hit is not None and hit[0] == state:
            return list(hit[1])
        out = []
        for t in self._graph.aux_tensors:
            x = t.tensor.detach()
            if x.dtype == torch.int64 and x.numel() and (x.max() >= 2 ** 31 or x.min() < -(2 ** 31)):
                raise ValueError(f"captured tensor '{t.name}' holds values outside Int32; the kernel reads int32")
            x = x.to(_KERNEL_DTYPE.get(x.dtype, x.dtype))
            out.append(row_major(x.reshape(1) if x.dim() == 0 else x))
        self._kernel_aux = (state, tuple(out))
        return out

    def kernel_aux_scalar_values(self, values=None) -> tuple:
        """The scalars as the plain Python numbers a TVM-FFI kernel call takes (int for int/bool, float for float),
        ints range-checked against Int32 (`values` overrides the captured ones, same order)."""
        values = self.aux_scalars if values is None else list(values)
        out = []
        for s, v in zip(self._graph.aux_scalars, values):
            if s.kind == FLOAT:
                out.append(float(v))
            else:
                v = int(v)
                if not -(2 ** 31) <= v < 2 ** 31:
                    raise ValueError(f"captured scalar '{s.name}' = {v} does not fit the kernel's Int32")
                out.append(v)
        return tuple(out)

    def kernel_aux_scalars(self, values=None) -> list:
        """The scalars as CuTeDSL runtime arguments (`values` overrides the captured ones, same order)."""
        from cutlass import Float32, Int32
        return [Float32(v) if s.kind == FLOAT else Int32(v)
                for s, v in zip(self._graph.aux_scalars, self.kernel_aux_scalar_values(values))]

    def module(self) -> types.ModuleType:
        """The generated source, executed once per hash in this process; its functions are `@cute.jit`."""
        mod = _MODULES.get(self.hash)
        if mod is None:
            name = f"flexlab_generated_mods_{self.hash[:16]}"
            filename = f"<{name}>"
            # CuTeDSL re-reads a jit function's source through linecache, so the text must be findable there.
            linecache.cache[filename] = (len(self.source), None, self.source.splitlines(True), filename)
            mod = types.ModuleType(name)
            mod.__file__ = filename
            sys.modules[name] = mod
            exec(compile(self.source, filename, "exec"), mod.__dict__)
            _MODULES[self.hash] = mod
        return mod

    # -- torch evaluator -----------------------------------------------------------------------------------------
    def _env(self, inputs: dict, float_dtype, device, scalars) -> Env:
        return Env(inputs=inputs, scalars=self.aux_scalars if scalars is None else list(scalars),
                   aux_tensors=[t.detach() for t in self.aux_tensors], float_dtype=float_dtype, device=device)

    def evaluate_score_mod(self, score, b, h, q_idx, kv_idx, *, scalars=None) -> torch.Tensor:
        """The IR's score_mod with torch ops; arguments broadcast, floats computed in score's dtype."""
        if self._traced.score_root is None:
            return score
        env = self._env(dict(score=score, b=b, h=h, q_idx=q_idx, kv_idx=kv_idx), score.dtype, score.device, scalars)
        return evaluate(self._graph, [self._traced.score_root], env)[0]

    def evaluate_mask_mod(self, b, h, q_idx, kv_idx, *, scalars=None) -> torch.Tensor:
        device = torch.as_tensor(q_idx).device
        if self._traced.mask_root is None:
            return torch.ones((), dtype=torch.bool, device=device)
        env = self._env(dict(b=b, h=h, q_idx=q_idx, kv_idx=kv_idx), torch.float32, device, scalars)
        return evaluate(self._graph, [self._traced.mask_root], env)[0]

    def evaluate_score_mod_bwd(self, grad, score, b, h, q_idx, kv_idx, *, scalars=None) -> torch.Tensor:
        """grad * d(score_mod)/d(score) from the symbolic derivative."""
        if self._traced.score_root is None:
            return grad
        if self._deriv.d_score is None:
            return torch.zeros_like(torch.broadcast_tensors(grad, score)[0])
        env = self._env(dict(grad=grad, score=score, b=b, h=h, q_idx=q_idx, kv_idx=kv_idx), score.dtype,
                        score.device, scalars)
        return evaluate(self._graph, [self._deriv.d_score], env)[0]

    def evaluate_aux_grads(self, grad, score, b, h, q_idx, kv_idx, *, scalars=None) -> list[torch.Tensor]:
        """Gradients of sum(grad * score_mod) w.r.t. each captured tensor that requires grad (same shapes)."""
        env = self._env(dict(grad=grad, score=score, b=b, h=h, q_idx=q_idx, kv_idx=kv_idx), score.dtype,
                        score.device, scalars)
        slots = [k for k, rg in enumerate(self.aux_requires_grad) if rg]
        out = [torch.zeros(self.aux_tensors[k].shape, dtype=score.dtype, device=score.device) for k in slots]
        for term in self._deriv.aux_terms:
            load = self._graph.nodes[term.load]
            vals = evaluate(self._graph, [term.value, *load.args], env)
            target = out[slots.index(term.aux)]
            if not load.args:
                target += vals[0].sum()
                continue
            value, *idx = torch.broadcast_tensors(*vals)
            idx = tuple(clamp_index(ix, target.shape[d]) for d, ix in enumerate(idx))
            target.index_put_(idx, value.to(target.dtype), accumulate=True)
        return out

    # -- notebook ------------------------------------------------------------------------------------------------
    def _repr_html_(self) -> str:
        title = (f"<div><b>flexlab generated CuTeDSL</b> &middot; score_mod: <code>{html.escape(self._names[0])}"
                 f"</code> &middot; mask_mod: <code>{html.escape(self._names[1])}</code> &middot; key "
                 f"<code>{self.hash[:12]}</code></div>")
        try:
            from pygments import highlight
            from pygments.formatters import HtmlFormatter
            from pygments.lexers import PythonLexer
        except ImportError:
            return title + f"<pre>{html.escape(self.source)}</pre>"
        return title + highlight(self.source, PythonLexer(), HtmlFormatter(noclasses=True, nobackground=True))

    def __repr__(self) -> str:
        return (f"GeneratedMods(score_mod={self._names[0]}, mask_mod={self._names[1]}, hash={self.hash[:12]}, "
                f"aux_tensors={self.aux_tensor_names}, "
                f"aux_scalars={dict(zip(self.aux_scalar_names, self.aux_scalars))})")


def _mod_name(fn) -> str:
    if fn is None:
        return "none"
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def _header(g, key: str, names: tuple[str, str], baked: dict) -> str:
    lines = [f"CuTeDSL for score_mod `{names[0]}` and mask_mod `{names[1]}`, generated by flexlab.codegen "
             f"(generator v{GENERATOR_VERSION}, key {key[:16]}).", "",
             "Element-wise functions inlined by flexlab's attention kernels. b, h, q_idx, kv_idx are Int32; scores",
             "and grads are Float32. aux_tensors / aux_scalars follow the order listed here:"]
    for k, t in enumerate(g.aux_tensors):
        grad = ", requires grad" if t.requires_grad else ""
        lines.append(f"  aux_tensors[{k}]  {t.name}: {str(t.dtype).replace('torch.', '')}, rank {t.rank}{grad}")
    for k, s in enumerate(g.aux_scalars):
        dsl = {FLOAT: "Float32", INT: "Int32", BOOL: "Int32 0/1"}[s.kind]
        lines.append(f"  aux_scalars[{k}]  {s.name}: {KIND_NAMES[s.kind]} ({dsl}, runtime argument)")
    for name, value in sorted(baked.items()):
        lines.append(f"  compiled-in constant {name} = {value!r} (steers Python control flow in the mod)")
    lines.append("Indices into captured tensors are clamped into range, so padded tile positions read valid memory.")
    return "\n".join(lines)


def generate(score_mod=None, mask_mod=None, *, fastmath: bool = False) -> GeneratedMods:
    """Trace `score_mod(score, b, h, q_idx, kv_idx)` and/or `mask_mod(b, h, q_idx, kv_idx)` into CuTeDSL.

    `fastmath=True` lets transcendentals (exp, tanh, log, ...) use approximate hardware instructions: faster inside
    attention, a few ulp less accurate. It is part of the hash.

    Raises `flexlab.errors.UnsupportedModError` naming the op and the user's file:line when something cannot be
    lowered.
    """
    traced = trace(score_mod, mask_mod)
    g = traced.graph
    aux_with_grad = {k for k, t in enumerate(g.aux_tensors) if t.requires_grad}
    deriv = differentiate(g, traced.score_root, aux_with_grad) if traced.score_root is not None \
        else Derivative(None, ())
    roots = {"score_mod": traced.score_root, "mask_mod": traced.mask_root, "score_mod_bwd": deriv.d_score,
             "aux_grad": [(t.load, t.value) for t in deriv.aux_terms]}
    canonical = f"flexlab.codegen v{GENERATOR_VERSION} fastmath={fastmath}\n" + g.canonical_text(roots)
    key = hashlib.sha256(canonical.encode()).hexdigest()
    names = (_mod_name(score_mod), _mod_name(mask_mod))
    source = emit_module(g, traced.score_root, traced.mask_root, deriv, _header(g, key, names, traced.baked),
                         fastmath=fastmath)
    return GeneratedMods(traced, deriv, source, key, names, (score_mod, mask_mod), fastmath)
