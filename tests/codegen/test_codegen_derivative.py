"""The symbolic backward (score_mod_bwd and captured-tensor gradients) equals torch.autograd on the same mod."""
from __future__ import annotations

import pytest
import torch
from codegen_cases import cases, grid, make_full_bias, make_relative_bias

from flexlab.codegen import generate
from flexlab.gallery import load_gallery

SCORE_CASES = {name: mods[0] for name, mods in cases().items() if mods[0] is not None}


def _autograd(fn, score, upstream, leaves, b, h, q, kv):
    out = torch.as_tensor(fn(score, b, h, q, kv)).expand_as(score)
    if not out.requires_grad:
        return [torch.zeros_like(x) for x in leaves]
    grads = torch.autograd.grad(out, leaves, upstream, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]


@pytest.mark.parametrize("name", sorted(SCORE_CASES))
def test_score_gradient_matches_autograd(name):
    fn = SCORE_CASES[name]
    g = generate(score_mod=fn)
    b, h, q, kv = grid()
    score = (torch.randn(2, 3, 70, 90, dtype=torch.float64) * 4).requires_grad_()
    upstream = torch.randn_like(score)
    (expected,) = _autograd(fn, score, upstream, [score], b, h, q, kv)
    got = g.evaluate_score_mod_bwd(upstream, score.detach(), b, h, q, kv).expand_as(score)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


OP_CASES = {
    "exp_log": lambda s, b, h, q, kv: torch.exp(s / 4) * torch.log(s.abs() + 2) + torch.log2(s * s + 1),
    "sqrt_rsqrt": lambda s, b, h, q, kv: torch.sqrt(s.abs() + 1) - torch.rsqrt(s * s + 1),
    "expm1_log1p_exp2": lambda s, b, h, q, kv: torch.expm1(s / 8) + torch.log1p(s.abs()) + torch.exp2(-s.abs()),
    "sigmoid_erf_trig": lambda s, b, h, q, kv: s.sigmoid() * torch.erf(s) + torch.sin(s) * torch.cos(2 * s),
    "div_both_ways": lambda s, b, h, q, kv: s / (q + 1) + (kv + 1) / (s.abs() + 1) + s / (s * s + 1),
    "pow_forms": lambda s, b, h, q, kv: s ** 2 + s ** 3 + (s.abs() + 1) ** 0.5 + (s.abs() + 1) ** (s / 4)
    + 2.0 ** (s / 8) + s ** 1,
    "min_max_clamp": lambda s, b, h, q, kv: torch.minimum(s, s * 0.5) + torch.maximum(s, (q - kv) / 20)
    + s.clamp(-1, 1) + torch.maximum(s, s),
    "where_abs_sign": lambda s, b, h, q, kv: torch.where(q > kv, s.abs(), -s) * torch.sign(s) + torch.floor(s),
    "remainder": lambda s, b, h, q, kv: torch.remainder(s, 1.7) + torch.fmod(s, 0.8)
    + torch.remainder(s, s.abs() / 3 + 1),
    "double_cast": lambda s, b, h, q, kv: s.float().double() * 3 + (q > kv).float() * s,
    "tanh_chain": lambda s, b, h, q, kv: torch.tanh(torch.tanh(s) * 2) * 7,
    "more_transcendentals": lambda s, b, h, q, kv: torch.tan(s / 4) * torch.atan(s) + torch.sinh(s / 3)
    - torch.cosh(s / 3) + torch.log10(s.abs() + 1) + torch.atan2(s, q - kv + 0.5) + torch.atan2(s * s + 1, s),
}


@pytest.mark.parametrize("name", sorted(OP_CASES))
def test_chain_rule_per_op_matches_autograd(name):
    fn = OP_CASES[name]
    g = generate(score_mod=fn)
    b, h, q, kv = grid(2, 3, 31, 37)
    score = (torch.randn(2, 3, 31, 37, dtype=torch.float64) * 3).requires_grad_()
    upstream = torch.randn_like(score)
    (expected,) = _autograd(fn, score, upstream, [score], b, h, q, kv)
    got = g.evaluate_score_mod_bwd(upstream, score.detach(), b, h, q, kv).expand_as(score)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


def test_learnable_tables_get_gradients_matching_autograd():
    table = torch.randn(3, 33, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(2, 3, 70, 90, dtype=torch.float64, requires_grad=True)
    rel, full = make_relative_bias(table, 16), make_full_bias(bias)

    def both(score, b, h, q_idx, kv_idx):  # each table read twice, once inside a nonlinearity
        return torch.tanh(rel(score, b, h, q_idx, kv_idx)) * full(score, b, h, q_idx, kv_idx) + table[h, 0]

    g = generate(score_mod=both)
    assert g.aux_requires_grad == [True, True] and g.aux_tensor_names == ["table", "bias"]
    b, h, q, kv = grid()
    score = torch.randn(2, 3, 70, 90, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn_like(score)
    expected = _autograd(both, score, upstream, [score, table, bias], b, h, q, kv)
    got_table, got_bias = g.evaluate_aux_grads(upstream, score.detach(), b, h, q, kv)
    torch.testing.assert_close(got_table, expected[1], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got_bias, expected[2], rtol=1e-9, atol=1e-9)
    got_score = g.evaluate_score_mod_bwd(upstream, score.detach(), b, h, q, kv)
    torch.testing.assert_close(got_score.expand_as(score), expected[0], rtol=1e-9, atol=1e-9)
    assert g.source.count("    add_aux_grad(") == 3


GALLERY = load_gallery()


@pytest.mark.parametrize("name", sorted(n for n, v in GALLERY.items() if v.kind != "mask"))
def test_gallery_score_mods_backward_matches_autograd(name):
    v = GALLERY[name]
    Q, KV = v.example_lengths
    mods = v.build(B=2, H=3, Q_LEN=Q, KV_LEN=KV)
    leaves = {k: t for k, t in mods.tensors.items() if t.is_floating_point()}
    for t in leaves.values():
        t.requires_grad_(True)
    g = generate(mods.score_mod)
    b, h, q, kv = grid(2, 3, Q, KV)
    score = torch.randn(2, 3, Q, KV, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn_like(score)
    expected = _autograd(mods.score_mod, score, upstream, [score, *leaves.values()], b, h, q, kv)
    got = g.evaluate_score_mod_bwd(upstream, score.detach(), b, h, q, kv).expand_as(score)
    torch.testing.assert_close(got, expected[0], rtol=1e-6, atol=1e-6)
    aux = g.evaluate_aux_grads(upstream, score.detach(), b, h, q, kv)
    assert len(aux) == len(leaves)
    for got_t, want_t in zip(aux, expected[1:]):
        torch.testing.assert_close(got_t, want_t.to(got_t.dtype), rtol=1e-4, atol=1e-4)


def test_aux_grad_reads_score_only_for_weights_that_touch_the_score():
    """An additive learnable bias's gradient is grad itself (the backward then keeps no pre-mod scores); a learnable
    weight multiplying the score needs the score."""
    table = torch.randn(2, 9, requires_grad=True)
    slope = torch.randn(2, requires_grad=True)
    frozen = torch.randn(2)

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, torch.clamp(kv_idx - q_idx, -4, 4) + 4]

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slope[h] * (kv_idx - q_idx)

    def weighted(score, b, h, q_idx, kv_idx):
        return score * slope[h]

    def gated(score, b, h, q_idx, kv_idx):
        return torch.tanh(score) * frozen[h] + table[h, 0]

    assert not generate(rel_bias).aux_grad_reads_score
    assert not generate(alibi).aux_grad_reads_score
    assert generate(weighted).aux_grad_reads_score
    assert not generate(gated).aux_grad_reads_score  # the score's own derivative needs it; the table's does not
