"""Every gallery variant goes through flexlab's code generator, and the generated math agrees with the mod."""
from __future__ import annotations

import pytest
import torch

from flexlab.codegen import generate
from flexlab.gallery import load_gallery
from flexlab.mods import evaluate_mask_mod, evaluate_score_mod, index_grid

VARIANTS = load_gallery()


def _lengths(v):
    return next(ql for ql in [(131, 131), (130, 130), (64, 300)] if v.accepts_lengths(*ql))


def _broadcast_grid(B, H, Q, KV):
    b, h, q, kv = index_grid(B, H, Q, KV, "cpu")
    return b[:, None, None, None], h[None, :, None, None], q[None, None, :, None], kv[None, None, None, :]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_lowers_and_its_torch_lowering_agrees(name):
    v = VARIANTS[name]
    B, H, (Q, KV) = 2, 3, _lengths(v)
    mods = v.build(B, H, Q, KV)
    generated = generate(mods.score_mod, mods.mask_mod)
    assert "def " in generated.source and len(generated.source.splitlines()) > 5
    assert len(generated.aux_tensors) == len(mods.tensors)
    grid = index_grid(B, H, Q, KV, "cpu")
    if mods.mask_mod is not None:
        assert generated.has_mask_mod
        ours = generated.evaluate_mask_mod(*_broadcast_grid(B, H, Q, KV))
        expected = evaluate_mask_mod(mods.mask_mod, *grid)
        assert torch.equal(ours.expand_as(expected), expected)
    if mods.score_mod is not None and name != "noop":
        assert generated.has_score_mod
        scores = torch.randn(B, H, Q, KV, dtype=torch.float64)
        ours = generated.evaluate_score_mod(scores, *_broadcast_grid(B, H, Q, KV))
        expected = evaluate_score_mod(mods.score_mod, scores, *grid)
        assert torch.allclose(ours, expected, rtol=1e-5, atol=1e-5)  # constants are float32 in kernels


@pytest.mark.parametrize("name", sorted(n for n, v in VARIANTS.items() if v.trainable))
def test_generated_gradients_of_captured_parameters(name):
    """The generator's symbolic gradient for a learnable table equals autograd through the mod."""
    v = VARIANTS[name]
    B, H, (Q, KV) = 2, 3, _lengths(v)
    mods = v.build(B, H, Q, KV)
    scores = torch.randn(B, H, Q, KV, dtype=torch.float64)
    upstream = torch.randn_like(scores)
    for t in (mods.tensors[n] for n in v.trainable):
        t.requires_grad_(True)
    generated = generate(mods.score_mod, None)
    ours = generated.evaluate_aux_grads(upstream, scores, *_broadcast_grid(B, H, Q, KV))
    out = evaluate_score_mod(mods.score_mod, scores, *index_grid(B, H, Q, KV, "cpu"))
    expected = torch.autograd.grad(out, [mods.tensors[n] for n in v.trainable], upstream)
    for got, want in zip(ours, expected):
        assert got.shape == want.shape
        assert torch.allclose(got.double(), want.double(), rtol=1e-4, atol=1e-4)
