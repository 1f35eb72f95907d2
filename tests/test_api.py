"""flex_attention's reference and torch backends against torch's own eager flex_attention and a float64 truth."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention

import flexlab
from flexlab.testing import TOLERANCES, random_qkv, reference, rel_l2
from mod_matrix import MOD_NAMES, make_mods

# (B, Hq, Hkv, Sq, Skv, D): lengths off the 128 grid, Sq != Skv both ways, GQA.
SHAPES = [(2, 2, 2, 200, 200, 32), (1, 4, 2, 129, 300, 64), (1, 2, 1, 300, 127, 16)]


def _torch_eager(q, k, v, score_mod, block_mask, enable_gqa):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, lse = torch_flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=enable_gqa,
                                        return_lse=True)
    return out, lse


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", MOD_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_matches_torch_eager(name, shape, dtype):
    B, Hq, Hkv, Sq, Skv, D = shape
    score_mod, mask_mod = make_mods(B, Hq, Sq, Skv)[name]
    q, k, v = random_qkv(B, Hq, Sq, Skv, D, dtype, Hkv=Hkv)
    bm = flexlab.create_block_mask(mask_mod, B, None, Sq, Skv) if mask_mod else None
    gqa = Hq != Hkv
    out, lse = flexlab.flex_attention(q, k, v, score_mod, bm, enable_gqa=gqa, return_lse=True, backend="reference")
    t_bm = torch_create_block_mask(mask_mod, B, None, Sq, Skv, device="cpu") if mask_mod else None
    t_out, t_lse = _torch_eager(q, k, v, score_mod, t_bm, gqa)
    truth, truth_lse = reference(q, k, v, score_mod, bm, enable_gqa=gqa)
    assert out.dtype == dtype and out.shape == (B, Hq, Sq, D)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    tol = TOLERANCES[dtype]
    assert rel_l2(out, truth) < tol
    assert rel_l2(t_out, truth) < 2 * tol  # the comparison itself is meaningful
    assert rel_l2(out, t_out) < 2 * tol
    alive = torch.isfinite(truth_lse)
    assert torch.equal(torch.isfinite(lse), alive)
    assert torch.allclose(lse[alive].double(), truth_lse[alive], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["fully_masked_rows"])
@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_fully_masked_rows_are_zero_with_neg_inf_lse(name, backend):
    B, H, S, D = 1, 2, 64, 16
    _, mask_mod = make_mods(B, H, S, S)[name]
    q, k, v = random_qkv(B, H, S, S, D)
    bm = flexlab.create_block_mask(mask_mod, None, None, S, S)
    out, lse = flexlab.flex_attention(q, k, v, block_mask=bm, return_lse=True, backend=backend)
    dead = torch.arange(S) % 7 == 3
    assert torch.all(out[:, :, dead] == 0)
    assert torch.all(torch.isneginf(lse[:, :, dead]))
    assert not torch.isnan(out).any()
    assert torch.all(torch.isfinite(lse[:, :, ~dead]))


@pytest.mark.parametrize("name", MOD_NAMES)
def test_reference_gradients_pass_gradcheck(name):
    """Finite differences in float64: the reference's autograd is the math, for every mod (GQA, Sq != Skv)."""
    B, Hq, Hkv, Sq, Skv, D = 1, 2, 1, 9, 12, 4
    score_mod, mask_mod = make_mods(B, Hq, Sq, Skv)[name]
    bm = flexlab.create_block_mask(mask_mod, B, None, Sq, Skv, BLOCK_SIZE=4) if mask_mod else None
    q, k, v = random_qkv(B, Hq, Sq, Skv, D, torch.float64, Hkv=Hkv, requires_grad=True)

    def fn(q, k, v):
        out = flexlab.flex_attention(q, k, v, score_mod, bm, enable_gqa=True)  # auto → reference on CPU
        return out

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-7, fast_mode=True)


def test_torch_backend_refuses_cpu_backward_clearly():
    q, k, v = random_qkv(1, 1, 16, 16, 8, requires_grad=True)
    with pytest.raises(flexlab.BackendUnavailableError, match="backend='reference'"):
        flexlab.flex_attention(q, k, v, backend="torch")


def test_captured_parameter_gets_gradient():
    H, S, D = 2, 96, 16
    table = torch.randn(H, 2 * S - 1, dtype=torch.float64, requires_grad=True)

    def learnable_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + S - 1]

    q, k, v = random_qkv(1, H, S, S, D, torch.float64)
    out = flexlab.flex_attention(q, k, v, learnable_bias, backend="reference")
    (g,) = torch.autograd.grad(out.square().sum(), table)
    # Compare with explicit dense math.
    rel = torch.arange(S)[:, None] - torch.arange(S)[None, :] + S - 1
    table2 = table.detach().clone().requires_grad_(True)
    s = q @ k.transpose(-1, -2) * D ** -0.5 + table2[:, rel].unsqueeze(0)
    out2 = torch.softmax(s, -1) @ v
    (g2,) = torch.autograd.grad(out2.square().sum(), table2)
    assert rel_l2(out, out2) < 1e-12
    assert rel_l2(g, g2) < 1e-10


def test_auto_on_cpu_differentiates_a_learned_table_with_frozen_inputs():
    """Only the captured table requires grad (Q, K and V frozen): "auto" must still take the differentiable path on
    a CPU, not torch's forward-only one, and refuse it clearly where the backend cannot differentiate."""
    H, S, D = 2, 64, 16
    table = torch.zeros(H, 2 * S - 1, requires_grad=True)

    def learnable_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + S - 1]

    q, k, v = random_qkv(1, H, S, S, D)
    out = flexlab.flex_attention(q, k, v, learnable_bias)
    (g,) = torch.autograd.grad(out.square().sum(), table)
    ref = flexlab.flex_attention(q, k, v, learnable_bias, backend="reference")
    (g_ref,) = torch.autograd.grad(ref.square().sum(), table)
    assert g.abs().sum() > 0 and rel_l2(g, g_ref) < 1e-6
    with pytest.raises(flexlab.BackendUnavailableError, match="backend='reference'"):
        flexlab.flex_attention(q, k, v, learnable_bias, backend="torch")
    with torch.no_grad():  # nothing to differentiate: torch's path is fine
        flexlab.flex_attention(q, k, v, learnable_bias, backend="torch")

    def unlowerable(score, b, h, q_idx, kv_idx):  # lgamma: no code generator support, the reference runs it
        return torch.lgamma(score.abs() + 1.0) + table[h, q_idx - kv_idx + S - 1]

    (g,) = torch.autograd.grad(flexlab.flex_attention(q, k, v, unlowerable).square().sum(), table)
    assert g.abs().sum() > 0


def test_torch_backend_cpu_matches_reference():
    B, H, S, D = 1, 2, 150, 32
    score_mod, mask_mod = make_mods(B, H, S, S)["alibi_causal"]
    bm = flexlab.create_block_mask(mask_mod, B, H, S, S)
    q, k, v = random_qkv(B, H, S, S, D)
    out = flexlab.flex_attention(q, k, v, score_mod, bm, backend="torch")
    truth, _ = reference(q, k, v, score_mod, bm)
    assert rel_l2(out, truth) < TOLERANCES[torch.float32]


def test_auto_on_cpu_uses_torch_path_and_scale_is_honoured():
    q, k, v = random_qkv(1, 2, 64, 64, 16)
    a = flexlab.flex_attention(q, k, v, scale=0.3)
    truth, _ = reference(q, k, v, scale=0.3)
    assert rel_l2(a, truth) < TOLERANCES[torch.float32]
    assert rel_l2(a, reference(q, k, v)[0]) > 1e-3


def test_auto_says_when_a_gpu_call_takes_torchs_path(monkeypatch):
    """On a GPU, `auto` running torch's flex_attention instead of flexlab's kernels is slower: it warns with the reason
    (CPU calls have no kernel to miss and stay quiet)."""
    from types import SimpleNamespace

    from flexlab import api
    monkeypatch.setattr(api, "_cute_plan", lambda *args: ("head_dim=96 is not one of (64, 128, 256)", False))
    on_gpu = SimpleNamespace(device=torch.device("cuda"))
    with pytest.warns(flexlab.FallbackWarning, match="runs torch's flex_attention .*head_dim=96"):
        assert api._choose_backend("auto", on_gpu, on_gpu, on_gpu, None, None, False) == ("torch", False)
    with pytest.raises(flexlab.BackendUnavailableError, match="head_dim=96"):
        api._choose_backend("cute", on_gpu, on_gpu, on_gpu, None, None, False)
    q, k, v = random_qkv(1, 1, 16, 16, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", flexlab.FallbackWarning)
        flexlab.flex_attention(q, k, v)


def test_cute_backend_is_explicit_about_availability():
    q, k, v = random_qkv(1, 1, 16, 16, 16)
    with pytest.raises(flexlab.BackendUnavailableError, match="cute"):
        flexlab.flex_attention(q, k, v, backend="cute")


@pytest.mark.parametrize("scale", [-0.125, 0.0, float("nan"), float("inf")])
def test_cute_backend_refuses_a_scale_it_cannot_take_by_name(scale):
    # the kernels' online softmax keeps each row's largest raw score (a negative scale inverts it) and starts every
    # row from -inf (exp2(-inf * 0) is NaN): such scales are routed away, never run
    q, k, v = random_qkv(1, 1, 16, 16, 16)
    with pytest.raises(flexlab.BackendUnavailableError, match=f"scale={scale} is not a finite positive number"):
        flexlab.flex_attention(q, k, v, scale=scale, backend="cute")
    # ... and no warm entry can serve it either: such a call has no signature, so it always takes the backend choice
    assert flexlab.api._signature(q, k, v, None, None, scale, False, False, "auto") is None
    assert flexlab.api._signature(q, k, v, None, None, 0.125, False, False, "auto") is not None


def test_forward_launcher_refuses_a_scale_it_cannot_take():
    from flexlab.errors import FlexlabValueError
    from flexlab.runtime import launch
    q, k, v = random_qkv(1, 1, 16, 16, 16)
    with pytest.raises(FlexlabValueError, match="scale=0.0"):
        launch.forward(q, k, v, scale=0.0)


def test_return_lse_shapes_and_types():
    q, k, v = random_qkv(2, 2, 33, 65, 8)
    res = flexlab.flex_attention(q, k, v, return_lse=True, backend="reference")
    assert isinstance(res, tuple) and res[1].shape == (2, 2, 33) and res[1].dtype == torch.float32
    assert isinstance(flexlab.flex_attention(q, k, v, backend="reference"), torch.Tensor)


def test_torch_backend_cpu_lse_is_natural_log():
    q, k, v = random_qkv(1, 2, 100, 120, 16)

    def drift(score, b, h, q_idx, kv_idx):
        return score + 0.01 * (q_idx - kv_idx)

    out, lse = flexlab.flex_attention(q, k, v, drift, return_lse=True, backend="torch")
    truth, truth_lse = reference(q, k, v, drift)
    assert rel_l2(out, truth) < TOLERANCES[torch.float32]
    assert torch.allclose(lse.double(), truth_lse, atol=1e-5)


def test_reference_keeps_nan_and_inf_visible():
    """Only a fully masked row (LSE -inf) becomes 0; a NaN or +inf score makes its row NaN, as in torch."""
    q, k, v = random_qkv(1, 1, 8, 8, 4, dtype=torch.float64)
    q[0, 0, 3, 0] = float("nan")
    k[0, 0, 5, 1] = float("inf")
    out = flexlab.flex_attention(q, k, v, backend="reference")
    expect = torch.softmax(q @ k.transpose(-1, -2) * 0.5, dim=-1) @ v
    assert torch.equal(out.isnan(), expect.isnan()) and out.isnan().any()
    finite = ~expect.isnan()
    torch.testing.assert_close(out[finite], expect[finite])


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_cpu_inference_with_parameters_that_require_grad(backend):
    """Under no_grad a CPU call with leaf tensors that require grad runs forward-only (torch's CPU path would
    otherwise refuse them)."""
    q, k, v = (t.requires_grad_(True) for t in random_qkv(1, 2, 16, 16, 8))
    with torch.no_grad():
        out = flexlab.flex_attention(q, k, v, backend=backend)
    torch.testing.assert_close(out, reference(q.detach(), k.detach(), v.detach())[0].to(out.dtype))
