"""Tracing: run the user's score_mod / mask_mod once on proxies and record every torch op into the IR.

Proxies stand in for the 0-d tensors torch's FlexAttention passes (score, b, h, q_idx, kv_idx). Python operators
on them, torch functions (through a TorchFunctionMode, which also sees `captured[h, q_idx]` indexing) and tensor
methods all land in `Tracer.dispatch`, which builds typed nodes and remembers the user's file and line for
comments and error messages. Python control flow on a traced value is an error, except when the value only depends
on captured numbers: those numbers are then baked in as constants and the function is traced again.
"""
from __future__ import annotations

import inspect
import linecache
import os
import sys
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from ..errors import FlexlabTypeError, UnsupportedModError
from .build import Builder, KindError
from .captures import CaptureRewriter
from .ir import BOOL, FLOAT, INT, AuxScalar, AuxTensor, Graph, Loc
from .lower_torch import const_fold

_HERE = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_TORCH_MASK_HELPERS = os.path.join(_TORCH_DIR, "nn", "attention")

_BINARY = {
    "add": "add", "sub": "sub", "subtract": "sub", "mul": "mul", "multiply": "mul", "div": "truediv",
    "divide": "truediv", "true_divide": "truediv", "truediv": "truediv", "floor_divide": "floordiv",
    "floordiv": "floordiv", "remainder": "mod", "mod": "mod", "fmod": "fmod", "pow": "pow",
    "minimum": "minimum", "maximum": "maximum", "fmin": "minimum", "fmax": "maximum", "min": "minimum",
    "max": "maximum", "eq": "eq", "ne": "ne", "not_equal": "ne", "lt": "lt", "less": "lt", "le": "le",
    "less_equal": "le", "gt": "gt", "greater": "gt", "ge": "ge", "greater_equal": "ge",
    "logical_and": "logical_and", "logical_or": "logical_or", "logical_xor": "logical_xor",
    "bitwise_and": "bitwise_and", "and": "bitwise_and", "bitwise_or": "bitwise_or", "or": "bitwise_or",
    "bitwise_xor": "bitwise_xor", "xor": "bitwise_xor", "bitwise_left_shift": "lshift", "lshift": "lshift",
    "bitwise_right_shift": "rshift", "rshift": "rshift", "atan2": "atan2", "arctan2": "atan2",
}
_UNARY = {
    "exp": "exp", "exp2": "exp2", "log": "log", "log2": "log2", "log1p": "log1p", "expm1": "expm1",
    "sqrt": "sqrt", "rsqrt": "rsqrt", "tanh": "tanh", "sigmoid": "sigmoid", "expit": "sigmoid", "sin": "sin",
    "cos": "cos", "erf": "erf", "floor": "floor", "ceil": "ceil", "round": "round", "trunc": "trunc",
    "fix": "trunc", "tan": "tan", "atan": "atan", "arctan": "atan", "sinh": "sinh", "cosh": "cosh",
    "log10": "log10", "neg": "neg", "negative": "neg", "abs": "abs", "absolute": "abs", "sign": "sign",
    "sgn": "sign", "logical_not": "logical_not", "bitwise_not": "bitwise_not", "invert": "bitwise_not",
}
_IDENTITY = ("clone", "detach", "contiguous", "requires_grad_", "cpu", "cuda")
_CREATION = ("new_ones", "new_zeros", "new_full", "new_tensor", "ones_like", "zeros_like", "full_like", "full",
             "tensor", "scalar_tensor", "as_tensor", "ones", "zeros")
_CASTS = {"float": (FLOAT, "float32"), "double": (FLOAT, "float64"), "int": (INT, ""), "long": (INT, ""),
          "short": (INT, ""), "bool": (BOOL, "")}

#: Every op name (torch function, Tensor method or Python operator, without underscores) the tracer accepts.
SUPPORTED_OPS = tuple(sorted(set(_BINARY) | set(_UNARY) | set(_IDENTITY) | set(_CREATION) | set(_CASTS) | {
    "square", "reciprocal", "relu", "clamp", "clip", "clamp_min", "clamp_max", "where", "masked_fill", "to",
    "type", "type_as", "getitem", "rsub"}))


class _Bake(Exception):
    """Raised mid-trace: these captured scalars steer Python control flow, so trace again with them as constants."""

    def __init__(self, slots):
        super().__init__("retrace with baked scalars")
        self.slots = set(slots)


def _kind_of_dtype(dtype: torch.dtype, op: str, loc: Loc | None) -> str:
    if dtype == torch.bool:
        return BOOL
    if dtype in (torch.float32, torch.float64):
        return FLOAT
    if dtype.is_floating_point or dtype.is_complex:
        raise _unsupported(f"cast to {dtype}", loc, "mods compute in float32 (kernel) / the evaluator's dtype; "
                                                     "use .float() instead of low-precision casts")
    return INT


def _width(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "") if dtype in (torch.float32, torch.float64) else "default"


def _unsupported(op: str, loc: Loc | None, hint: str | None) -> UnsupportedModError:
    if loc is None:
        return UnsupportedModError(op, hint=hint)
    return UnsupportedModError(op, loc.file, loc.line, loc.text, hint)


def _user_loc() -> Loc | None:
    """The innermost frame outside this package and torch's internals (torch's mask combinators count as code)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        internal = path.startswith(_HERE) or (path.startswith(_TORCH_DIR) and not path.startswith(_TORCH_MASK_HELPERS))
        if not internal:
            line = frame.f_lineno
            text = linecache.getline(frame.f_code.co_filename, line, frame.f_globals).strip()
            return Loc(frame.f_code.co_filename, line, frame.f_code.co_name, text)
        frame = frame.f_back
    return None


class Proxy:
    """A traced 0-d value. Behaves like the 0-d tensors torch passes to mods, for the ops flexlab can lower."""
    __slots__ = ("_tracer", "_node", "captured")

    def __init__(self, tracer: "Tracer", node: int | None, captured: "CapturedNumber | None" = None):
        self._tracer, self._node, self.captured = tracer, node, captured

    @property
    def node(self) -> int:
        if self._node is None:  # a captured number becomes a kernel argument only once the trace uses it
            self._node = self._tracer.register_scalar(self.captured)
        return self._node

    # -- tensor-like metadata ------------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return {FLOAT: torch.float32, INT: torch.int32, BOOL: torch.bool}[self._tracer.g.kind(self.node)]

    shape = property(lambda self: torch.Size([]))
    ndim = property(lambda self: 0)
    device = property(lambda self: torch.device("cpu"))
    requires_grad = property(lambda self: False)

    def is_floating_point(self) -> bool:
        return self._tracer.g.kind(self.node) == FLOAT

    def dim(self) -> int:
        return 0

    def numel(self) -> int:
        return 1

    def size(self, dim=None):
        if dim is not None:
            raise IndexError(f"dimension {dim} out of range for a 0-d value")
        return torch.Size([])

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        tracer = _find_tracer(args, kwargs)
        return tracer.dispatch(getattr(func, "__name__", str(func)), args, kwargs or {}, _is_method(func))

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: self._tracer.dispatch(name, (self,) + args, kwargs, method=True)

    def __repr__(self) -> str:
        return f"<traced {self._tracer.g.kind(self.node)}-value %{self.node}>"

    __hash__ = object.__hash__

    def __bool__(self):
        return self._tracer.to_python(self, bool, "bool()")

    def __int__(self):
        return self._tracer.to_python(self, int, "int()")

    def __index__(self):
        return self._tracer.to_python(self, int, "index()")

    def __float__(self):
        return self._tracer.to_python(self, float, "float()")

    def __getitem__(self, index):
        raise _unsupported("indexing a traced 0-d value", _user_loc(),
                           "only captured tensors can be indexed, e.g. table[h, q_idx]")


def _make_operator(name: str):
    def op(self, *args):
        return self._tracer.dispatch(name, (self,) + args, {})
    op.__name__ = name
    return op


_IN_PLACE_OPERATORS = ("iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior", "ixor",
                       "ilshift", "irshift")


def _is_in_place(name: str) -> bool:
    if name.startswith("__") and name.endswith("__"):
        return name[2:-2] in _IN_PLACE_OPERATORS
    return name.endswith("_") and not name.startswith("_")


for _name in _IN_PLACE_OPERATORS + (
              "add", "radd", "sub", "rsub", "mul", "rmul", "truediv", "rtruediv", "floordiv", "rfloordiv", "mod",
              "rmod", "pow", "rpow", "eq", "ne", "lt", "le", "gt", "ge", "and", "rand", "or", "ror", "xor", "rxor",
              "lshift", "rlshift", "rshift", "rrshift", "neg", "abs", "invert", "pos", "round", "floor", "ceil",
              "trunc"):
    setattr(Proxy, f"__{_name}__", _make_operator(f"__{_name}__"))


@dataclass(frozen=True)
class CapturedNumber:
    """Where a captured Python number lives (see captures.CaptureRewriter) and its value at trace time."""
    slot: tuple
    name: str
    value: object


class _PartialIndex:
    """`table[h]` of a captured multi-dimensional tensor: waits for the remaining indices."""

    def __init__(self, tracer, tensor, indices):
        self._tracer, self._tensor, self._indices = tracer, tensor, indices

    def __getitem__(self, more):
        more = more if isinstance(more, tuple) else (more,)
        return self._tracer.getitem(self._tensor, self._indices + more)

    def __getattr__(self, name):
        raise _unsupported(f"{name} on a partly indexed captured tensor", _user_loc(),
                           "index every dimension of a captured tensor, e.g. bias[h, q_idx, kv_idx]")


def _find_tracer(args, kwargs) -> "Tracer":
    for a in list(args) + list((kwargs or {}).values()):
        if isinstance(a, Proxy):
            return a._tracer
        if isinstance(a, (tuple, list)):
            for x in a:
                if isinstance(x, Proxy):
                    return x._tracer
    raise RuntimeError("no traced value among the arguments")


def _has_proxy(args, kwargs) -> bool:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, (Proxy, _PartialIndex)):
            return True
        if isinstance(a, (tuple, list)) and any(isinstance(x, (Proxy, _PartialIndex)) for x in a):
            return True
    return False


class _TraceMode(TorchFunctionMode):
    """Routes torch calls that touch a proxy to the tracer; other calls run for real (and are remembered)."""

    def __init__(self, tracer: "Tracer"):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _has_proxy(args, kwargs):
            return self.tracer.dispatch(getattr(func, "__name__", str(func)), args, kwargs, _is_method(func))
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            self.tracer.created[id(out)] = out
        return out


@dataclass
class TraceResult:
    graph: Graph
    score_root: int | None
    mask_root: int | None
    baked: dict  # scalar name -> value that was baked into the code
    scalar_readers: list  # per aux scalar: returns the value its slot holds now
    watch: list  # (reader, traced value) for every other capture: a change there means tracing again


class Tracer:
    def __init__(self, graph: Graph, baked: set):
        self.g = graph
        self.b = Builder(graph)
        self.baked = baked
        self.created: dict[int, torch.Tensor] = {}  # tensors made during the trace: literals, not captures
        self._aux_ids: dict[int, int] = {}
        self._scalars: dict[tuple, Proxy] = {}
        self._scalar_slots: list[tuple] = []
        self.rewriter = CaptureRewriter(self.make_scalar, baked)

    # -- captures ------------------------------------------------------------------------------------------------
    def make_scalar(self, slot, name, value):
        if slot not in self._scalars:
            self._scalars[slot] = Proxy(self, None, CapturedNumber(slot, name, value))
        return self._scalars[slot]

    def register_scalar(self, p: CapturedNumber) -> int:
        kind = BOOL if isinstance(p.value, bool) else INT if isinstance(p.value, int) else FLOAT
        if kind == INT and not -(2 ** 31) <= p.value < 2 ** 31:
            self.baked.add(p.slot)  # cannot be an Int32 kernel argument; retrace with it as a constant
            raise _Bake([p.slot])
        self.g.aux_scalars.append(AuxScalar(p.name, kind, p.value))
        self._scalar_slots.append(p.slot)
        return self.g.add("scalar", (), kind, (len(self.g.aux_scalars) - 1,))

    def aux_index(self, t: torch.Tensor) -> int:
        if id(t) not in self._aux_ids:
            name = self.rewriter.tensor_names.get(id(t), f"aux{len(self.g.aux_tensors)}")
            rg = bool(t.requires_grad and t.is_floating_point())
            self.g.aux_tensors.append(AuxTensor(name, t, rg))
            self._aux_ids[id(t)] = len(self.g.aux_tensors) - 1
        return self._aux_ids[id(t)]

    # -- values ------------------------------------------------------------------------------------------------
    def node_of(self, x, loc: Loc | None, what: str = "value") -> int:
        if isinstance(x, Proxy):
            return x.node
        if isinstance(x, (bool, int, float)):
            try:
                return self.b.const(x)
            except KindError as e:
                raise _unsupported(f"constant {x!r}", loc, str(e)) from None
        if isinstance(x, torch.Tensor):
            kind = _kind_of_dtype(x.dtype, what, loc) if x.dtype != torch.float16 and x.dtype != torch.bfloat16 \
                else FLOAT
            if id(x) in self.created and x.numel() == 1:
                return self.b.const(x.item(), kind)
            if x.dim() == 0:
                return self.b.load(self.aux_index(x), (), kind, loc)
            raise _unsupported(f"captured tensor of shape {tuple(x.shape)} used as a {what}", loc,
                               "index captured tensors with the mod's arguments, e.g. bias[h, q_idx, kv_idx]")
        if isinstance(x, _PartialIndex):
            raise _unsupported("a partly indexed captured tensor", loc,
                               "index every dimension of a captured tensor, e.g. bias[h, q_idx, kv_idx]")
        raise _unsupported(f"{type(x).__name__} operand", loc, "mods may only combine tensors and Python numbers")

    def wrap(self, node: int) -> Proxy:
        return Proxy(self, node)

    def to_python(self, p: Proxy, typ, op: str):
        loc = _user_loc()
        node = p.node
        needed = self.g.needed([node])
        dynamic = [self.g.nodes[i] for i in needed if self.g.nodes[i].op in ("input", "load")]
        if dynamic:
            raise _unsupported(f"Python control flow on a traced value ({op})", loc,
                               "a mod is traced once for all positions; use torch.where(cond, a, b), combine "
                               "boolean tensors with & and | instead of `if`/`and`/`or`, and torch.maximum/"
                               "torch.minimum instead of Python's max/min")
        scalars = [self.g.nodes[i].attr[0] for i in needed if self.g.nodes[i].op == "scalar"]
        if scalars:
            raise _Bake(self._scalar_slots[s] for s in scalars)
        return typ(const_fold(self.g, node))

    # -- ops ---------------------------------------------------------------------------------------------------
    def dispatch(self, name: str, args, kwargs, method: bool = False):
        """Lower one op; `method` says it was called as a Tensor method (self first: x.where(cond, y))."""
        loc = _user_loc()
        try:
            out = self._dispatch(name, tuple(args), dict(kwargs), loc, method)
        except KindError as e:
            raise _unsupported(name.strip("_"), loc, str(e)) from None
        if _is_in_place(name) and args and isinstance(args[0], Proxy) and isinstance(out, Proxy):
            args[0]._node = out.node  # x.mul_(2), x += 1: every alias of x sees the new value, as in torch
            return args[0]
        return out

    def _dispatch(self, name, args, kwargs, loc, method):
        op, flip = _canonical_name(name)
        n = lambda x: self.node_of(x, loc)  # noqa: E731
        if op in _BINARY and op not in ("min", "max") or op in ("min", "max") and len(args) == 2 and not kwargs:
            if len(args) != 2:
                raise _unsupported(op, loc, f"{op} expects two operands here")
            a, b = (args[1], args[0]) if flip else (args[0], args[1])
            if op in ("div", "divide") and kwargs.get("rounding_mode") is not None:
                mode = kwargs.pop("rounding_mode")
                if mode == "floor":
                    return self.wrap(self.b.binary("floordiv", n(a), n(b), loc))
                if mode == "trunc" and FLOAT in (self.g.kind(n(a)), self.g.kind(n(b))):
                    return self.wrap(self.b.unary("trunc", self.b.binary("truediv", n(a), n(b), loc), loc))
                raise _unsupported(f"div(rounding_mode={mode!r})", loc, "use // (floor division) for integers")
            if "alpha" in kwargs and op in ("add", "sub"):
                b = self.wrap(self.b.binary("mul", n(b), n(kwargs.pop("alpha")), loc))
            _reject_kwargs(op, kwargs, loc)
            return self.wrap(self.b.binary(_BINARY[op], n(a), n(b), loc))
        if op == "rsub":
            return self.wrap(self.b.binary("sub", n(args[1]), n(args[0]), loc))
        if op in _UNARY:
            _reject_kwargs(op, kwargs, loc, allowed=("decimals",) if op == "round" else ())
            if kwargs.get("decimals"):
                raise _unsupported("round(decimals=...)", loc, "multiply, round and divide instead")
            return self.wrap(self.b.unary(_UNARY[op], n(args[0]), loc))
        if op == "pos":
            return args[0]
        if op == "square":
            x = n(args[0])
            return self.wrap(self.b.binary("mul", x, x, loc))
        if op == "reciprocal":
            return self.wrap(self.b.binary("truediv", self.b.const(1.0), n(args[0]), loc))
        if op == "relu":
            return self.wrap(self.b.binary("maximum", n(args[0]), self.b.const(0), loc))
        if op in ("clamp", "clip", "clamp_min", "clamp_max"):
            return self.wrap(self._clamp(op, args, kwargs, loc))
        if op == "where":
            if method:  # x.where(condition, other)
                x, cond, other = (list(args) + [kwargs.get("condition"), kwargs.get("other")])[:3]
                return self.wrap(self.b.where(n(cond), n(x), n(other), loc))
            merged = list(args) + [kwargs[k] for k in ("condition", "input", "other") if k in kwargs]
            if len(merged) != 3:
                raise _unsupported("where(cond) with one argument", loc, "use torch.where(cond, a, b)")
            return self.wrap(self.b.where(n(merged[0]), n(merged[1]), n(merged[2]), loc))
        if op == "masked_fill":
            x, mask, value = (list(args) + [kwargs.get("mask"), kwargs.get("value")])[:3]
            return self.wrap(self.b.where(n(mask), n(value), n(x), loc))
        if op in _IDENTITY:
            return self.wrap(n(args[0]))  # a new handle: in-place ops on a clone must not touch the original
        if op in _CASTS:
            kind, width = _CASTS[op]
            return self.wrap(self.b.cast(n(args[0]), kind, loc, width or "default"))
        if op in ("to", "type", "type_as"):
            return self.wrap(self._to(op, args, kwargs, loc))
        if op in _CREATION:
            return self.wrap(self._create(op, args, kwargs, loc))
        if op == "getitem":
            return self.getitem(args[0], args[1] if isinstance(args[1], tuple) else (args[1],))
        if op == "item":
            return self.to_python(args[0], lambda v: v, "item()")
        raise _unsupported(op, loc, "supported ops are listed in flexlab.codegen.SUPPORTED_OPS; "
                                    "express the computation with elementary torch ops and torch.where")

    def _clamp(self, op, args, kwargs, loc):
        x = self.node_of(args[0], loc)
        rest = list(args[1:])
        lo = kwargs.pop("min", rest.pop(0) if rest and op in ("clamp", "clip", "clamp_min") else None)
        hi = kwargs.pop("max", rest.pop(0) if rest and op in ("clamp", "clip", "clamp_max") else None)
        _reject_kwargs(op, kwargs, loc)
        if lo is not None:
            x = self.b.binary("maximum", x, self.node_of(lo, loc), loc)
        if hi is not None:
            x = self.b.binary("minimum", x, self.node_of(hi, loc), loc)
        return x

    def _to(self, op, args, kwargs, loc):
        x = self.node_of(args[0], loc)
        target = kwargs.get("dtype", args[1] if len(args) > 1 else None)
        if isinstance(target, Proxy):
            return self.b.cast(x, self.g.kind(target.node), loc)
        if isinstance(target, torch.Tensor):
            target = target.dtype
        if isinstance(target, torch.dtype):
            return self.b.cast(x, _kind_of_dtype(target, op, loc), loc, _width(target))
        return x  # .to(device) and friends: mods have no device

    def _create(self, op, args, kwargs, loc):
        dtype = kwargs.get("dtype")
        like = args[0] if op.endswith("_like") or op.startswith("new_") else None
        rest = args[1:] if like is not None else args
        if op in ("full", "new_full"):
            value = kwargs.get("fill_value", rest[1] if len(rest) > 1 else None)
        elif op in ("full_like",):
            value = kwargs.get("fill_value", rest[0] if rest else None)
        elif op in ("new_tensor", "tensor", "scalar_tensor", "as_tensor"):
            value = kwargs.get("data", rest[0] if rest else None)
        else:
            value = 1 if "ones" in op else 0
        shape = rest[0] if op in ("full", "new_full", "new_ones", "new_zeros", "ones", "zeros") and rest else ()
        if shape not in ((), [], torch.Size([])):
            raise _unsupported(f"{op} with shape {shape!r}", loc, "mods work on 0-d values; use shape ()")
        node = self.node_of(value, loc)
        if dtype is not None:
            return self.b.cast(node, _kind_of_dtype(dtype, op, loc), loc, _width(dtype))
        if isinstance(like, Proxy):  # new_ones/ones_like & co. keep the dtype of the tensor they start from
            return self.b.cast(node, self.g.kind(like.node), loc)
        return node

    def getitem(self, tensor, index: tuple):
        loc = _user_loc()
        if not isinstance(tensor, torch.Tensor):
            raise _unsupported("indexing a traced value", loc, "only captured tensors can be indexed")
        nodes = []
        for ix in index:
            if isinstance(ix, (slice, type(None), type(Ellipsis))) or (isinstance(ix, torch.Tensor)
                                                                        and id(ix) not in self.created):
                raise _unsupported(f"captured-tensor index {ix!r}", loc,
                                   "index with integers or the mod's int arguments only (gathers, no slices)")
            node = self.node_of(ix, loc, "index")
            if self.g.kind(node) != INT:
                raise _unsupported(f"{'bool' if self.g.kind(node) == BOOL else 'float'} index", loc,
                                   "captured tensors are indexed by integers; cast with .int() or .long()")
            nodes.append(node)
        if len(nodes) > tensor.dim():
            raise _unsupported(f"{len(nodes)} indices into a {tensor.dim()}-d captured tensor", loc, None)
        if len(nodes) < tensor.dim():
            return _PartialIndex(self, tensor, tuple(index))
        kind = BOOL if tensor.dtype == torch.bool else FLOAT if tensor.is_floating_point() else INT
        if tensor.is_complex():
            raise _unsupported("complex captured tensor", loc, None)
        return self.wrap(self.b.load(self.aux_index(tensor), tuple(nodes), kind, loc))


def _canonical_name(name: str) -> tuple[str, bool]:
    """`__radd__` -> ("add", True); `special_expit` -> ("expit", False); `__getitem__` -> ("getitem", False)."""
    if name.startswith("special_"):
        name = name[len("special_"):]
    if name.startswith("__") and name.endswith("__"):
        inner = name[2:-2]
        if inner in _BINARY or inner in _UNARY or inner in ("getitem", "pos", "round", "floor", "ceil", "trunc"):
            return inner, False
        if inner[:1] == "r" and inner[1:] in _BINARY:
            return inner[1:], True
        if inner[:1] == "i" and inner[1:] in _BINARY:
            return inner[1:], False
        return inner, False
    if name.endswith("_") and not name.startswith("_"):  # in-place tensor methods: the result is what matters
        base = name[:-1]
        if base in _BINARY or base in _UNARY or base in ("clamp", "clip", "clamp_min", "clamp_max", "masked_fill"):
            return base, False
    return name, False


def _is_method(func) -> bool:
    name = getattr(func, "__name__", None)
    return name is not None and getattr(torch.Tensor, name, None) is func


def _reject_kwargs(op, kwargs, loc, allowed=()):
    extra = [k for k in kwargs if k not in allowed and k != "out" or (k == "out" and kwargs[k] is not None)]
    if extra:
        raise _unsupported(f"{op}({', '.join(f'{k}=' for k in extra)}...)", loc, "keyword not supported in mods")


def _check_arity(fn, n: int, role: str):
    if not callable(fn):
        raise FlexlabTypeError(f"{role} must be a function, got {type(fn).__name__}")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*range(n))
    except TypeError:
        names = "score, b, h, q_idx, kv_idx" if role == "score_mod" else "b, h, q_idx, kv_idx"
        raise FlexlabTypeError(f"{role} must take {n} positional arguments ({names}); got signature {sig}") \
            from None


def trace(score_mod=None, mask_mod=None, max_retraces: int = 16) -> TraceResult:
    """Trace the mods into one graph (shared captures); retraces while scalars must be baked."""
    if score_mod is not None:
        _check_arity(score_mod, 5, "score_mod")
    if mask_mod is not None:
        _check_arity(mask_mod, 4, "mask_mod")
    baked: set = set()
    for _ in range(max_retraces):
        graph = Graph()
        tracer = Tracer(graph, baked)
        try:
            return _trace_once(tracer, score_mod, mask_mod)
        except _Bake as e:
            baked |= e.slots
    raise UnsupportedModError("Python control flow on captured numbers", hint="too many retraces; simplify "
                              "the Python-level branching on captured values")


def _trace_once(tracer: Tracer, score_mod, mask_mod) -> TraceResult:
    g = tracer.g
    args = [tracer.wrap(g.input(name)) for name in ("score", "b", "h", "q_idx", "kv_idx")]
    score_root = mask_root = None
    with _TraceMode(tracer):
        if score_mod is not None:
            g.scope = "score_mod"
            out = tracer.rewriter.rewrite(score_mod)(*args)
            score_root = tracer.b.cast(_output(tracer, out, "score_mod"), FLOAT)
        if mask_mod is not None:
            g.scope = "mask_mod"
            fresh = [tracer.wrap(g.input(name)) for name in ("b", "h", "q_idx", "kv_idx")]  # in-place ops stay local
            out = tracer.rewriter.rewrite(mask_mod)(*fresh)
            mask_root = tracer.b.cast(_output(tracer, out, "mask_mod"), BOOL)
    g.scope = "score_mod"  # the derivative extends the score_mod
    rw = tracer.rewriter
    readers = [rw.readers[slot] for slot in tracer._scalar_slots]
    return TraceResult(g, score_root, mask_root, dict(rw.baked_values), readers, list(rw.watch))


def _output(tracer: Tracer, out, role: str) -> int:
    if not isinstance(out, (Proxy, torch.Tensor, bool, int, float)):
        raise FlexlabTypeError(f"{role} returned {type(out).__name__}; it must return a 0-d tensor (the traced "
                               f"value) or a Python number")
    return tracer.node_of(out, None, f"{role} result")
