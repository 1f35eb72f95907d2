"""Readable CuTeDSL source from the IR: one module with four element-wise `@cute.jit` functions (six for a band mask).

The source is meant to be read (the notebook viewer shows it) and to be inlined by our kernels: one statement per
line, temporaries named after their op, a comment before each group of statements quoting the user's line, and no
Python control flow except the guard around atomics. Every value is Float32, Int32 or Boolean; operands are always
names or literals, so no expression needs parentheses to be read correctly.
"""
from __future__ import annotations

import builtins
import keyword

from .band import key_band, query_band
from .derivative import Derivative
from .ir import BOOL, FLOAT, INT, Graph, float_literal

_BUILTINS = set(dir(builtins))
#: Transcendentals that take CuTeDSL's `fastmath` flag (approximate hardware instructions when enabled).
_FASTMATH = ("exp", "exp2", "log", "log2", "log1p", "expm1", "sqrt", "rsqrt", "tanh", "sin", "cos", "erf", "tan",
             "atan", "sinh", "cosh", "log10")
_DSL_TYPE = {FLOAT: "Float32", INT: "Int32", BOOL: "Boolean"}
_INFIX = {"add": "+", "sub": "-", "mul": "*", "truediv": "/", "eq": "==", "ne": "!=", "lt": "<", "le": "<=",
          "gt": ">", "ge": ">=", "logical_and": "&", "logical_or": "|", "logical_xor": "^", "bitwise_and": "&",
          "bitwise_or": "|", "bitwise_xor": "^", "lshift": "<<", "rshift": ">>"}
_MATH = {"exp": "exp", "exp2": "exp2", "log": "log", "log2": "log2", "log1p": "log1p", "expm1": "expm1",
         "sqrt": "sqrt", "rsqrt": "rsqrt", "tanh": "tanh", "sin": "sin", "cos": "cos", "erf": "erf",
         "floor": "floor", "ceil": "ceil", "round": "roundeven", "trunc": "trunc", "tan": "tan", "atan": "atan",
         "sinh": "sinh", "cosh": "cosh", "log10": "log10"}

SIGNATURES = {
    "score_mod": "score, b, h, q_idx, kv_idx, aux_tensors, aux_scalars",
    "mask_mod": "b, h, q_idx, kv_idx, aux_tensors, aux_scalars",
    "mask_band": "b, h, q_idx, aux_tensors, aux_scalars",
    "mask_band_by_key": "b, h, kv_idx, aux_tensors, aux_scalars",
    "score_mod_bwd": "grad, score, b, h, q_idx, kv_idx, aux_tensors, aux_scalars",
    "score_mod_aux_grad": "grad, score, b, h, q_idx, kv_idx, aux_tensors, aux_scalars, aux_grads",
}
_DOCS = {
    "score_mod": "The user's score_mod on one element: the already-scaled score -> Float32.",
    "mask_mod": "The user's mask_mod on one element: True keeps the position.",
    "mask_band": "The keys mask_mod keeps for query q_idx, lo <= kv_idx < hi, as (lo, hi).",
    "mask_band_by_key": "The queries mask_mod keeps key kv_idx for, lo <= q_idx < hi, as (lo, hi).",
    "score_mod_bwd": "grad * d(score_mod)/d(score) on one element, recomputing the forward temporaries it needs.",
    "score_mod_aux_grad": ("Adds grad * d(score_mod)/d(captured[idx]) into aux_grads (the kernel "
                           "sums runs of adds to one entry per thread, then fp32 atomics, or exact int64 "
                           "fixed-point ones in deterministic mode); callers pass grad = 0 at masked and padded "
                           "positions, which adds nothing."),
}


_AS_REGISTER = '''@cute.jit
def as_register(index):
    """The index as a plain Int32 register value. Kernels derive q_idx/kv_idx from identity-tensor coordinates, and
    CuTeDSL 4.8.1 fails to compile long integer-arithmetic chains on those; a register copy is free after
    register allocation and keeps every mod compilable."""
    reg = cute.make_rmem_tensor(1, Int32)
    reg[0] = index
    return reg[0]'''


def literal(value, kind: str) -> str:
    if kind == BOOL:
        return f"Boolean({bool(value)})"
    if kind == INT:
        return f"Int32({int(value)})"
    text = float_literal(value)
    if text in ("inf", "-inf", "nan"):
        text = {"inf": "math.inf", "-inf": "-math.inf", "nan": "math.nan"}[text]
    return f"Float32({text})"


# Index arguments the kernels only ever pass as >= 0: a gather at one of them needs no negative-index wrap.
_NONNEGATIVE_INPUTS = frozenset(("b", "h", "q_idx", "kv_idx"))


class FunctionEmitter:
    """Emits the body of one generated function; each node becomes at most one named temporary."""

    def __init__(self, graph: Graph, params: tuple[str, ...], forward_nodes: set[int], aux_grad_slot: dict,
                 fastmath: bool = False):
        self.g = graph
        self.fm = ", fastmath=True" if fastmath else ""
        self.params = params
        self.forward_nodes = forward_nodes
        self.aux_grad_slot = aux_grad_slot
        self.lines: list[str] = []
        self.names: dict[int, str] = {}
        self.used: set[str] = set(params) | {"cute", "cutlass", "math", "Float32", "Int32", "Boolean", "Uint8"}
        self.aux_names: dict[int, str] = {}
        self.laundered: set[str] = set()
        self.scalar_names: dict[int, str] = {}
        self.sizes: dict[tuple[int, int], str] = {}
        self.clamped: dict[tuple[int, int, int], str] = {}
        self._last_comment: str | None = None
        self._prologue: list[str] = []

    # -- naming -------------------------------------------------------------------------------------------------
    def fresh(self, base: str) -> str:
        name, k = base, 1
        while name in self.used or keyword.iskeyword(name) or name in _BUILTINS:
            k += 1
            name = f"{base}_{k}"
        self.used.add(name)
        return name

    def aux(self, k: int) -> str:
        if k not in self.aux_names:
            name = self.fresh(_identifier(self.g.aux_tensors[k].name))
            self.aux_names[k] = name
            self._prologue.append(f"{name} = aux_tensors[{k}]")
        return self.aux_names[k]

    def scalar(self, k: int) -> str:
        if k not in self.scalar_names:
            s = self.g.aux_scalars[k]
            name = self.fresh(_identifier(s.name))
            self.scalar_names[k] = name
            if s.kind == BOOL:
                self._prologue.append(f"{name} = Int32(aux_scalars[{k}]) != Int32(0)  # captured bool '{s.name}'")
            else:
                self._prologue.append(f"{name} = {_DSL_TYPE[s.kind]}(aux_scalars[{k}])  # captured '{s.name}'")
        return self.scalar_names[k]

    # -- statements ---------------------------------------------------------------------------------------------
    def comment_for(self, i: int) -> None:
        loc = self.g.locs[i]
        if loc is None:
            return
        text = loc.comment() if i in self.forward_nodes else f"backward of {loc.comment()}"
        if text != self._last_comment:
            self.lines.append(f"# {text}")
            self._last_comment = text

    def stmt(self, i: int, base: str, expr: str) -> str:
        self.comment_for(i)
        name = self.fresh(base)
        self.lines.append(f"{name} = {expr}")
        self.names[i] = name
        return name

    def value(self, i: int) -> str:
        """A name or literal for node i, emitting its statement (and its operands') first."""
        if i in self.names:
            return self.names[i]
        n = self.g.nodes[i]
        if n.op == "const":
            return literal(n.attr[0], n.kind)
        if n.op == "input":
            name = n.attr[0]
            if name in ("q_idx", "kv_idx") and name not in self.laundered:
                self.laundered.add(name)
                self._prologue.append(f"{name} = as_register({name})")
            return name
        if n.op == "scalar":
            return self.scalar(n.attr[0])
        a = [self.value(j) for j in n.args]
        if n.op == "load":
            return self.load(i)
        if n.op == "cast" and n.kind == FLOAT and self.g.nodes[n.args[0]].kind == FLOAT:
            return a[0]  # .float()/.double() of a float: the kernel computes in Float32 either way
        return self.stmt(i, _base_name(n.op, n.kind), self.expr(n.op, n.kind, a, [self.g.nodes[j] for j in n.args]))

    def expr(self, op: str, kind: str, a: list[str], args) -> str:
        T = _DSL_TYPE[kind]
        if op == "truediv" and kind == FLOAT and self.fm:
            # Multiply by the reciprocal: a divisor shared by every element of a tile (a captured scale, a
            # softcap) is then divided once per tile after common-subexpression elimination, not per element.
            return f"{a[0]} * (Float32(1.0) / {a[1]})"
        if op in _INFIX:
            return f"{a[0]} {_INFIX[op]} {a[1]}"
        if op == "floordiv":
            return f"{a[0]} // {a[1]}" if kind == INT else f"cute.math.floor({a[0]} / {a[1]})"
        if op == "mod":  # Python/torch remainder: the sign follows the divisor
            if kind == INT:
                return f"{a[0]} - ({a[0]} // {a[1]}) * {a[1]}"
            return f"{a[0]} - cute.math.floor({a[0]} / {a[1]}) * {a[1]}"
        if op == "fmod":  # C remainder: the sign follows the dividend
            return f"{a[0]} % {a[1]}" if kind == INT else f"cute.math.rem({a[0]}, {a[1]})"
        if op == "pow":
            return _pow_expr(a, args[1], kind, self.fm)
        if op in ("minimum", "maximum"):
            return f"cutlass.{op[:3]}({a[0]}, {a[1]})"
        if op == "atan2":
            return f"cute.math.atan2({a[0]}, {a[1]})"
        if op in _MATH:
            fm = self.fm if op in _FASTMATH else ""
            return f"cute.math.{_MATH[op]}({a[0]}{fm})"
        if op == "sigmoid":
            return f"Float32(1.0) / (Float32(1.0) + cute.math.exp(-{a[0]}{self.fm}))"
        if op == "neg":
            return f"-{a[0]}"
        if op == "abs":
            return f"cute.math.abs({a[0]})" if kind == FLOAT else f"cutlass.max({a[0]}, -{a[0]})"
        if op == "sign":
            one, zero = literal(1, kind), literal(0, kind)
            inner = f"{T}(cutlass.select_({a[0]} < {zero}, -{one}, {a[0]}))"
            return f"{T}(cutlass.select_({a[0]} > {zero}, {one}, {inner}))"
        if op in ("logical_not", "bitwise_not"):
            return f"~{a[0]}"
        if op == "where":
            return f"{T}(cutlass.select_({a[0]}, {a[1]}, {a[2]}))"
        if op == "cast":
            src = args[0].kind
            if kind == BOOL:
                return f"{a[0]} != {literal(0, src)}"
            if src == BOOL:
                return f"{T}(cutlass.select_({a[0]}, {literal(1, kind)}, {literal(0, kind)}))"
            return f"{a[0]}.to({T})"
        raise AssertionError(f"CuTeDSL emitter has no rule for op {op!r}")  # pragma: no cover

    def clamped_indices(self, i: int) -> list[str]:
        """Index expressions of load node i, wrapped like torch and clamped into the tensor's shape."""
        n = self.g.nodes[i]
        t = self.aux(n.attr[0])
        out = []
        for d, j in enumerate(n.args):
            key = (n.attr[0], d, j)
            if key not in self.clamped:
                raw = self.value(j)
                size_key = (n.attr[0], d)
                if size_key not in self.sizes:
                    self.sizes[size_key] = self.fresh(f"{t}_size{d}")
                    self._prologue.append(f"{self.sizes[size_key]} = Int32({t}.shape[{d}])")
                size = self.sizes[size_key]
                self.comment_for(i)
                wrapped = self.fresh(f"{t}_i{d}")
                index_node = self.g.nodes[j]
                if index_node.op == "const":  # a literal index: wrap it here, clamp it in the kernel
                    c = index_node.attr[0]
                    raw = f"{size} - Int32({-c})" if c < 0 else raw
                    self.lines.append(f"{wrapped} = cutlass.max(cutlass.min({raw}, {size} - Int32(1)), Int32(0))")
                elif index_node.op == "input" and index_node.attr[0] in _NONNEGATIVE_INPUTS:
                    # b, h, q_idx, kv_idx are never negative in a kernel, so torch's negative-index wrap is dead
                    # code there: only the clamp remains (padded rows and columns past the sequence)
                    self.lines.append(f"{wrapped} = cutlass.max(cutlass.min({raw}, {size} - Int32(1)), Int32(0))")
                else:
                    self.lines.append(f"{wrapped} = Int32(cutlass.select_({raw} < Int32(0), {raw} + {size}, {raw}))")
                    self.lines.append(f"{wrapped} = cutlass.max(cutlass.min({wrapped}, {size} - Int32(1)), Int32(0))")
                self.clamped[key] = wrapped
            out.append(self.clamped[key])
        return out

    def load(self, i: int) -> str:
        n = self.g.nodes[i]
        t = self.aux(n.attr[0])
        idx = self.clamped_indices(i) if n.args else ["0"]
        element = f"{t}[{', '.join(idx)}]"
        if n.kind == BOOL:
            expr = f"{element}.to(Int32) != Int32(0)"
        else:
            expr = f"{element}.to({_DSL_TYPE[n.kind]})"
        return self.stmt(i, f"{t}_val", expr)

    def atomic_add(self, term, slot: int) -> None:
        value = self.value(term.value)
        load = self.g.nodes[term.load]
        idx = self.clamped_indices(term.load) if load.args else ["0"]
        dst = self.fresh(f"{self.aux(load.attr[0])}_grad")
        self.lines.append(f"{dst} = aux_grads[{slot}]")
        coord = f"({idx[0]},)" if len(idx) == 1 else f"({', '.join(idx)})"
        # masked and padded positions pass 0, which add_aux_grad skips (without a branch here, the index loads of
        # consecutive scores can be issued together)
        self.lines.append(f"add_aux_grad({dst}, {coord}, {value})")

    def body(self) -> list[str]:
        return self._prologue + self.lines


def _pow_expr(a: list[str], exponent, kind: str, fm: str) -> str:
    if exponent.op == "const":
        e = exponent.attr[0]
        if e == 2:
            return f"{a[0]} * {a[0]}"
        if kind == INT:
            return " * ".join([a[0]] * int(e)) if e > 0 else "Int32(1)"
        if e == 0.5:
            return f"cute.math.sqrt({a[0]}{fm})"
    return f"cute.math.pow({a[0]}, {a[1]}{fm})"


def _base_name(op: str, kind: str) -> str:
    if op == "cast":
        return {FLOAT: "as_float", INT: "as_int", BOOL: "as_bool"}[kind]
    return op


def _identifier(name: str) -> str:
    ident = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in name) or "captured"
    return ident if not ident[0].isdigit() else f"c_{ident}"


def emit_function(graph: Graph, fn: str, root: int | tuple | None, default: str, forward_nodes: set[int],
                  aux_terms=(), aux_grad_slot: dict | None = None, fastmath: bool = False) -> str:
    """One generated function returning node `root` (a tuple of nodes: a tuple of values)."""
    params = tuple(p.strip() for p in SIGNATURES[fn].split(","))
    em = FunctionEmitter(graph, params, forward_nodes, aux_grad_slot or {}, fastmath)
    ret = None
    if fn == "score_mod_aux_grad":
        for term in aux_terms:
            em.atomic_add(term, em.aux_grad_slot[term.aux])
    elif isinstance(root, tuple):
        ret = ", ".join(em.value(r) for r in root)
    else:
        ret = default if root is None else em.value(root)
    lines = ["@cute.jit", f"def {fn}({SIGNATURES[fn]}):", f'    """{_DOCS[fn]}"""']
    body = em.body()
    if ret is not None:
        body.append(f"return {ret}")
    elif not body:
        body.append("pass  # no captured tensor of this mod requires grad")
    lines.extend("    " + line for line in body)
    return "\n".join(lines)


#: A mask_mod whose result is a conjunction (`a & b`) of at most this many operations is applied with one select per
#: score. The compiler splits a select on a conjunction into one select per condition; a single select keeps one
#: (`flexlab.kernels.mask.keep_or_neg_inf`): a document mask's partial-block step drops from 863 to 787 SASS
#: instructions in the forward. Disjunctions and larger conjunctions compiled to longer loops or new spills in some
#: gallery variants (tree attention, 2-D neighbourhoods at D=64), so they keep the compiler's form.
ONE_SELECT_MAX_OPS = 12


def one_select(graph: Graph, mask_root: int | None) -> bool:
    """Whether kernels apply this mask with one select per score (`ONE_SELECT_MAX_OPS`)."""
    if mask_root is None:
        return False
    root = graph.nodes[mask_root]
    return (root.kind == BOOL and root.op in ("logical_and", "bitwise_and")
            and graph.op_count(mask_root) <= ONE_SELECT_MAX_OPS)


_ONE_SELECT_NOTE = """# mask_mod is a small conjunction: kernels apply it with one select per score instead of one per condition
# (flexlab.kernels.mask.apply_mask_mod).
mask_mod.one_select = True"""

_BAND_NOTE = """# mask_mod keeps a band of keys per query (flexlab.codegen.band): kernels that read mask_band turn
# each row's key range into a word of bits instead of evaluating mask_mod per score
# (flexlab.kernels.mask.apply_band_mask).
mask_mod.band = mask_band
mask_mod.band_is_window = {window}  # bounded on both sides (a sliding window), not above alone (causal)"""
_BAND_BY_KEY_NOTE = """# ... and the backward, whose score rows are keys, reads the same band by key.
mask_mod.band_by_key = mask_band_by_key"""


def emit_module(graph: Graph, score_root: int | None, mask_root: int | None, deriv: Derivative | None,
                header: str, fastmath: bool = False) -> str:
    forward_nodes = set(graph.needed([score_root, mask_root]))
    band, by_key = key_band(graph, mask_root), query_band(graph, mask_root)
    slots = {}
    for k, t in enumerate(graph.aux_tensors):
        if t.requires_grad:
            slots[k] = len(slots)
    parts = [
        f'"""{header}"""',
        "import math",
        "",
        "import cutlass",
        "import cutlass.cute as cute",
        "from cutlass import Boolean, Float32, Int32",
        *(["", "from flexlab.kernels.bwd_aux_grad import add_aux_grad"] if slots else []),
        "",
        "",
        _AS_REGISTER,
        "",
        "",
        emit_function(graph, "score_mod", score_root, "score", forward_nodes, fastmath=fastmath),
        "",
        "",
        emit_function(graph, "mask_mod", mask_root, "Boolean(True)", forward_nodes, fastmath=fastmath),
        *(["", "", _ONE_SELECT_NOTE] if one_select(graph, mask_root) else []),
        *(["", "", emit_function(graph, "mask_band", (band.lo, band.hi), "", forward_nodes), "", "",
           _BAND_NOTE.format(window=band.window)]
          if band is not None else []),
        *(["", "", emit_function(graph, "mask_band_by_key", (by_key.lo, by_key.hi), "", forward_nodes), "", "",
           _BAND_BY_KEY_NOTE] if by_key is not None else []),
        "",
        "",
        emit_function(graph, "score_mod_bwd", deriv.d_score if deriv else None,
                      "grad" if score_root is None else "Float32(0.0)", forward_nodes, fastmath=fastmath),
        "",
        "",
        emit_function(graph, "score_mod_aux_grad", None, "", forward_nodes,
                      deriv.aux_terms if deriv else (), slots, fastmath=fastmath),
        "",
    ]
    return "\n".join(parts)

