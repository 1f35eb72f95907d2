"""Typed node construction: torch's promotion rules made explicit as `cast` nodes.

Both the tracer and the derivative build nodes through here, so every op in the graph sees operands of exactly the
kind it computes in. The rules follow torch on 0-d tensors with weak Python scalars: bool < int < float, true
division and transcendental functions always produce float, comparisons and logical ops produce bool.
"""
from __future__ import annotations

from .ir import BOOL, COMPARISONS, FLOAT, INT, UNARY_FLOAT_OPS, Graph, Loc

_RANK = {BOOL: 0, INT: 1, FLOAT: 2}


class KindError(TypeError):
    """An op was applied to kinds torch itself rejects (e.g. a shift of floats); the tracer reports it with a line."""


def promote_kinds(*kinds: str) -> str:
    return max(kinds, key=_RANK.__getitem__)


class Builder:
    def __init__(self, graph: Graph):
        self.g = graph

    # -- leaves -----------------------------------------------------------------------------------------------
    def const(self, value, kind: str | None = None) -> int:
        if kind is None:
            kind = BOOL if isinstance(value, bool) else INT if isinstance(value, int) else FLOAT
        if kind == INT and not -(2 ** 31) <= int(value) < 2 ** 31:
            raise KindError(f"integer constant {value} does not fit the kernel's Int32")
        return self.g.const(value, kind)

    # -- conversions ------------------------------------------------------------------------------------------
    def cast(self, a: int, kind: str, loc: Loc | None = None, width: str = "default") -> int:
        """Convert to `kind`. For floats, `width` records torch's dtype ("default" = implicit promotion, else
        "float32"/"float64" from an explicit cast) so the evaluator reproduces torch's mixed precision; the kernel
        computes every float in Float32 regardless."""
        node = self.g.nodes[a]
        if node.kind == kind:
            if kind != FLOAT or width == "default" or (node.op == "cast" and node.attr == (width,)):
                return a
        if node.op == "const":
            v = node.attr[0]
            if kind == BOOL:
                return self.g.const(v != 0, BOOL)
            if kind == INT:
                return self.const(int(v), INT)  # float -> int truncates toward zero, like torch
            return self.g.const(float(v), FLOAT)
        return self.g.add("cast", (a,), kind, (width,) if kind == FLOAT else (), loc)

    def _promoted(self, args, loc, at_least: str = BOOL):
        kind = promote_kinds(at_least, *(self.g.kind(a) for a in args))
        return kind, tuple(self.cast(a, kind, loc) for a in args)

    # -- ops ----------------------------------------------------------------------------------------------------
    def unary(self, op: str, a: int, loc: Loc | None = None) -> int:
        k = self.g.kind(a)
        if op in UNARY_FLOAT_OPS:
            if op in ("floor", "ceil", "round", "trunc") and k != FLOAT:
                return a  # torch returns integer inputs unchanged
            a = self.cast(a, FLOAT, loc)
            return self.g.add(op, (a,), FLOAT, (), loc)
        if op == "logical_not":
            return self.g.add(op, (self.cast(a, BOOL, loc),), BOOL, (), loc)
        if op == "bitwise_not":
            if k == BOOL:
                return self.g.add("logical_not", (a,), BOOL, (), loc)
            if k == FLOAT:
                raise KindError("bitwise_not is only defined for integer and bool values")
            return self.g.add(op, (a,), INT, (), loc)
        if op in ("neg", "abs", "sign"):
            if k == BOOL:
                if op == "neg":
                    raise KindError("negation of a bool value is not defined; use logical_not or ~")
                a, k = self.cast(a, INT, loc), INT
            if op == "neg" and self.g.nodes[a].op == "neg":
                return self.g.nodes[a].args[0]
            return self.g.add(op, (a,), k, (), loc)
        raise KeyError(op)

    def binary(self, op: str, a: int, b: int, loc: Loc | None = None) -> int:
        ka, kb = self.g.kind(a), self.g.kind(b)
        if op in COMPARISONS:
            _, (a, b) = self._promoted((a, b), loc)
            return self.g.add(op, (a, b), BOOL, (), loc)
        if op in ("logical_and", "logical_or", "logical_xor"):
            a, b = self.cast(a, BOOL, loc), self.cast(b, BOOL, loc)
            if op != "logical_xor":  # and_masks / or_masks start from a constant: fold it away
                neutral = op == "logical_and"
                for x, y in ((a, b), (b, a)):
                    if self.g.is_const(x):
                        return y if self.g.const_value(x) == neutral else x
            return self.g.add(op, (a, b), BOOL, (), loc)
        if op in ("bitwise_and", "bitwise_or", "bitwise_xor"):
            if FLOAT in (ka, kb):
                raise KindError(f"{op} is only defined for integer and bool values")
            if ka == kb == BOOL:
                return self.binary(op.replace("bitwise", "logical"), a, b, loc)
            _, (a, b) = self._promoted((a, b), loc, INT)
            return self.g.add(op, (a, b), INT, (), loc)
        if op in ("lshift", "rshift"):
            if FLOAT in (ka, kb):
                raise KindError(f"{op} is only defined for integer values")
            _, (a, b) = self._promoted((a, b), loc, INT)
            return self.g.add(op, (a, b), INT, (), loc)
        if op in ("truediv", "atan2"):
            _, (a, b) = self._promoted((a, b), loc, FLOAT)
            return self.g.add(op, (a, b), FLOAT, (), loc)
        if op in ("add", "sub", "mul") and ka == kb == BOOL:
            raise KindError(f"{op} of two bool values; cast one with .int() or .float() first")
        if op == "pow" and FLOAT not in (ka, kb) and not (self.g.is_const(b) and self.g.const_value(b) >= 0):
            raise KindError("integer pow needs a constant non-negative exponent; use a float base")
        kind, (a, b) = self._promoted((a, b), loc, INT)
        if op == "mul":
            if self._is_one(a):
                return b
            if self._is_one(b):
                return a
        return self.g.add(op, (a, b), kind, (), loc)

    def where(self, c: int, a: int, b: int, loc: Loc | None = None) -> int:
        c = self.cast(c, BOOL, loc)
        kind, (a, b) = self._promoted((a, b), loc)
        if a == b:
            return a
        return self.g.add("where", (c, a, b), kind, (), loc)

    def load(self, aux: int, indices: tuple[int, ...], kind: str, loc: Loc | None = None) -> int:
        idx = tuple(self.cast(i, INT, loc) for i in indices)
        return self.g.add("load", idx, kind, (aux,), loc)

    def _is_one(self, a: int) -> bool:
        return self.g.is_const(a) and self.g.const_value(a) == 1 and self.g.kind(a) != BOOL
