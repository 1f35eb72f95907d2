"""The Hopper backward kernels against the float64 reference, on fresh random inputs (GPU only).

Gradients go through flexlab's custom ops (`differentiable_attention`), so the generated score_mod_bwd and
captured-tensor gradients, the Q-direction block sparsity and the GQA sums are all exercised. The reference is torch
autograd through the dense float64 reference backend, which differentiates the user's own Python mods.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

import flexlab  # noqa: E402
from flexlab.autograd import differentiable_attention  # noqa: E402
from flexlab.gallery import load_gallery  # noqa: E402
from flexlab.testing import random_qkv, reference, rel_l2  # noqa: E402

GRAD_TOL = 2e-2  # rel-L2 of dQ, dK, dV and captured-tensor grads vs float64, bf16 inputs


def grad_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """rel-L2, with the reference's norm floored at an RMS of 1e-2 per element: where the exact gradient is zero
    (one query row that sees one key has P = 1, so dS = 0) both sides are rounding noise, and noise over noise is no
    measure. Random-input gradients are far above the floor, so elsewhere this is plain rel-L2."""
    a, b = actual.double(), expected.double()
    floor = 1e-2 * b.numel() ** 0.5
    return float((a - b).norm() / max(float(b.norm()), floor))


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs an sm90 GPU (H100/H200)")


def _backward(q, k, v, score_mod, bm, trainable, dout, gqa, deterministic=None):
    for t in (q, k, v, *trainable):
        t.grad = None
    out = differentiable_attention(q, k, v, score_mod, bm, enable_gqa=gqa, deterministic=deterministic)
    out.backward(dout)
    return [t.grad.clone() for t in (q, k, v, *trainable)]


def _reference_grads(q, k, v, score_mod, bm, trainable, dout, gqa):
    for t in trainable:
        t.grad = None
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    out, _ = reference(q64, k64, v64, score_mod, bm, None, gqa)
    out.backward(dout.double())
    return [q64.grad, k64.grad, v64.grad, *[t.grad.clone() for t in trainable]]


@needs_hopper
@pytest.mark.parametrize("name", sorted(load_gallery()))
@pytest.mark.parametrize("S", [1000, pytest.param(4096, marks=pytest.mark.slow)])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("Hkv", [4, 2], ids=["mha", "gqa"])
def test_gallery_gradients_match_float64(name, S, D, Hkv):
    variant = load_gallery()[name]
    if not variant.accepts_lengths(S, S):
        pytest.skip(f"{name} does not accept S={S}: {variant.lengths_rule}")
    mods = variant.build(B=2, H=4, Q_LEN=S, KV_LEN=S, device="cuda")
    trainable = [mods.tensors[t].requires_grad_(True) for t in variant.trainable]
    bm = flexlab.create_block_mask(mods.mask_mod, 2, 4, S, S, device="cuda") if mods.mask_mod else None
    q, k, v = random_qkv(2, 4, S, S, D, torch.bfloat16, "cuda", Hkv=Hkv, requires_grad=True)
    dout = torch.randn(2, 4, S, D, device="cuda", dtype=torch.bfloat16)
    ours = _backward(q, k, v, mods.score_mod, bm, trainable, dout, Hkv != 4)
    ref = _reference_grads(q, k, v, mods.score_mod, bm, trainable, dout, Hkv != 4)
    names = ["dq", "dk", "dv"] + [f"d{t}" for t in variant.trainable]
    for n, a, b in zip(names, ours, ref):
        assert not torch.isnan(a).any(), f"NaN in {n}"
        assert rel_l2(a, b) < GRAD_TOL, f"{n}: rel-L2 {rel_l2(a, b):.2e}"


@needs_hopper
@pytest.mark.parametrize("Sq,Skv", [(1, 1), (127, 127), (129, 129), (200, 333), (333, 200), (1023, 1024)])
@pytest.mark.parametrize("D", [64, 128])
def test_awkward_lengths_dense(Sq, Skv, D):
    q, k, v = random_qkv(1, 2, Sq, Skv, D, torch.bfloat16, "cuda", requires_grad=True)
    dout = torch.randn(1, 2, Sq, D, device="cuda", dtype=torch.bfloat16)
    for n, a, b in zip(("dq", "dk", "dv"), _backward(q, k, v, None, None, [], dout, False),
                       _reference_grads(q, k, v, None, None, [], dout, False)):
        assert not torch.isnan(a).any(), f"NaN in {n}"
        assert grad_error(a, b) < GRAD_TOL, f"{n}: error {grad_error(a, b):.2e}"


@needs_hopper
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sliding-window"])
@pytest.mark.parametrize("D", [64, 128])
def test_deterministic_mode_repeats_bitwise(sparse, D):
    S = 2048
    bm = None
    if sparse:
        bm = flexlab.create_block_mask(lambda b, h, qi, kv: (qi >= kv) & (qi - kv < 700), 1, 1, S, S, device="cuda")
    q, k, v = random_qkv(2, 4, S, S, D, torch.bfloat16, "cuda", Hkv=2, requires_grad=True)
    dout = torch.randn(2, 4, S, D, device="cuda", dtype=torch.bfloat16)
    runs = [_backward(q, k, v, None, bm, [], dout, True, deterministic=True) for _ in range(5)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)
    ref = _reference_grads(q, k, v, None, bm, [], dout, True)
    for a, b in zip(runs[0], ref):
        assert rel_l2(a, b) < GRAD_TOL


@needs_hopper
def test_deterministic_mode_with_learnable_tensors():
    """Bitwise-repeatable bias gradients when the generated code accumulates through add_aux_grad (exact int64
    fixed point); a clear refusal while it emits plain fp32 atomics."""
    from flexlab import _ops
    from flexlab.errors import BackendUnavailableError
    bias = torch.randn(2, 9, device="cuda", requires_grad=True)

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, torch.clamp(kv_idx - q_idx, -4, 4) + 4]

    q, k, v = random_qkv(1, 2, 1000, 1000, 64, torch.bfloat16, "cuda", requires_grad=True)
    dout = torch.randn(1, 2, 1000, 64, device="cuda", dtype=torch.bfloat16)
    if "add_aux_grad" not in _ops.mod_entry(_ops.register_mods(rel_bias, None)).generated.source:
        out = differentiable_attention(q, k, v, rel_bias, deterministic=True)
        with pytest.raises(BackendUnavailableError, match="deterministic"):
            out.backward(dout)
        return
    runs = [_backward(q, k, v, rel_bias, None, [bias], dout, False, deterministic=True) for _ in range(5)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)
    ref = _reference_grads(q, k, v, rel_bias, None, [bias], dout, False)
    for a, b in zip(runs[0], ref):
        assert rel_l2(a, b) < GRAD_TOL
