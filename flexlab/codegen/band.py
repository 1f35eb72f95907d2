"""Masks that keep a band of keys per query: `lo(q) <= kv_idx < hi(q)`, with lo and hi affine in q_idx.

Causal (`q_idx >= kv_idx`), sliding windows (`causal & (q_idx - kv_idx < window)`) and their offset forms are
conjunctions of comparisons in which kv_idx appears once with coefficient +1 or -1. Each such comparison bounds kv_idx
from below or above by an expression of q_idx, constants and captured scalars alone, so a kernel can compute one key
range per row and turn it into a word of bits instead of comparing every score (`flexlab.kernels.mask.
apply_band_mask`). `key_band` finds that form in the IR and adds the bounds to the graph as nodes of their own, which
the emitter writes out as the generated `mask_band` function; `query_band` reads the same bounds by key, for the
backward, whose score rows are keys (`mask_band_by_key`). Anything else (disjunctions, gathers, divisions, a
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
class Band:
    """Node ids of a band's bounds in the graph: lo <= index < hi is kept (keys per query, or queries per key).
    `window`: bounded on both sides (a sliding window), not on one alone (causal)."""
    lo: int
    hi: int
    window: bool = False


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
    """Nodes computing `form`, written as the user would: q_idx - window + 1."""
    terms = []  # (positive, node)
    for name, coef in (("kv_idx", form.a_kv), ("q_idx", form.a_q)):
        if coef:
            x = g.input(name)
            terms.append((coef > 0, x if abs(coef) == 1 else g.add("mul", (x, g.const(abs(coef), INT)), INT)))
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


def _bounds(g: Graph, mask_root: int | None) -> list[tuple[str, _Affine]] | None:
    """The mask's bounds on kv_idx, or None if it is not a conjunction of them."""
    if mask_root is None or g.nodes[mask_root].kind != BOOL:
        return None
    bounds = [_bound(g, c) for c in _conjuncts(g, mask_root)]
    return None if not bounds or any(b is None for b in bounds) else bounds


def _range(g: Graph, lows: list[int], highs: list[int]) -> Band:
    lo = hi = None
    for node in lows:
        lo = node if lo is None else g.add("maximum", (lo, node), INT)
    for node in highs:
        hi = node if hi is None else g.add("minimum", (hi, node), INT)
    window = lo is not None and hi is not None
    lo = g.const(NO_LOWER_BOUND, INT) if lo is None else lo
    hi = g.const(NO_UPPER_BOUND, INT) if hi is None else hi
    return Band(lo, hi, window)


def key_band(g: Graph, mask_root: int | None) -> Band | None:
    """The band form of the mask rooted at `mask_root`, its bounds added to `g` (scope "mask_band"), or None."""
    bounds = _bounds(g, mask_root)
    if bounds is None:
        return None
    scope, g.scope = g.scope, "mask_band"
    try:
        lows = [_add_affine(g, form) for side, form in bounds if side == "lo"]
        highs = [_add_affine(g, form) for side, form in bounds if side == "hi"]
        return _range(g, lows, highs)
    finally:
        g.scope = scope


def query_band(g: Graph, mask_root: int | None) -> Band | None:
    """The same band read the other way, for kernels whose accumulator rows are keys (the backward's S^T): the
    queries q_lo <= q_idx < q_hi that key kv_idx is kept for, as nodes in `g` (scope "mask_band_by_key"); None
    where a bound's q_idx coefficient is not 0, 1 or -1. A bound free of q_idx (kv_idx < 100) keeps a key for every
    query or for none."""
    bounds = _bounds(g, mask_root)
    if bounds is None or any(form.a_q not in (-1, 0, 1) for _, form in bounds):
        return None
    scope, g.scope = g.scope, "mask_band_by_key"
    try:
        lows, highs, key_ok = [], [], None
        one = _Affine(0, 0, 1, ())
        for side, form in bounds:
            rest = _Affine(0, 0, form.const, form.scalars)  # the bound is a_q * q_idx + rest
            kv = _Affine(1, 0, 0, ())
            if form.a_q == 0:  # kv_idx >= rest / kv_idx < rest, whatever the query
                cond = g.add("ge" if side == "lo" else "lt", (g.input("kv_idx"), _add_affine(g, rest)), BOOL)
                key_ok = cond if key_ok is None else g.add("logical_and", (key_ok, cond), BOOL)
            elif (side == "lo") == (form.a_q == 1):  # kv >= q + rest, or kv < -q + rest: q below a limit
                limit = kv.plus(rest.scaled(-1)).plus(one) if side == "lo" else rest.plus(kv.scaled(-1))
                highs.append(_add_affine(g, limit))
            else:  # kv < q + rest, or kv >= -q + rest: q from a limit on
                limit = kv.plus(rest.scaled(-1)).plus(one) if side == "hi" else rest.plus(kv.scaled(-1))
                lows.append(_add_affine(g, limit))
        band = _range(g, lows, highs)
        if key_ok is not None:  # a key no query keeps: an empty range
            band = Band(band.lo, g.add("where", (key_ok, band.hi, g.const(NO_LOWER_BOUND, INT)), INT), band.window)
        return band
    finally:
        g.scope = scope
