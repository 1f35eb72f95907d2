"""Mask density from block masks, cross-checked against closed forms and the dense mask."""
import pytest
import torch

import flexlab
from flexlab.bench.cases import build_case
from flexlab.bench.density import mask_density


def _density(mask_mod, S, B=None, H=None, block=128):
    return mask_density(flexlab.create_block_mask(mask_mod, B, H, S, S, BLOCK_SIZE=block))


@pytest.mark.parametrize("S", [128, 300, 1000])
def test_causal_density_is_triangle(S):
    mask = build_case("causal", 1, 1, S, "cpu").mask_mod
    assert _density(mask, S) == pytest.approx((S + 1) / (2 * S), abs=1e-12)


@pytest.mark.parametrize("S", [700, 2048])
def test_sliding_window_density_closed_form(S):
    w = 1024  # the benchmark's window: each query sees min(q + 1, w) keys
    mask = build_case("sliding_window", 1, 1, S, "cpu").mask_mod
    expected = sum(min(q + 1, w) for q in range(S)) / S ** 2
    assert _density(mask, S) == pytest.approx(expected, abs=1e-12)


def test_document_density_sums_causal_triangles_per_document():
    S = 1500
    case = build_case("document", 1, 1, S, "cpu")
    lengths = torch.bincount(case.tensors["document_id"].long())
    lengths = lengths[lengths > 0]
    assert len(lengths) == 8
    expected = float((lengths * (lengths + 1) // 2).sum()) / S ** 2
    assert _density(case.mask_mod, S, block=64) == pytest.approx(expected, abs=1e-12)


def test_density_averages_masks_that_vary_over_batch_and_heads():
    def stripes(b, h, q_idx, kv_idx):
        return (kv_idx + h + 2 * b) % 3 == 0

    S = 200
    dense = flexlab.create_mask(stripes, 2, 3, S, S).double().mean().item()
    assert _density(stripes, S, B=2, H=3, block=64) == pytest.approx(dense, abs=1e-12)


def test_no_mask_is_dense():
    assert mask_density(None) == 1.0
