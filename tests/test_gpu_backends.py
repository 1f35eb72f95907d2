"""On CUDA: torch's compiled flex (Triton) and the reference agree with the float64 truth, forward and backward."""
from __future__ import annotations

import warnings

import pytest
import torch

import flexlab
from flexlab.testing import TOLERANCES, random_qkv, reference, rel_l2
from mod_matrix import MOD_NAMES, make_mods

pytestmark = pytest.mark.gpu


FORWARD_CASES = [(name, torch.bfloat16) for name in MOD_NAMES] + [("alibi_causal", torch.float16)]


@pytest.mark.parametrize("name,dtype", FORWARD_CASES, ids=lambda x: str(x).removeprefix("torch."))
def test_torch_backend_forward(name, dtype):
    B, Hq, Hkv, Sq, Skv, D = 2, 4, 2, 1000, 1000, 64
    score_mod, mask_mod = make_mods(B, Hq, Sq, Skv, device="cuda")[name]
    bm = flexlab.create_block_mask(mask_mod, B, None, Sq, Skv, device="cuda") if mask_mod else None
    q, k, v = random_qkv(B, Hq, Sq, Skv, D, dtype, "cuda", Hkv=Hkv)
    out, lse = flexlab.flex_attention(q, k, v, score_mod, bm, enable_gqa=True, return_lse=True, backend="torch")
    truth, truth_lse = reference(q, k, v, score_mod, bm, enable_gqa=True)
    assert not torch.isnan(out).any()
    assert rel_l2(out, truth) < TOLERANCES[dtype]
    alive = torch.isfinite(truth_lse)
    assert torch.equal(torch.isfinite(lse), alive)
    assert torch.allclose(lse[alive].double(), truth_lse[alive], atol=2e-2, rtol=1e-3)


@pytest.mark.parametrize("name", ["document", "alibi_causal"])
def test_torch_backend_backward(name):
    B, Hq, Hkv, Sq, Skv, D = 1, 4, 2, 700, 700, 64
    score_mod, mask_mod = make_mods(B, Hq, Sq, Skv, device="cuda")[name]
    bm = flexlab.create_block_mask(mask_mod, B, None, Sq, Skv, device="cuda") if mask_mod else None
    q, k, v = random_qkv(B, Hq, Sq, Skv, D, torch.bfloat16, "cuda", Hkv=Hkv, requires_grad=True)
    do = torch.randn(B, Hq, Sq, D, device="cuda", dtype=torch.bfloat16)
    out = flexlab.flex_attention(q, k, v, score_mod, bm, enable_gqa=True, backend="torch")
    grads = torch.autograd.grad(out, (q, k, v), do)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref = flexlab.flex_attention(q64, k64, v64, score_mod, bm, enable_gqa=True, backend="reference")
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    for g, rg, n in zip(grads, ref_grads, "qkv"):
        assert rel_l2(g, rg) < 2e-2, f"d{n}"


def test_many_variants_never_fall_back_silently(monkeypatch):
    """More mod variants than dynamo's default recompile limit (8) still run compiled and correct, or raise — never
    eager, never stale. Half capture their value in a closure, half in a default argument (which dynamo does not
    guard on its own)."""
    q, k, v = random_qkv(1, 2, 256, 256, 64, torch.bfloat16, "cuda")

    def closure_over(i):
        def shifted(score, b, h, q_idx, kv_idx):
            return score + 0.01 * i * (q_idx - kv_idx)
        return shifted

    import torch.nn.attention.flex_attention as torch_flex
    if hasattr(torch_flex, "_WARNINGS_SHOWN"):  # (torch warns once per process: forget earlier tests' warnings)
        monkeypatch.setattr(torch_flex, "_WARNINGS_SHOWN", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(10):
            def by_default(score, b, h, q_idx, kv_idx, i=i):
                return score + 0.01 * i * (q_idx - kv_idx)
            mod = closure_over(i) if i % 2 else by_default
            out = flexlab.flex_attention(q, k, v, mod, backend="torch")
            assert rel_l2(out, reference(q, k, v, mod)[0]) < TOLERANCES[torch.bfloat16], i
    # torch warns when flex_attention runs outside torch.compile (its unfused path): never here
    assert not [w for w in caught if "without torch.compile" in str(w.message)], "a variant ran eagerly"


def test_return_aux_on_the_gpu():
    """`return_aux`: the LSE from flexlab's kernels under `auto`; max_scores from torch's (Triton) kernels, with the
    FallbackWarning that says so, against the float64 truth, fully masked rows -inf."""
    B, H, S, D = 1, 4, 1000, 64
    score_mod, mask_mod = make_mods(B, H, S, S, device="cuda")["fully_masked_rows"]
    bm = flexlab.create_block_mask(mask_mod, None, None, S, S, device="cuda")
    q, k, v = random_qkv(B, H, S, S, D, torch.bfloat16, "cuda")
    truth, truth_lse = reference(q, k, v, score_mod, bm)
    _, truth_aux = flexlab.flex_attention(q.double(), k.double(), v.double(), score_mod, bm, backend="reference",
                                          return_aux=flexlab.AuxRequest(max_scores=True))
    alive = torch.isfinite(truth_lse)
    with warnings.catch_warnings():
        warnings.simplefilter("error", flexlab.FallbackWarning)  # the LSE alone stays on flexlab's kernels
        out, aux = flexlab.flex_attention(q, k, v, score_mod, bm, return_aux=flexlab.AuxRequest(lse=True))
    assert aux.max_scores is None and rel_l2(out, truth) < TOLERANCES[torch.bfloat16]
    assert torch.equal(torch.isfinite(aux.lse), alive)
    assert torch.allclose(aux.lse[alive].double(), truth_lse[alive], atol=2e-2, rtol=1e-3)
    with pytest.warns(flexlab.FallbackWarning, match="max_scores"):
        out, aux = flexlab.flex_attention(q, k, v, score_mod, bm,
                                          return_aux=flexlab.AuxRequest(lse=True, max_scores=True))
    assert rel_l2(out, truth) < TOLERANCES[torch.bfloat16]
    assert torch.equal(torch.isfinite(aux.max_scores), alive)
    assert torch.allclose(aux.max_scores[alive].double(), truth_aux.max_scores[alive], atol=2e-2, rtol=1e-2)
