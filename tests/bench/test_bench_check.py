"""The benchmark's float64 reference and its pass/fail verdicts."""
import pytest
import torch

import flexlab
from flexlab.bench import check
from flexlab.bench.cases import build_case
from flexlab.testing import TOLERANCES, rel_l2


def _inputs(B, H, S, D, dtype=torch.float64):
    return [torch.randn(B, H, S, D, dtype=dtype) for _ in range(4)]


@pytest.mark.parametrize("variant", ["causal", "alibi_causal", "document", "softcap_causal"])
def test_reference_matches_flexlab_reference_with_gradients(variant, monkeypatch):
    monkeypatch.setattr(check, "ROWS_PER_CHUNK", 48)  # exercise chunked rows and gradient accumulation
    B, H, S, D = 2, 3, 130, 16
    q, k, v, dout = _inputs(B, H, S, D)
    case = build_case(variant, B, H, S, "cpu")
    ref = check.reference(q, k, v, case.score_mod, case.mask_mod, dout)
    assert ref.pairs == [(0, 0), (1, 2)]
    bm = flexlab.create_block_mask(case.mask_mod, None, None, S, S, BLOCK_SIZE=32)
    ql, kl, vl = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = flexlab.flex_attention(ql, kl, vl, case.score_mod, bm, backend="reference")
    out.backward(dout)
    for got, expected in zip((ref.out,) + ref.grads, (out, ql.grad, kl.grad, vl.grad)):
        assert rel_l2(got, torch.stack([expected[b, h] for b, h in ref.pairs])) < 1e-12


def test_compare_passes_a_faithful_bf16_output_and_fails_a_wrong_one():
    B, H, S, D = 1, 2, 96, 32
    q, k, v, _ = _inputs(B, H, S, D)
    case = build_case("causal", B, H, S, "cpu")
    ref = check.reference(q, k, v, None, case.mask_mod)
    bm = flexlab.create_block_mask(case.mask_mod, None, None, S, S, BLOCK_SIZE=32)
    good = flexlab.flex_attention(q, k, v, None, bm, backend="reference").to(torch.bfloat16)
    verdict = check.compare(ref, good, None, torch.bfloat16)
    assert verdict["passed"] and verdict["rel_l2"]["out"] < TOLERANCES[torch.bfloat16]
    dense = flexlab.flex_attention(q, k, v, backend="reference")  # forgot the mask: a different function
    verdict = check.compare(ref, dense, None, torch.bfloat16)
    assert not verdict["passed"] and "above tolerance" in verdict["why"]
    poisoned = good.clone()
    poisoned[0, 0, 5, 0] = float("nan")
    verdict = check.compare(ref, poisoned, None, torch.bfloat16)
    assert not verdict["passed"] and verdict["why"] == "non-finite values"


def test_compare_requires_gradients_on_backward_rows():
    B, H, S, D = 1, 1, 64, 16
    q, k, v, dout = _inputs(B, H, S, D)
    ref = check.reference(q, k, v, None, None, dout)
    verdict = check.compare(ref, ref.out[None], None, torch.float32)
    assert not verdict["passed"] and "no gradients" in verdict["why"]
    wrong_dk = (ref.grads[0][None], 2 * ref.grads[1][None], ref.grads[2][None])
    verdict = check.compare(ref, ref.out[None], wrong_dk, torch.float32)
    assert not verdict["passed"] and verdict["rel_l2"]["dq"] == 0.0 and verdict["rel_l2"]["dk"] > 0.5
