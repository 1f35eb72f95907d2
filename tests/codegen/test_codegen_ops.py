"""Op coverage: each supported op traces, and the IR's torch evaluator equals the user's function on random inputs."""
from __future__ import annotations

import math

import pytest
import torch
from codegen_cases import grid

from flexlab.codegen import generate
from flexlab.errors import UnsupportedModError

TABLE = torch.randn(3, 11)
FLAGS = torch.rand(64) > 0.5
IDS = torch.randint(0, 5, (64,), dtype=torch.int32)
CUBE = torch.randn(2, 3, 64)

SCORE_MODS = {
    "add_sub_mul_div": lambda s, b, h, q, kv: (s + q) * 0.5 - kv / 7 + s / (h + 1),
    "floordiv_mod_int": lambda s, b, h, q, kv: s + (q - kv) // 3 + (q - kv) % 5 + (kv - q) % 7,
    "floordiv_mod_float": lambda s, b, h, q, kv: s // 0.7 + s % 1.3 + torch.fmod(s, 0.9),
    "pow": lambda s, b, h, q, kv: s ** 2 + s.abs() ** 1.5 + torch.pow(s.abs() + 1, 0.5) + 2 ** (s / 4),
    "pow_tensor_exponent": lambda s, b, h, q, kv: (s.abs() + 0.5) ** (s / 3),
    "neg_abs_sign": lambda s, b, h, q, kv: -s + s.abs() + torch.sign(s) + torch.sign(q - kv) + abs(s),
    "exp_family": lambda s, b, h, q, kv: torch.exp(s / 4) + torch.exp2(s / 4) + torch.expm1(s / 4),
    "log_family": lambda s, b, h, q, kv: torch.log(s.abs() + 1) + torch.log2(s.abs() + 1) + torch.log1p(s.abs()),
    "roots": lambda s, b, h, q, kv: torch.sqrt(s.abs()) + torch.rsqrt(s.abs() + 1),
    "tanh_sigmoid": lambda s, b, h, q, kv: torch.tanh(s) + torch.sigmoid(s) + s.sigmoid() * s.tanh(),
    "trig_erf": lambda s, b, h, q, kv: torch.sin(s) + torch.cos(s) + torch.erf(s / 2),
    "more_transcendentals": lambda s, b, h, q, kv: torch.tan(s / 4) + torch.atan(s) + torch.sinh(s / 3)
    + torch.cosh(s / 3) + torch.log10(s.abs() + 1) + torch.atan2(s, q - kv + 0.5) + torch.arctan2(kv, s),
    "rounding": lambda s, b, h, q, kv: torch.floor(s) + torch.ceil(s) + torch.round(s * 2.5) + torch.trunc(s),
    "clamp_clip": lambda s, b, h, q, kv: s.clamp(-1, 1) + torch.clip(s, min=-0.5) + s.clamp(max=0.3),
    "minimum_maximum": lambda s, b, h, q, kv: torch.minimum(s, (q - kv) / 10) + torch.maximum(s, -s / 2),
    "where": lambda s, b, h, q, kv: torch.where(q >= kv, s, -float("inf")),
    "where_scalar_branches": lambda s, b, h, q, kv: s + torch.where(q > kv, 1.5, -2),
    "casts": lambda s, b, h, q, kv: s.int().float() + (s > 0).float() + (q - kv).to(torch.float32) / 3
    + (s * 3).long() + (q > 5).int(),
    "constants_inf": lambda s, b, h, q, kv: torch.where(kv > q + 3, float("-inf"), s) + math.pi,
    "bitwise_int": lambda s, b, h, q, kv: s + ((q & 7) ^ (kv | 2)) + (~q) + (q << 2) + (kv >> 1),
    "gather_2d": lambda s, b, h, q, kv: s + TABLE[h, (q - kv).abs() % 11],
    "gather_chained": lambda s, b, h, q, kv: s + TABLE[h][kv % 11] * CUBE[b, h, q],
    "gather_negative_index": lambda s, b, h, q, kv: s + TABLE[h, -1 - (kv % 4)],
    "gather_bool_int": lambda s, b, h, q, kv: s + FLAGS[q].float() + IDS[kv],
    "square_reciprocal_relu": lambda s, b, h, q, kv: torch.square(s) + torch.reciprocal(s.abs() + 1) + s.relu(),
    "masked_fill": lambda s, b, h, q, kv: s.masked_fill(q < kv, -1e9),
    "where_method": lambda s, b, h, q, kv: s.where(q >= kv, -s) + TABLE[h, kv % 11].where(q > kv, s),
    "tensor_methods": lambda s, b, h, q, kv: s.exp().log1p().mul(2).add(q, alpha=2).sub(1).div(3),
    "in_place_methods": lambda s, b, h, q, kv: s.clone().mul_(2).abs_().clamp_(max=3).add_(kv),
    "python_if_on_constant": lambda s, b, h, q, kv: s * 2 if TABLE.shape[0] == 3 else s,
    "constant_output": lambda s, b, h, q, kv: 1.25,
    "identity": lambda s, b, h, q, kv: s,
}

# Chained indexing only means what it says under torch's vmap; with broadcast index tensors, spell it out.
BROADCAST_REFERENCE = {
    "gather_chained": lambda s, b, h, q, kv: s + TABLE[h, kv % 11] * CUBE[b, h, q],
}

MASK_MODS = {
    "comparisons": lambda b, h, q, kv: (q > kv) | (q == kv + 3) | (q != kv) & (q <= 40) & (kv >= 2) & (kv < 60),
    "logical": lambda b, h, q, kv: torch.logical_xor(torch.logical_and(q > kv, kv > 2),
                                                     torch.logical_or(q < 5, h == 1)),
    "not": lambda b, h, q, kv: ~(q < kv) & torch.logical_not(kv == 3),
    "xor_bool": lambda b, h, q, kv: (q > kv) ^ (h == 0),
    "int_to_bool": lambda b, h, q, kv: ((q - kv) % 3).bool(),
    "float_compare": lambda b, h, q, kv: (q - kv) / 3.0 < 1.5,
    "gather_bool": lambda b, h, q, kv: FLAGS[q] | FLAGS[kv],
    "gather_ids": lambda b, h, q, kv: IDS[q] == IDS[kv],
    "new_ones": lambda b, h, q, kv: b.new_ones((), dtype=torch.bool) & (q >= kv),
    "bitwise_shift_mask": lambda b, h, q, kv: ((q >> 4) == (kv >> 4)) | ((q & 1) == 0),
    "all_true": lambda b, h, q, kv: b.new_ones((), dtype=torch.bool),
}


def _inputs(dtype):
    b, h, q, kv = grid(2, 3, 40, 50)
    score = torch.randn(2, 3, 40, 50, dtype=dtype) * 3
    return score, b, h, q, kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(SCORE_MODS))
def test_score_mod_evaluator_matches_user_function(name, dtype):
    fn = SCORE_MODS[name]
    g = generate(score_mod=fn)
    score, b, h, q, kv = _inputs(dtype)
    expected = torch.as_tensor(BROADCAST_REFERENCE.get(name, fn)(score, b, h, q, kv)).expand_as(score)
    got = g.evaluate_score_mod(score, b, h, q, kv).expand_as(score)
    assert got.dtype == expected.dtype or name == "constant_output"
    torch.testing.assert_close(got.double(), expected.double(), rtol=1e-6, atol=1e-6, equal_nan=True)
    assert not torch.isnan(expected).all()


@pytest.mark.parametrize("name", sorted(MASK_MODS))
def test_mask_mod_evaluator_matches_user_function(name):
    fn = MASK_MODS[name]
    g = generate(mask_mod=fn)
    _, b, h, q, kv = _inputs(torch.float32)
    expected = torch.as_tensor(fn(b, h, q, kv)).expand(2, 3, 40, 50)
    got = g.evaluate_mask_mod(b, h, q, kv).expand(2, 3, 40, 50)
    assert got.dtype == torch.bool and torch.equal(got, expected)


def test_flags_say_when_mods_do_nothing():
    assert not generate(score_mod=SCORE_MODS["identity"]).has_score_mod
    assert not generate(mask_mod=MASK_MODS["all_true"]).has_mask_mod
    g = generate(SCORE_MODS["where"], MASK_MODS["comparisons"])
    assert g.has_score_mod and g.has_mask_mod
    absent = generate()
    assert not absent.has_score_mod and not absent.has_mask_mod
    assert "def score_mod(" in absent.source and "return score" in absent.source
    assert "return Boolean(True)" in absent.source


def test_source_has_one_statement_per_line_and_points_at_user_code():
    g = generate(score_mod=SCORE_MODS["gather_2d"])
    src = g.source
    assert "# <lambda>: \"gather_2d\": lambda s, b, h, q, kv: s + TABLE[h, (q - kv).abs() % 11]," in src
    body = [ln.strip() for ln in src.split("def score_mod(")[1].split("\n\n\n")[0].splitlines()[2:]]
    for line in body:
        assert line.startswith(("#", "return")) or line.count(" = ") == 1, line
    assert "cutlass.min(" in src and "TABLE_size1 - Int32(1)" in src  # indices clamped into the table
    compile(src, "<generated>", "exec")
    (loc,) = g.user_locations
    assert loc.file == __file__ and loc.function == "<lambda>" and "TABLE[h, (q - kv).abs() % 11]" in loc.text


def _line_of(fn) -> int:
    return fn.__code__.co_firstlineno


def test_unsupported_op_names_op_file_and_line():
    def uses_lgamma(score, b, h, q_idx, kv_idx):
        return torch.lgamma(score)
    with pytest.raises(UnsupportedModError) as err:
        generate(score_mod=uses_lgamma)
    e = err.value
    assert e.op == "lgamma" and e.file == __file__ and e.line == _line_of(uses_lgamma) + 1
    assert "torch.lgamma(score)" in str(e) and "hint" in str(e)


def test_python_if_on_traced_value_is_an_error_with_a_hint():
    def branchy(b, h, q_idx, kv_idx):
        if q_idx > kv_idx:
            return q_idx == kv_idx
        return q_idx >= kv_idx
    with pytest.raises(UnsupportedModError) as err:
        generate(mask_mod=branchy)
    assert err.value.line == _line_of(branchy) + 1 and "torch.where" in str(err.value)
    with pytest.raises(UnsupportedModError, match="torch.maximum"):
        generate(score_mod=lambda s, b, h, q, kv: s + max(q, kv))


@pytest.mark.parametrize("body, op", [
    (lambda s, b, h, q, kv: s + TABLE[h, 1:3].sum(), "captured-tensor index"),
    (lambda s, b, h, q, kv: s + TABLE[h, s], "float index"),
    (lambda s, b, h, q, kv: s + TABLE, "captured tensor of shape"),
    (lambda s, b, h, q, kv: s.half(), "half"),
    (lambda s, b, h, q, kv: s + (q << 1.5), "lshift"),
])
def test_more_unsupported_forms(body, op):
    with pytest.raises(UnsupportedModError) as err:
        generate(score_mod=body)
    assert op in str(err.value) and err.value.file == __file__


def test_wrong_arity_return_type_or_object_is_a_type_error():
    with pytest.raises(TypeError, match="score_mod must take 5"):
        generate(score_mod=lambda s, b, h, q: s)
    with pytest.raises(TypeError, match="mask_mod must be a function"):
        generate(mask_mod=3)
    with pytest.raises(TypeError, match="score_mod returned tuple"):
        generate(score_mod=lambda s, b, h, q, kv: (s, s))
    with pytest.raises(TypeError, match="mask_mod returned NoneType"):
        generate(mask_mod=lambda b, h, q, kv: None)


def test_fastmath_is_opt_in_and_part_of_the_hash():
    fn = SCORE_MODS["tanh_sigmoid"]
    exact, fast = generate(fn), generate(fn, fastmath=True)
    assert "fastmath" not in exact.source and "cute.math.tanh(score, fastmath=True)" in fast.source
    assert exact.hash != fast.hash and fast.refresh().hash == fast.hash


def test_indices_past_the_captured_tensor_are_clamped_like_the_kernel():
    ids = torch.arange(10)

    def mod(score, b, h, q_idx, kv_idx):
        return score + ids[q_idx] - ids[kv_idx - 20]

    g = generate(score_mod=mod)
    _, b, h, q, kv = _inputs(torch.float32)  # q up to 39, kv - 20 down to -20: both outside ids
    score = torch.zeros(2, 3, 40, 50)
    got = g.evaluate_score_mod(score, b, h, q, kv)
    wrapped = torch.where(kv - 20 < 0, kv - 20 + 10, kv - 20).clamp(0, 9)  # torch's negative wrap, then clamp
    expected = ids[q.clamp(0, 9)] - ids[wrapped]
    assert torch.equal(got.expand_as(score), expected.float().expand_as(score))
    assert "ids_size0 - Int32(1)" in g.source


def test_in_place_ops_update_every_alias_like_torch():
    def mod(score, b, h, q_idx, kv_idx):
        alias = score
        score.mul_(2)
        copy = score.clone()
        copy += q_idx
        copy.clamp_(max=5.0)
        return alias + copy

    def mask(b, h, q_idx, kv_idx):
        q_idx += 1  # local to this call: the score_mod above never sees it
        return q_idx > kv_idx

    g = generate(mod, mask)
    score, b, h, q, kv = _inputs(torch.float64)
    expected = mod(score.clone(), b, h, q, kv)
    torch.testing.assert_close(g.evaluate_score_mod(score, b, h, q, kv), expected)
    assert torch.equal(g.evaluate_mask_mod(b, h, q, kv), q + 1 > kv)


def test_small_conjunctions_are_marked_for_one_select():
    """Kernels apply a mask marked `one_select` with a single select per score (`kernels.mask.keep_or_neg_inf`);
    only conjunctions of few operations are marked (disjunctions and large masks compiled worse that way)."""
    from flexlab.codegen.lower_cute import ONE_SELECT_MAX_OPS
    ids = torch.arange(64) // 16

    def document(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)

    def prefix_or_causal(b, h, q_idx, kv_idx):
        return (kv_idx < 8) | (q_idx >= kv_idx)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def big_conjunction(b, h, q_idx, kv_idx):
        keep = q_idx >= kv_idx
        for k in range(ONE_SELECT_MAX_OPS):
            keep = keep & (q_idx - kv_idx != k + 3)
        return keep

    marked = {fn.__name__: "mask_mod.one_select = True" in generate(None, fn).source
              for fn in (document, prefix_or_causal, causal, big_conjunction)}
    assert marked == {"document": True, "prefix_or_causal": False, "causal": False, "big_conjunction": False}
    module = generate(None, document).module()
    assert module.mask_mod.one_select is True
