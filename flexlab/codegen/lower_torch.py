"""A torch evaluator for the IR: the same graph the kernels run, computed with torch ops on broadcast tensors.

It exists so tests can check the traced IR against the user's own function on random inputs, on CPU, and so the
derivative can be checked against autograd. Floats run in the dtype the caller picks (float64 for references),
ints in int64; the kernels use Float32 and Int32 (identical results unless an int overflows 32 bits).
Captured-tensor reads wrap negative indices like torch and then clamp into range, exactly as the kernels do on
padded tiles.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .ir import BOOL, FLOAT, INT, Graph

_UNARY = {
    "exp": torch.exp, "exp2": torch.exp2, "log": torch.log, "log2": torch.log2, "log1p": torch.log1p,
    "expm1": torch.expm1, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
    "sin": torch.sin, "cos": torch.cos, "erf": torch.erf, "floor": torch.floor, "ceil": torch.ceil,
    "round": torch.round, "trunc": torch.trunc, "neg": torch.neg, "abs": torch.abs, "sign": torch.sign,
    "logical_not": torch.logical_not, "bitwise_not": torch.bitwise_not,
}
_BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "truediv": torch.true_divide,
    "floordiv": torch.floor_divide, "mod": torch.remainder, "fmod": torch.fmod, "pow": torch.pow,
    "minimum": torch.minimum, "maximum": torch.maximum, "eq": torch.eq, "ne": torch.ne, "lt": torch.lt,
    "le": torch.le, "gt": torch.gt, "ge": torch.ge, "logical_and": torch.logical_and,
    "logical_or": torch.logical_or, "logical_xor": torch.logical_xor, "bitwise_and": torch.bitwise_and,
    "bitwise_or": torch.bitwise_or, "bitwise_xor": torch.bitwise_xor,
    "lshift": torch.bitwise_left_shift, "rshift": torch.bitwise_right_shift,
}


@dataclass
class Env:
    """Values for the graph's leaves. Inputs may have any broadcastable shapes."""
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    scalars: list = field(default_factory=list)
    aux_tensors: list[torch.Tensor] = field(default_factory=list)
    float_dtype: torch.dtype = torch.float32
    device: torch.device | str = "cpu"


def clamp_index(index: torch.Tensor, size: int) -> torch.Tensor:
    """Wrap negative indices like torch, then clamp into [0, size-1] like the kernels do on padded tiles."""
    index = torch.where(index < 0, index + size, index)
    return index.clamp(0, max(size - 1, 0))


def _dtype(kind: str, env: Env) -> torch.dtype:
    return {FLOAT: env.float_dtype, INT: torch.int64, BOOL: torch.bool}[kind]


def _cast(x: torch.Tensor, kind: str, env: Env) -> torch.Tensor:
    if kind == BOOL:
        return x != 0
    return x.to(_dtype(kind, env))


def evaluate(graph: Graph, roots: list[int], env: Env) -> list[torch.Tensor]:
    """Evaluate `roots` (node ids) with torch; returns one tensor per root (broadcast shapes)."""
    vals: dict[int, torch.Tensor] = {}
    for i in graph.needed(roots):
        n = graph.nodes[i]
        a = [vals[j] for j in n.args]
        if n.op == "input":
            vals[i] = _cast(torch.as_tensor(env.inputs[n.attr[0]], device=env.device), n.kind, env)
        elif n.op == "const":
            vals[i] = torch.tensor(n.attr[0], dtype=_dtype(n.kind, env), device=env.device)
        elif n.op == "scalar":
            vals[i] = torch.tensor(env.scalars[n.attr[0]], dtype=_dtype(n.kind, env), device=env.device)
        elif n.op == "cast":
            vals[i] = _cast(a[0], n.kind, env)
        elif n.op == "load":
            t = env.aux_tensors[n.attr[0]]
            if t.dim() == 0:
                vals[i] = _cast(t.to(env.device), n.kind, env)
                continue
            idx = torch.broadcast_tensors(*a)
            idx = tuple(clamp_index(ix.to(t.device), t.shape[d]) for d, ix in enumerate(idx))
            vals[i] = _cast(t[idx].to(env.device), n.kind, env)
        elif n.op == "where":
            vals[i] = torch.where(*a)
        elif n.op in _UNARY:
            vals[i] = _UNARY[n.op](a[0])
        elif n.op in _BINARY:
            vals[i] = _BINARY[n.op](a[0], a[1])
        else:  # pragma: no cover - the op table and the IR are defined together
            raise KeyError(f"evaluator has no rule for op {n.op!r}")
        if vals[i].dtype != _dtype(n.kind, env):
            vals[i] = _cast(vals[i], n.kind, env)
    return [vals[r] for r in roots]


def const_fold(graph: Graph, node: int):
    """Python value of a node that depends on no input, scalar or captured tensor (used for Python `if`)."""
    (v,) = evaluate(graph, [node], Env(float_dtype=torch.float64))
    return v.item()


LN2 = math.log(2.0)
