"""Every generated mod, inlined into the probe kernel, compiles to PTX for sm_90a on CPU; on a GPU the probe's
values equal the torch evaluator's (score, mask, backward, captured-tensor gradients)."""
from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("cutlass")

from codegen_cases import cases, make_relative_bias, make_sliding_window, make_softcap  # noqa: E402
from torch.nn.attention.flex_attention import and_masks  # noqa: E402

from flexlab.codegen import generate, probe  # noqa: E402
from flexlab.gallery import load_gallery  # noqa: E402
from flexlab.testing import rel_l2  # noqa: E402

GALLERY = load_gallery()


def _every_op(score, b, h, q_idx, kv_idx):
    """One mod touching every op family, so each emitter rule is compiled at least once."""
    d = q_idx - kv_idx
    ints = d // 3 + d % 5 + torch.fmod(d, 4) + (d << 1) + (d >> 2) + (d & 7) + (d | 1) + (d ^ 2) + (~d) + d.abs() \
        + torch.sign(d) + torch.minimum(d, h) + torch.maximum(d, b) + (d ** 2)
    f = torch.exp(score / 8) + torch.exp2(-score.abs()) + torch.log(score.abs() + 1) + torch.log2(score * score + 1)
    f = f + torch.log1p(score.abs()) + torch.expm1(score / 10) + torch.sqrt(score.abs()) + torch.rsqrt(score.abs() + 1)
    f = f + torch.tanh(score) + torch.sigmoid(score) + torch.sin(score) + torch.cos(score) + torch.erf(score)
    f = f + torch.tan(score / 4) + torch.atan(score) + torch.sinh(score / 3) + torch.cosh(score / 3)
    f = f + torch.log10(score.abs() + 1) + torch.atan2(score, d.float() + 0.5)
    f = f + torch.floor(score) + torch.ceil(score) + torch.round(score) + torch.trunc(score) + score.clamp(-2, 2)
    f = f + score ** 2 + score.abs() ** 1.5 + (score.abs() + 1) ** (score / 9) + torch.sign(score) + score // 0.7
    f = f + score % 1.3 + torch.fmod(score, 0.9) + torch.where(d > 3, score, float("-inf")) + (score * 3).int()
    keep = ((d > 0) & (d < 10)) | ~(d == 3) ^ (q_idx != kv_idx)
    return f + ints + keep.float() + (d != 0).float() / 3


def _all_mods():
    mods = {f"case_{name}": pair for name, pair in cases().items()}
    mods["every_op"] = (_every_op, None)
    for name, v in GALLERY.items():
        m = v.build(B=2, H=3)
        for t in m.tensors.values():  # learnable variants: exercise the gradient atomics too
            if name in ("learnable_relative_bias", "per_head_bias") and t.is_floating_point():
                t.requires_grad_(True)
        mods[f"gallery_{name}"] = (m.score_mod, m.mask_mod)
    return mods


ALL_MODS = _all_mods()


@pytest.mark.parametrize("name", sorted(ALL_MODS))
def test_generated_mod_compiles_for_sm90a(name):
    g = generate(*ALL_MODS[name])
    assert probe.compile_probe(g) is not None


def test_ptx_has_the_mods_inlined_and_fp32_atomics(tmp_path):
    g = generate(make_relative_bias(torch.randn(3, 33, requires_grad=True), 16), make_sliding_window(8))
    compiled = probe.compile_probe(g, f"{probe.COMPILE_OPTIONS} --keep-ptx --dump-dir {tmp_path}")
    ptx = compiled.__ptx__
    assert ".target sm_90a" in ptx
    assert not re.search(r"^\s*call", ptx, re.M)  # every generated function was inlined
    assert "atom.global.add.f32" in ptx


def test_new_scalar_values_reuse_the_compiled_kernel():
    first = generate(make_softcap(20.0), and_masks(make_sliding_window(64)))
    probe.compile_probe(first)
    before = probe.compile_count
    for cap, window in ((5.0, 1), (80.0, 4096)):
        again = generate(make_softcap(cap), and_masks(make_sliding_window(window)))
        assert again.hash == first.hash and again.aux_scalars == [cap, window]
        probe.compile_probe(again)
    assert probe.compile_count == before


def test_long_integer_chain_on_coordinates_compiles():
    """DSL 4.8.1 fails ("Failure while executing pass pipeline") on 10+ chained integer adds applied directly to
    identity-tensor coordinates; the generated code copies q_idx/kv_idx through a register first (as_register)."""
    def chain(score, b, h, q_idx, kv_idx):
        acc = q_idx
        for c in range(1, 13):
            acc = acc + c
        return score + acc
    g = generate(chain)
    assert "q_idx = as_register(q_idx)" in g.source
    probe.compile_probe(g)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(ALL_MODS))
def test_probe_kernel_matches_the_evaluator_on_gpu(name):
    g = generate(*ALL_MODS[name])
    for seqlens in ((70, 90), (129, 33)):  # tails inside tiles: padded positions must read in-bounds memory
        r = probe.run_probe(g, 2, 3, *seqlens, seed=1)
        _check(r, g)


@pytest.mark.gpu
def test_probe_runs_new_scalar_values_without_recompiling():
    g = generate(make_softcap(20.0), make_sliding_window(8))
    probe.compile_probe(g)
    before = probe.compile_count
    for scalars in ([20.0, 8], [3.0, 40], [100.0, 0]):
        r = probe.run_probe(g, 1, 2, 100, 120, scalars=scalars, seed=2)
        _check(r, g)
    assert probe.compile_count == before


@pytest.mark.gpu
def test_fastmath_probe_stays_close_to_the_evaluator():
    g = generate(make_softcap(30.0), fastmath=True)
    assert "fastmath=True" in g.source and g.hash != generate(make_softcap(30.0)).hash
    _check(probe.run_probe(g, 1, 2, 64, 64, seed=3), g, tol=2e-3)


def _check(r, g, tol=2e-5):
    score, ref = r["score"].double(), r["ref_score"].double()
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(score), finite) and torch.equal(torch.isnan(score), torch.isnan(ref))
    infinite = torch.isinf(ref)
    assert torch.equal(score[infinite], ref[infinite])  # -inf stays -inf
    assert rel_l2(score[finite], ref[finite]) < tol
    assert torch.equal(r["keep"], r["ref_keep"])
    dref = r["ref_dscore"].double()
    ok = torch.isfinite(dref)
    assert rel_l2(r["dscore"].double()[ok], dref[ok]) < tol
    for got, want in zip(r["aux_grads"], r["ref_aux_grads"]):
        assert rel_l2(got, want) < 1e-4
    assert len(r["aux_grads"]) == sum(g.aux_requires_grad)
