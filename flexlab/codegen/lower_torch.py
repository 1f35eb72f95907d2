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
    "round": torch.round, "trunc": torch.trunc, "tan": torch.tan, "atan": torch.atan, "sinh": torch.sinh,
    "cosh": torch.cosh, "log10": torch.log10, "neg": torch.neg, "abs": torch.abs, "sign": torch.sign,
    "logical_not": torch.logical_not, "bitwise_not": torch.bitwise_not,
}
_BINARY = {
    "atan2": torch.atan2, "add": torch.add, "sub": torch.sub, "mul": torch.mul, "truediv": torch.true_divide,
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


def _promote(vals, weak, args):
    """torch's promotion among operands: weak values (Python numbers) adopt the dtype of strong ones."""
    strong = [vals[j].dtype for j in args if not weak[j]]
    kinds = [vals[j].dtype for j in args]
    if not strong:
        return _widest(kinds), True
    return _widest(strong + [k for k in kinds if _category(k) > max(map(_category, strong))]), False


def _category(dtype: torch.dtype) -> int:
    return 0 if dtype == torch.bool else 2 if dtype.is_floating_point else 1


def _widest(dtypes) -> torch.dtype:
    out = dtypes[0]
    for d in dtypes[1:]:
        out = torch.promote_types(out, d)
    return out


def evaluate(graph: Graph, roots: list[int], env: Env) -> list[torch.Tensor]:
    """Evaluate `roots` (node ids) with torch; returns one tensor per root (broadcast shapes).

    Float precision follows torch: the score is in `env.float_dtype`, ints promoted implicitly become the default
    dtype, explicit .float()/.double() casts are honoured, Python numbers are weak. Ints are int64.
    """
    vals: dict[int, torch.Tensor] = {}
    weak: dict[int, bool] = {}
    dev = env.device
    for i in graph.needed(roots):
        n = graph.nodes[i]
        a = [vals[j] for j in n.args]
        is_weak = False
        if n.op == "input":
            x = torch.as_tensor(env.inputs[n.attr[0]], device=dev)
            x = x.to(env.float_dtype) if n.kind == FLOAT else x.to(torch.int64) if n.kind == INT else x != 0
        elif n.op in ("const", "scalar"):
            value = n.attr[0] if n.op == "const" else env.scalars[n.attr[0]]
            x = torch.tensor(value, dtype={FLOAT: torch.float64, INT: torch.int64, BOOL: torch.bool}[n.kind],
                             device=dev)
            is_weak = True
        elif n.op == "cast":
            src, src_weak = a[0], weak[n.args[0]]
            if n.kind == BOOL:
                x, is_weak = src != 0, src_weak
            elif n.kind == INT:
                x, is_weak = src.to(torch.int64), src_weak
            elif n.attr and n.attr[0] != "default":
                x = src.to(getattr(torch, n.attr[0]))
            elif src.dtype.is_floating_point:
                x, is_weak = src, src_weak
            else:
                x, is_weak = src.to(torch.float64 if src_weak else torch.get_default_dtype()), src_weak
        elif n.op == "load":
            t = env.aux_tensors[n.attr[0]]
            if t.dim() == 0:
                x, is_weak = t.to(dev), True  # a 0-d tensor does not decide the dtype, like in torch
            else:
                idx = torch.broadcast_tensors(*a)
                idx = tuple(clamp_index(ix.to(t.device), t.shape[d]) for d, ix in enumerate(idx))
                x = t[idx].to(dev)
            if n.kind == INT:
                x = x.to(torch.int64)
            elif n.kind == BOOL:
                x = x != 0
        else:
            operands = n.args[1:] if n.op == "where" else n.args
            dtype, is_weak = _promote(vals, weak, operands)
            if n.kind == FLOAT and not dtype.is_floating_point:
                dtype = torch.get_default_dtype()  # only reached by float ops on constant-only operands
            a = [vals[j] if j not in operands or vals[j].dtype == dtype else vals[j].to(dtype) for j in n.args]
            if n.op == "where":
                x = torch.where(*a)
            elif n.op in _UNARY:
                x = _UNARY[n.op](a[0])
            elif n.op in _BINARY:
                x = _BINARY[n.op](a[0], a[1])
            else:  # pragma: no cover - the op table and the IR are defined together
                raise KeyError(f"evaluator has no rule for op {n.op!r}")
        vals[i], weak[i] = x, is_weak
    out = []
    for r in roots:
        x = vals[r]
        if graph.nodes[r].kind == FLOAT and weak[r]:
            x = x.to(env.float_dtype)
        out.append(x)
    return out


def const_fold(graph: Graph, node: int):
    """Python value of a node that depends on no input, scalar or captured tensor (used for Python `if`)."""
    (v,) = evaluate(graph, [node], Env(float_dtype=torch.float64))
    return v.item()


LN2 = math.log(2.0)
