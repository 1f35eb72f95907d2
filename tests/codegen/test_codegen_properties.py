"""Property tests: random expression trees traced by the generator evaluate exactly like the user's function, and
their symbolic derivatives equal torch.autograd (w.r.t. the score and a captured table)."""
from __future__ import annotations

import torch
from codegen_cases import grid
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flexlab.codegen import generate

SETTINGS = settings(max_examples=150, deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])

INT_LEAVES = st.sampled_from(["q", "kv", "h", "b"]) | st.integers(-5, 9).map(lambda c: ("int", c))
INT_OPS = ["add", "sub", "mul", "floordiv", "mod", "and", "or", "xor", "shl", "shr", "min", "max", "abs"]


def _int_tree(depth):
    if depth == 0:
        return INT_LEAVES
    sub = _int_tree(depth - 1)
    return INT_LEAVES | st.tuples(st.sampled_from(INT_OPS), sub, sub)


def _bool_tree(depth):
    ints = _int_tree(2)
    comparison = st.tuples(st.sampled_from(["lt", "le", "eq", "ne", "gt", "ge"]), ints, ints)
    if depth == 0:
        return comparison
    sub = _bool_tree(depth - 1)
    return comparison | st.tuples(st.sampled_from(["band", "bor", "bxor"]), sub, sub) | \
        st.tuples(st.just("bnot"), sub, sub)


FLOAT_UNARY = ["exp", "exp2", "log", "log2", "log1p", "expm1", "sqrt", "rsqrt", "tanh", "sigmoid", "sin", "cos",
               "erf", "neg", "abs", "square", "floor", "round", "softcap", "tan", "atan", "sinh", "cosh", "log10"]
FLOAT_BINARY = ["add", "sub", "mul", "div", "min", "max", "pow", "atan2"]


def _float_tree(depth):
    leaves = st.just("score") | st.floats(-3, 3, allow_nan=False).map(lambda c: ("float", c)) | \
        _int_tree(1).map(lambda t: ("tofloat", t)) | st.just("table") | st.just("captured")
    if depth == 0:
        return leaves
    sub = _float_tree(depth - 1)
    return leaves | st.tuples(st.sampled_from(FLOAT_UNARY), sub) | \
        st.tuples(st.sampled_from(FLOAT_BINARY), sub, sub) | st.tuples(st.just("where"), _bool_tree(1), sub, sub)


def _ev_int(t, e):
    if isinstance(t, str):
        return e[t]
    if t[0] == "int":
        return t[1]
    op, a, b = t[0], _ev_int(t[1], e), _ev_int(t[2], e)
    if isinstance(a, int) and isinstance(b, int):
        a = e["q"] * 0 + a  # keep one side a tensor so Python's own int math is not what gets tested
    return {
        "add": lambda: a + b, "sub": lambda: a - b, "mul": lambda: a * b,
        "floordiv": lambda: a // (abs(b) + 1), "mod": lambda: a % (abs(b) + 1),
        "and": lambda: a & b, "or": lambda: a | b, "xor": lambda: a ^ b,
        "shl": lambda: a << (abs(b) % 4), "shr": lambda: a >> (abs(b) % 4),
        "min": lambda: torch.minimum(*_both(a, b)),
        "max": lambda: torch.maximum(*_both(a, b)), "abs": lambda: abs(a - b),
    }[op]()


def _both(a, b):
    """torch.minimum/maximum need two tensors: lift a Python int with the other operand's new_full."""
    if isinstance(a, int):
        a = b.new_full((), a) if not isinstance(b, int) else torch.tensor(a)
    if isinstance(b, int):
        b = a.new_full((), b)
    return a, b


def _ev_bool(t, e):
    op = t[0]
    if op in ("band", "bor", "bxor", "bnot"):
        a, b = _ev_bool(t[1], e), _ev_bool(t[2], e)
        return {"band": lambda: a & b, "bor": lambda: a | b, "bxor": lambda: a ^ b, "bnot": lambda: ~a}[op]()
    a, b = _ev_int(t[1], e), _ev_int(t[2], e)
    if isinstance(a, int) and isinstance(b, int):
        a = e["q"] * 0 + a
    if isinstance(a, int):
        a, b = b, a
        op = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le"}.get(op, op)
    return {"lt": lambda: a < b, "le": lambda: a <= b, "eq": lambda: a == b, "ne": lambda: a != b,
            "gt": lambda: a > b, "ge": lambda: a >= b}[op]()


def _ev_float(t, e):
    if t == "score":
        return e["score"]
    if t == "table":
        return e["table"][e["h"], (e["q"] - e["kv"]).abs() % 7]
    if t == "captured":
        return e["cap"] * e["score"]
    if t[0] == "float":
        return e["score"] * 0 + t[1]
    if t[0] == "tofloat":
        x = _ev_int(t[1], e)
        return (e["q"] * 0 + x).float() if isinstance(x, int) else x.float() / 3
    op = t[0]
    if op == "where":
        return torch.where(_ev_bool(t[1], e), _ev_float(t[2], e), _ev_float(t[3], e))
    a = _ev_float(t[1], e)
    if len(t) == 3:
        b = _ev_float(t[2], e)
        return {"add": lambda: a + b, "sub": lambda: a - b, "mul": lambda: a * b,
                "div": lambda: a / (b.abs() + 1), "min": lambda: torch.minimum(a, b),
                "max": lambda: torch.maximum(a, b), "pow": lambda: (a.abs() + 0.5) ** torch.tanh(b),
                "atan2": lambda: torch.atan2(a, b.abs() + 0.1)}[op]()
    safe = lambda x: torch.tanh(x) * 3  # noqa: E731  keeps exp/log arguments in range
    return {
        "exp": lambda: torch.exp(safe(a)), "exp2": lambda: torch.exp2(safe(a)), "log": lambda: torch.log(a.abs() + 1),
        "log2": lambda: torch.log2(a.abs() + 1), "log1p": lambda: torch.log1p(a.abs()),
        "expm1": lambda: torch.expm1(safe(a)), "sqrt": lambda: torch.sqrt(a.abs() + 0.1),
        "rsqrt": lambda: torch.rsqrt(a.abs() + 0.1), "tanh": lambda: torch.tanh(a), "sigmoid": lambda: a.sigmoid(),
        "sin": lambda: torch.sin(a), "cos": lambda: torch.cos(a), "erf": lambda: torch.erf(a), "neg": lambda: -a,
        "abs": lambda: a.abs(), "square": lambda: a * a, "floor": lambda: torch.floor(a),
        "round": lambda: torch.round(a), "softcap": lambda: 5.0 * torch.tanh(a / 5.0),
        "tan": lambda: torch.tan(torch.tanh(a)), "atan": lambda: torch.atan(a), "sinh": lambda: torch.sinh(safe(a)),
        "cosh": lambda: torch.cosh(safe(a)), "log10": lambda: torch.log10(a.abs() + 1),
    }[op]()


def _make_score_mod(tree, table, cap):
    def score_mod(score, b, h, q_idx, kv_idx):
        return _ev_float(tree, dict(score=score, b=b, h=h, q=q_idx, kv=kv_idx, table=table, cap=cap))
    return score_mod


def _make_mask_mod(tree):
    def mask_mod(b, h, q_idx, kv_idx):
        return _ev_bool(tree, dict(b=b, h=h, q=q_idx, kv=kv_idx))
    return mask_mod


@SETTINGS
@given(tree=_float_tree(3), seed=st.integers(0, 2 ** 16))
def test_random_score_mods_evaluate_like_the_user_function(tree, seed):
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(3, 7, generator=gen, dtype=torch.float64)
    fn = _make_score_mod(tree, table, 0.75)
    g = generate(score_mod=fn)
    b, h, q, kv = grid(2, 3, 9, 13)
    for dtype in (torch.float32, torch.float64):
        score = (torch.randn(2, 3, 9, 13, generator=gen) * 3).to(dtype)
        expected = fn(score, b, h, q, kv)
        got = g.evaluate_score_mod(score, b, h, q, kv)
        torch.testing.assert_close(got.expand_as(score).double(), expected.expand_as(score).double(),
                                   rtol=1e-5, atol=1e-5, equal_nan=True)


@SETTINGS
@given(tree=_float_tree(3), seed=st.integers(0, 2 ** 16))
def test_random_score_mod_derivatives_match_autograd(tree, seed):
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(3, 7, generator=gen, dtype=torch.float64).requires_grad_()
    fn = _make_score_mod(tree, table, 0.75)
    g = generate(score_mod=fn)
    b, h, q, kv = grid(2, 3, 9, 13)
    score = (torch.randn(2, 3, 9, 13, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    upstream = torch.randn(2, 3, 9, 13, generator=gen, dtype=torch.float64)
    out = fn(score, b, h, q, kv).expand_as(score)
    wants = [score] + ([table] if g.aux_requires_grad else [])
    if not out.requires_grad:
        expected = [torch.zeros_like(w) for w in wants]
    else:
        expected = torch.autograd.grad(out, wants, upstream, allow_unused=True)
        expected = [torch.zeros_like(w) if e is None else e for e, w in zip(expected, wants)]
    d_score = g.evaluate_score_mod_bwd(upstream, score.detach(), b, h, q, kv).expand_as(score)
    torch.testing.assert_close(d_score.double(), expected[0], rtol=1e-5, atol=1e-5, equal_nan=True)
    if g.aux_requires_grad:
        (d_table,) = g.evaluate_aux_grads(upstream, score.detach(), b, h, q, kv)
        torch.testing.assert_close(d_table, expected[1], rtol=1e-5, atol=1e-5, equal_nan=True)


@SETTINGS
@given(tree=_bool_tree(3))
def test_random_mask_mods_evaluate_like_the_user_function(tree):
    fn = _make_mask_mod(tree)
    g = generate(mask_mod=fn)
    b, h, q, kv = grid(2, 3, 17, 19)
    expected = torch.as_tensor(fn(b, h, q, kv)).expand(2, 3, 17, 19)
    assert torch.equal(g.evaluate_mask_mod(b, h, q, kv).expand(2, 3, 17, 19), expected)
