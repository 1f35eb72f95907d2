"""Symbolic reverse-mode derivative of a traced score_mod, built as more nodes in the same graph.

The backward kernel needs `grad * d(score_mod)/d(score)` and, for captured tensors that require grad (learnable
biases), `grad * d(score_mod)/d(captured[idx])` at every index the forward read. One reverse sweep over the IR
gives both: each op contributes its local derivative by the chain rule, following torch's autograd formulas
(including its conventions at ties of minimum/maximum and zero gradients of floor/round/sign), so the result can
be compared with torch.autograd on the evaluator. Forward temporaries are shared nodes, so the generated backward
recomputes only what it needs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .build import Builder
from .ir import FLOAT, Graph

_NON_DIFFERENTIABLE = ("floor", "ceil", "round", "trunc", "sign", "floordiv")


@dataclass(frozen=True)
class AuxGradTerm:
    """`value` (grad times the local derivative) must be added to the captured tensor `aux` at the indices of
    node `load` (the load node's args)."""
    aux: int
    load: int
    value: int


@dataclass(frozen=True)
class Derivative:
    d_score: int | None  # node id of grad * d out / d score, None when the mod does not depend on the score
    aux_terms: tuple[AuxGradTerm, ...]


def _active_nodes(g: Graph, order: list[int], aux_with_grad: set[int]) -> set[int]:
    active: set[int] = set()
    for i in order:
        n = g.nodes[i]
        if n.kind != FLOAT:
            continue
        if n.op == "input" and n.attr[0] == "score":
            active.add(i)
        elif n.op == "load" and n.attr[0] in aux_with_grad:
            active.add(i)
        elif n.op == "cast":  # float -> float (an explicit .float()/.double()) passes gradients through
            if n.args[0] in active:
                active.add(i)
        elif n.op not in _NON_DIFFERENTIABLE and n.op not in ("input", "load", "const", "scalar"):
            if any(a in active for a in n.args):
                active.add(i)
    return active


def differentiate(g: Graph, root: int, aux_with_grad: set[int]) -> Derivative:
    b = Builder(g)
    grad = g.input("grad")
    order = g.needed([root])
    active = _active_nodes(g, order, aux_with_grad)
    adj: dict[int, int] = {root: grad} if root in active else {}
    score = None
    terms = []
    for i in reversed(order):
        if i not in active or i not in adj:
            continue
        n, gi, loc = g.nodes[i], adj[i], g.locs[i]
        if n.op == "input":
            score = gi
            continue
        if n.op == "load":
            terms.append(AuxGradTerm(n.attr[0], i, gi))
            continue
        for arg, contribution in zip(n.args, _local(b, n.op, n.args, i, gi, loc)):
            if contribution is None or arg not in active:
                continue
            adj[arg] = contribution if arg not in adj else b.binary("add", adj[arg], contribution, loc)
    terms.sort(key=lambda t: t.load)
    return Derivative(score, tuple(terms))


def _local(b: Builder, op: str, args: tuple[int, ...], out: int, g: int, loc):
    """Per-operand contributions grad_in = g * d out / d arg (None = no contribution)."""
    mul = lambda x, y: b.binary("mul", x, y, loc)  # noqa: E731
    div = lambda x, y: b.binary("truediv", x, y, loc)  # noqa: E731
    neg = lambda x: b.unary("neg", x, loc)  # noqa: E731
    c = b.const
    x = args[0]
    y = args[1] if len(args) > 1 else None
    if op == "add":
        return g, g
    if op == "sub":
        return g, neg(g)
    if op == "mul":
        return mul(g, y), mul(g, x)
    if op == "truediv":
        return div(g, y), div(mul(neg(g), x), mul(y, y))
    if op == "mod":
        return g, neg(mul(g, b.binary("floordiv", x, y, loc)))
    if op == "fmod":
        return g, neg(mul(g, b.unary("trunc", div(x, y), loc)))
    if op == "pow":
        return _pow(b, x, y, out, g, loc)
    if op in ("minimum", "maximum"):
        loses = "gt" if op == "minimum" else "lt"  # x is not selected when x > y (minimum) / x < y (maximum)
        tie = b.binary("eq", x, y, loc)
        half = mul(g, c(0.5))
        zero = c(0.0)
        gx = b.where(tie, half, b.where(b.binary(loses, x, y, loc), zero, g, loc), loc)
        gy = b.where(tie, half, b.where(b.binary(loses, y, x, loc), zero, g, loc), loc)
        return gx, gy
    if op == "where":
        zero = c(0.0)
        return None, b.where(x, g, zero, loc), b.where(x, zero, g, loc)
    if op == "neg":
        return (neg(g),)
    if op == "cast":
        return (g,)
    if op == "abs":
        return (mul(g, b.unary("sign", x, loc)),)
    if op == "exp":
        return (mul(g, out),)
    if op == "exp2":
        return (mul(g, mul(out, c(math.log(2.0)))),)
    if op == "log":
        return (div(g, x),)
    if op == "log2":
        return (div(g, mul(x, c(math.log(2.0)))),)
    if op == "log1p":
        return (div(g, b.binary("add", x, c(1.0), loc)),)
    if op == "expm1":
        return (mul(g, b.binary("add", out, c(1.0), loc)),)
    if op == "sqrt":
        return (div(g, mul(c(2.0), out)),)
    if op == "rsqrt":
        return (mul(g, mul(c(-0.5), mul(mul(out, out), out))),)
    if op == "tanh":
        return (mul(g, b.binary("sub", c(1.0), mul(out, out), loc)),)
    if op == "sigmoid":
        return (mul(g, mul(b.binary("sub", c(1.0), out, loc), out)),)
    if op == "sin":
        return (mul(g, b.unary("cos", x, loc)),)
    if op == "cos":
        return (mul(g, neg(b.unary("sin", x, loc))),)
    if op == "tan":  # 1 + tan^2
        return (mul(g, b.binary("add", c(1.0), mul(out, out), loc)),)
    if op == "atan":
        return (div(g, b.binary("add", c(1.0), mul(x, x), loc)),)
    if op == "sinh":
        return (mul(g, b.unary("cosh", x, loc)),)
    if op == "cosh":
        return (mul(g, b.unary("sinh", x, loc)),)
    if op == "log10":
        return (div(g, mul(x, c(math.log(10.0)))),)
    if op == "atan2":  # atan2(y, x): d/dy = x / (x^2 + y^2), d/dx = -y / (x^2 + y^2)
        r2 = b.binary("add", mul(x, x), mul(y, y), loc)
        return div(mul(g, y), r2), div(mul(neg(g), x), r2)
    if op == "erf":
        return (mul(g, mul(c(2.0 / math.sqrt(math.pi)), b.unary("exp", neg(mul(x, x)), loc))),)
    raise AssertionError(f"no derivative rule for differentiable op {op!r}")  # pragma: no cover


def _pow(b: Builder, x: int, y: int, out: int, g: int, loc):
    mul = lambda p, q: b.binary("mul", p, q, loc)  # noqa: E731
    zero = b.const(0.0)
    if b.g.is_const(y):
        e = b.g.const_value(y)
        if e == 0:
            return None, None
        if e == 1:
            return g, None
        lower = x if e == 2 else b.binary("pow", x, b.const(float(e - 1)), loc)
        return mul(g, mul(y, lower)), None
    d_base = mul(g, mul(y, b.binary("pow", x, b.binary("sub", y, b.const(1.0), loc), loc)))
    d_base = b.where(b.binary("eq", y, zero, loc), zero, d_base, loc)
    d_exp = mul(g, mul(out, b.unary("log", x, loc)))
    base_zero = b.binary("logical_and", b.binary("eq", x, zero, loc), b.binary("ge", y, zero, loc), loc)
    d_exp = b.where(base_zero, zero, d_exp, loc)
    return d_base, d_exp
