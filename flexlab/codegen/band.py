"""Masks that keep a band of keys per query: `lo(q) <= kv_idx < hi(q)`, with lo and hi affine in q_idx.

Causal (`q_idx >= kv_idx`), sliding windows (`causal & (q_idx - kv_idx < window)`) and their offset forms are
conjunctions of comparisons in which kv_idx appears once with coefficient +1 or -1. Each such comparison bounds kv_idx
from below or above by an expression of q_idx, constants and captured scalars alone, so a kernel can compute one key
range per row and turn it into a word of bits instead of comparing every score (`flexlab.kernels.mask.
apply_band_mask`). `key_band` finds that form in the IR and adds the bounds to the graph as nodes of their own, which
the emitter writes out as the generated `mask_band` function; anything else (disjunctions, gathers, divisions, a
condition on q_idx alone) is not a band and keeps the per-element mask_mod.
"""
from __future__ import annotations

from dataclasses import dataclass

from .ir import BOOL, INT, Graph

# Stand-ins for "no bound" (kernels clamp a row's range to the tile, so any value past every tile works).
NO_LOWER_BOUND = -(1 << 30)
NO_UPPER_BOUND = 1 << 30

_FLIP = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le"}


@dataclass(frozen=True)
class KeyBand:
    """Node ids of the band's bounds in the graph: keys lo <= kv_idx < hi are kept."""
    lo: int
    hi: int


@dataclass(frozen=True)
class _Affine:
    """a_kv * kv_idx + a_q * q_idx + const + sum(coef * scalar node)."""
    a_kv: int
    a_q: int
    const: int
    scalars: tuple[tuple[int, int], ...]  # (scalar node id, coefficient), sorted, no zero coefficients

    def scaled(self, k: int) -> "_Affine":
        return _Affine(k * self.a_kv, k * self.a_q, k * self.const, tuple((s, k * c) for s, c in self.scalars))

    def plus(self, other: "_Affine") -> "_Affine":
        coefs = dict(self.scalars)
        for s, c in other.scalars:
            coefs[s] = coefs.get(s, 0) + c
        return _Affine(self.a_kv + other.a_kv, self.a_q + other.a_q, self.const + other.const,
                       tuple(sorted((s, c) for s, c in coefs.items() if c)))

    @property
    def is_constant(self) -> bool:
        return self.a_kv == 0 and self.a_q == 0 and not self.scalars


def _affine(g: Graph, i: int) -> _Affine | None:
    """The affine form of int node i, or None if it is not affine in kv_idx and q_idx."""
    n = g.nodes[i]
    if n.kind != INT:
        return None
    if n.op == "const":
        return _Affine(0, 0, int(n.attr[0]), ())
    if n.op == "input":
        return {"kv_idx": _Affine(1, 0, 0, ()), "q_idx": _Affine(0, 1, 0, ())}.get(n.attr[0])
    if n.op == "scalar":
        return _Affine(0, 0, 0, ((i, 1),))
    if n.op == "neg":
        a = _affine(g, n.args[0])
        return None if a is None else a.scaled(-1)
    if n.op in ("add", "sub"):
        a, b = _affine(g, n.args[0]), _affine(g, n.args[1])
        if a is None or b is None:
            return None
        return a.plus(b if n.op == "add" else b.scaled(-1))
    if n.op == "mul":
        a, b = _affine(g, n.args[0]), _affine(g, n.args[1])
        if a is None or b is None:
            return None
        if b.is_constant:
            return a.scaled(b.const)
        if a.is_constant:
            return b.scaled(a.const)
    return None


def _conjuncts(g: Graph, i: int) -> list[int]:
    n = g.nodes[i]
    if n.kind == BOOL and n.op in ("logical_and", "bitwise_and"):
        return _conjuncts(g, n.args[0]) + _conjuncts(g, n.args[1])
    return [i]


def _bound(g: Graph, i: int) -> tuple[str, _Affine] | None:
    """("lo", B) for kv_idx >= B or ("hi", B) for kv_idx < B, B free of kv_idx; None if comparison i is neither."""
    n = g.nodes[i]
    if n.op not in _FLIP:
        return None
    lhs, rhs = _affine(g, n.args[0]), _affine(g, n.args[1])
    if lhs is None or rhs is None:
        return None
    diff, op = lhs.plus(rhs.scaled(-1)), n.op  # diff OP 0
    if diff.a_kv == -1:
        diff, op = diff.scaled(-1), _FLIP[op]
    if diff.a_kv != 1:
        return None
    rest = diff.plus(_Affine(-1, 0, 0, ())).scaled(-1)  # kv_idx OP rest
    one = _Affine(0, 0, 1, ())
    return {"lt": ("hi", rest), "le": ("hi", rest.plus(one)), "gt": ("lo", rest.plus(one)), "ge": ("lo", rest)}[op]


def _add_affine(g: Graph, form: _Affine) -> int:
    """Nodes computing `form` (free of kv_idx), written as the user would: q_idx - window + 1."""
    terms = []  # (positive, node)
    if form.a_q:
        q = g.input("q_idx")
        terms.append((form.a_q > 0, q if abs(form.a_q) == 1 else g.add("mul", (q, g.const(abs(form.a_q), INT)), INT)))
    for s, c in form.scalars:
        terms.append((c > 0, s if abs(c) == 1 else g.add("mul", (s, g.const(abs(c), INT)), INT)))
    if form.const or not terms:
        terms.append((form.const >= 0, g.const(abs(form.const), INT)))
    terms.sort(key=lambda t: not t[0])  # a positive term first, when there is one
    positive, out = terms[0]
    if not positive:
        out = g.add("neg", (out,), INT)
    for positive, node in terms[1:]:
        out = g.add("add" if positive else "sub", (out, node), INT)
    return out


def key_band(g: Graph, mask_root: int | None) -> KeyBand | None:
    """The band form of the mask rooted at `mask_root`, its bounds added to `g` (scope "mask_band"), or None."""
    if mask_root is None or g.nodes[mask_root].kind != BOOL:
        return None
    bounds = [_bound(g, c) for c in _conjuncts(g, mask_root)]
    if not bounds or any(b is None for b in bounds):
        return None
    scope, g.scope = g.scope, "mask_band"
    try:
        lo = hi = None
        for side, form in bounds:
            node = _add_affine(g, form)
            if side == "lo":
                lo = node if lo is None else g.add("maximum", (lo, node), INT)
            else:
                hi = node if hi is None else g.add("minimum", (hi, node), INT)
        lo = g.const(NO_LOWER_BOUND, INT) if lo is None else lo
        hi = g.const(NO_UPPER_BOUND, INT) if hi is None else hi
    finally:
        g.scope = scope
    return KeyBand(lo, hi)
