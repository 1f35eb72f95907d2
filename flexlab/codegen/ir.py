"""The small, typed, scalar IR that every mod is traced into.

One `Graph` holds the score_mod, the mask_mod and their derivatives as a DAG of `Node`s in creation order, which is
also a valid topological order. Values have one of three kinds -- float ("f"), int ("i"), bool ("b") -- because the
kernels compute in Float32 / Int32 / Boolean no matter which torch dtypes the user wrote. Operands of every op already
have the op's kind: the tracer inserts explicit `cast` nodes wherever torch would promote implicitly, so the
emitters and the derivative never reason about promotion.

Identical nodes are shared (hash-consing), so a value the user computes twice, or that the backward pass needs
again, is one named temporary in the generated source.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

FLOAT, INT, BOOL = "f", "i", "b"
KIND_NAMES = {FLOAT: "float", INT: "int", BOOL: "bool"}

#: Inputs a mod receives from the kernel, with their kinds. "grad" only exists in backward functions.
INPUT_KINDS = {"score": FLOAT, "b": INT, "h": INT, "q_idx": INT, "kv_idx": INT, "grad": FLOAT}

#: Ops and their arities; the emitters and the evaluator must cover exactly this table.
UNARY_FLOAT_OPS = ("exp", "exp2", "log", "log2", "log1p", "expm1", "sqrt", "rsqrt", "tanh", "sigmoid", "sin",
                   "cos", "erf", "floor", "ceil", "round", "trunc", "tan", "atan", "sinh", "cosh", "log10")
UNARY_OPS = UNARY_FLOAT_OPS + ("neg", "abs", "sign", "logical_not", "bitwise_not")
BINARY_OPS = ("add", "sub", "mul", "truediv", "atan2", "floordiv", "mod", "fmod", "pow", "minimum", "maximum",
              "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_xor",
              "bitwise_and", "bitwise_or", "bitwise_xor", "lshift", "rshift")
COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")
LEAF_OPS = ("input", "const", "scalar")
OTHER_OPS = ("where", "cast", "load")


@dataclass(frozen=True)
class Loc:
    """Where in the user's code a node came from (kept out of the hash: it is documentation, not structure)."""
    file: str
    line: int
    function: str
    text: str

    def comment(self) -> str:
        return f"{self.function}: {self.text.strip()}" if self.text else self.function


@dataclass(frozen=True)
class Node:
    op: str
    args: tuple[int, ...]
    kind: str
    attr: tuple = ()

    def key(self) -> tuple:
        return (self.op, self.args, self.kind, _canonical_attr(self.attr))


def _canonical_attr(attr: tuple) -> tuple:
    # 0.0 and -0.0 compare equal and would otherwise be merged by hash-consing; nan never equals itself.
    out = []
    for a in attr:
        if isinstance(a, float):
            out.append(("float", float_literal(a)))
        else:
            out.append((type(a).__name__, a))
    return tuple(out)


def float_literal(x: float) -> str:
    """A deterministic, round-trippable spelling of a Python float (inf and nan included)."""
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return repr(float(x))


@dataclass
class AuxTensor:
    """A tensor captured by a mod: an extra kernel input. Its data never enters the hash; dtype and rank do."""
    name: str
    tensor: object  # torch.Tensor
    requires_grad: bool

    @property
    def dtype(self):
        return self.tensor.dtype

    @property
    def rank(self) -> int:
        return self.tensor.dim()

    def kind(self) -> str:
        if self.tensor.dtype.is_floating_point:
            return FLOAT
        return BOOL if self.tensor.dtype == _torch_bool() else INT


def _torch_bool():
    import torch
    return torch.bool


@dataclass
class AuxScalar:
    """A Python number captured by a mod and used only arithmetically: a runtime kernel argument."""
    name: str
    kind: str
    value: object


@dataclass
class Graph:
    nodes: list[Node] = field(default_factory=list)
    locs: list[Loc | None] = field(default_factory=list)
    aux_tensors: list[AuxTensor] = field(default_factory=list)
    aux_scalars: list[AuxScalar] = field(default_factory=list)
    #: Which function is being built ("score_mod", "mask_mod"). Ops are shared within a scope only, so each
    #: generated function's comments point at that mod's own lines; leaves are shared by all.
    scope: str = ""
    _index: dict = field(default_factory=dict)

    def add(self, op: str, args: tuple[int, ...], kind: str, attr: tuple = (), loc: Loc | None = None) -> int:
        node = Node(op, tuple(args), kind, tuple(attr))
        key = (node.key(), "" if op in LEAF_OPS else self.scope)
        found = self._index.get(key)
        if found is not None:
            return found
        self.nodes.append(node)
        self.locs.append(loc)
        self._index[key] = len(self.nodes) - 1
        return len(self.nodes) - 1

    def const(self, value, kind: str) -> int:
        value = {FLOAT: float, INT: int, BOOL: bool}[kind](value)
        return self.add("const", (), kind, (value,))

    def input(self, name: str) -> int:
        return self.add("input", (), INPUT_KINDS[name], (name,))

    def kind(self, i: int) -> str:
        return self.nodes[i].kind

    def is_const(self, i: int) -> bool:
        return self.nodes[i].op == "const"

    def const_value(self, i: int):
        return self.nodes[i].attr[0]

    def needed(self, roots) -> list[int]:
        """Ids of every node the given roots depend on, in topological (creation) order."""
        seen: set[int] = set()
        stack = [r for r in roots if r is not None]
        while stack:
            i = stack.pop()
            if i in seen:
                continue
            seen.add(i)
            stack.extend(self.nodes[i].args)
        return sorted(seen)

    def op_count(self, root: int | None) -> int:
        """Operations (not inputs, constants or scalars) that `root` depends on: a measure of how many registers
        evaluating it per element keeps live."""
        return sum(1 for i in self.needed([root]) if self.nodes[i].op not in ("input", "const", "scalar"))

    def depends_on(self, i: int, leaf_pred) -> bool:
        return any(leaf_pred(self.nodes[j]) for j in self.needed([i]))

    def canonical_text(self, roots: dict[str, object]) -> str:
        """Structure-only text of the graph reachable from `roots`: what the cache key is computed from.

        Node ids are renumbered densely over the reachable set, so dead nodes left by tracing never change a hash.
        """
        flat = []
        for name in sorted(roots):
            value = roots[name]
            flat.extend(value if isinstance(value, (list, tuple)) else [value])
        order = self.needed([r for r in _flatten(flat) if r is not None])
        renum = {old: new for new, old in enumerate(order)}
        lines = []
        for old in order:
            n = self.nodes[old]
            args = ",".join(str(renum[a]) for a in n.args)
            lines.append(f"%{renum[old]} = {n.op}[{n.kind}]({args}) {_canonical_attr(n.attr)!r}")
        for name in sorted(roots):
            lines.append(f"out {name} = {_renumber(roots[name], renum)!r}")
        for t in self.aux_tensors:
            lines.append(f"aux_tensor dtype={t.dtype} rank={t.rank} requires_grad={t.requires_grad}")
        for s in self.aux_scalars:
            lines.append(f"aux_scalar kind={s.kind}")
        return "\n".join(lines)


def _flatten(x):
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _flatten(y)
    else:
        yield x


def _renumber(x, renum):
    if isinstance(x, (list, tuple)):
        return tuple(_renumber(y, renum) for y in x)
    if isinstance(x, int) and not isinstance(x, bool):
        return renum[x]
    return x
