"""Code -> mods (both editor forms), errors that point at the user's line, and runs checked against float64."""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from flexlab.gallery import get_variant
from flexlab.jupyter import experiment
from flexlab.jupyter.experiment import CodeError, RunSpec, load_mods, run_experiment

FAST = dict(warmup_ms=1.0, rep_ms=5.0)


def _dense(mask_mod, S, B=1, H=1):
    return create_mask(mask_mod, B, H, S, S, device="cpu")


def test_plain_form_uses_params_as_names():
    code = "def mask_mod(b, h, q_idx, kv_idx):\n    return (q_idx >= kv_idx) & (q_idx - kv_idx < window)\n"
    mods = load_mods(code, params={"window": 5}, Q_LEN=32)
    want = _dense(lambda b, h, q, kv: (q >= kv) & (q - kv < 5), 32)
    assert mods.score_mod is None and torch.equal(_dense(mods.mask_mod, 32), want)


def test_gallery_form_calls_make_with_edited_factory():
    variant = get_variant("sliding_window")
    mods = load_mods(variant.source, params={"window": 7}, variant=variant, Q_LEN=48)
    assert torch.equal(_dense(mods.mask_mod, 48), _dense(lambda b, h, q, kv: (q >= kv) & (q - kv < 7), 48))
    edited = variant.source.replace("q_idx - kv_idx < window", "q_idx - kv_idx < 2 * window")
    assert edited != variant.source
    mods = load_mods(edited, params={"window": 7}, variant=variant, Q_LEN=48)
    assert torch.equal(_dense(mods.mask_mod, 48), _dense(lambda b, h, q, kv: (q >= kv) & (q - kv < 14), 48))


def test_gallery_variant_with_captured_tensor():
    variant = get_variant("document")
    mods = load_mods(variant.source, params={"num_documents": 3}, variant=variant, Q_LEN=40, KV_LEN=40)
    assert "document_id" in mods.tensors and mods.tensors["document_id"].shape == (40,)


def test_env_names_are_visible():
    mods = load_mods("def score_mod(score, b, h, q_idx, kv_idx):\n    return score * scale2\n", env={"scale2": 3.0})
    assert float(mods.score_mod(torch.tensor(2.0), 0, 0, 0, 0)) == 6.0


@pytest.mark.parametrize("code,line,kind", [
    ("x = 1\ndef mask_mod(b, h, q_idx, kv_idx):\n    return q_idx >=\n", 3, "syntax"),
    ("def mask_mod(b, h, q_idx, kv_idx):\n    return q_idx >= kv_idx\nboom = undefined_name + 1\n", 3, "runtime"),
    ("def score_mod(b, h, q_idx, kv_idx):\n    return q_idx\n", 1, "type"),
    ("y = 2\n", None, "missing"),
])
def test_code_errors_point_at_the_line(code, line, kind):
    with pytest.raises(CodeError) as info:
        load_mods(code)
    assert info.value.line == line and info.value.kind == kind
    if line:
        assert info.value.source_line == code.splitlines()[line - 1]


def test_run_checks_against_float64_and_counts_density():
    code = "def mask_mod(b, h, q_idx, kv_idx):\n    return q_idx >= kv_idx\n"
    mods = load_mods(code, Q_LEN=64)
    spec = RunSpec(B=1, H=2, S=64, D=16, dtype="fp32", backends=("reference", "sdpa"), **FAST)
    res = run_experiment(mods, spec)
    assert [r.backend for r in res.rows] == ["reference", "sdpa"]
    for r in res.rows:
        assert r.error is None and r.passed and not r.has_nan and r.rel_l2 < 1e-5 and r.ms > 0
        assert r.first_call_s > 0
    assert res.density == pytest.approx(64 * 65 / 2 / 64 ** 2)
    assert res.flops == pytest.approx(4 * 2 * 64 * 64 * 16 * res.density)
    assert res.rows[0].tflops == pytest.approx(res.flops / (res.rows[0].ms * 1e-3) / 1e12)
    assert res.baseline == "reference" and res.rows[0].speedup == 1.0
    assert res.recompiles["flexlab kernels"] == 0 and res.passed


def test_wrong_backend_output_fails_the_check(monkeypatch):
    real = experiment._prepare

    def broken(backend, q, k, v, mods, block_mask, spec):
        call = real(backend, q, k, v, mods, block_mask, spec)
        return (lambda: call() * 1.05) if backend == "sdpa" else call

    monkeypatch.setattr(experiment, "_prepare", broken)
    mods = load_mods("def mask_mod(b, h, q_idx, kv_idx):\n    return q_idx >= kv_idx\n", Q_LEN=64)
    res = run_experiment(mods, RunSpec(S=64, H=1, D=16, dtype="fp32", backends=("reference", "sdpa"), **FAST))
    assert res.row("reference").passed and not res.row("sdpa").passed
    assert res.row("sdpa").rel_l2 == pytest.approx(0.05, rel=1e-3) and not res.passed


def test_inapplicable_backends_become_rows_with_reasons():
    code = "def score_mod(score, b, h, q_idx, kv_idx):\n    return score + 0.1 * (kv_idx - q_idx)\n"
    mods = load_mods(code, Q_LEN=32)
    res = run_experiment(mods, RunSpec(S=32, H=1, D=16, dtype="bf16", backends=("reference", "sdpa", "cute"),
                                       **FAST))
    assert res.row("reference").passed and res.row("reference").rel_l2 < 1e-2
    assert "n/a" in res.row("sdpa").error and res.row("sdpa").ms is None
    assert res.row("cute").error and res.row("cute").ms is None


def test_spec_validation_names_the_field():
    with pytest.raises(ValueError, match="D must be a positive int"):
        RunSpec(D=0)
    with pytest.raises(ValueError, match="backends must be"):
        RunSpec(backends=("triton",))
    with pytest.raises(ValueError, match="dtype"):
        RunSpec(dtype="int8")


def test_torch_backend_accepts_mods_defined_in_cell_code():
    # torch's flex_attention looks functions up through their __module__: the cell must be a real module.
    variant = get_variant("gemma2_local")
    mods = load_mods(variant.source, params=variant.defaults(), variant=variant, Q_LEN=32)
    res = run_experiment(mods, RunSpec(S=32, H=1, D=16, dtype="fp32", backends=("torch",), **FAST))
    assert res.row("torch").error is None and res.row("torch").passed
