"""The backward kernel's tile walk, mirrored in torch on CPU, equals the dense backward.

`tiled_backward` reads the same padded D/LSE2 and the same Q-direction block lists (partial with mask_mod, then
full) the GPU kernel reads, masks the key tail, sums GQA heads into one dK/dV and dQ partials in KV-tile order. If
it matches `dense_backward` (itself checked against torch autograd in tests/test_autograd.py), the schedule and
padding rules the kernel depends on are right.
"""
from __future__ import annotations

import pytest
import torch

import flexlab
from flexlab.codegen import generate
from flexlab.kernels.bwd_reference import dense_backward, dense_forward, kept_pairs, tiled_backward
from flexlab.testing import random_qkv, rel_l2


def _mask_tensors(bm):
    return [bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices, bm.q_num_blocks,
            bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices]


def _compare(Sq, Skv, Hq, Hkv, score_mod=None, mask_mod=None, with_dlse=False):
    q, k, v = random_qkv(1, Hq, Sq, Skv, 16, torch.float64, Hkv=Hkv)
    g = generate(score_mod, mask_mod) if (score_mod or mask_mod) else None
    bm = flexlab.create_block_mask(mask_mod, 1, Hq, Sq, Skv, BLOCK_SIZE=128) if mask_mod else None
    keep = kept_pairs(bm, g, 1, Hq, Sq, Skv, "cpu")
    out, lse = dense_forward(q, k, v, 0.25, g, keep)
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse) if with_dlse else None
    dense = dense_backward(dout, q, k, v, out, lse, dlse, 0.25, g, keep)
    tiled = tiled_backward(dout, q, k, v, out, lse, dlse, 0.25, g, _mask_tensors(bm) if bm else [],
                           [128, 128] if bm else [])
    for name, a, b in zip(("dq", "dk", "dv"), tiled[:3], dense[:3]):
        assert rel_l2(a, b) < 1e-6, f"{name}: {rel_l2(a, b):.2e}"
    assert len(tiled[3]) == len(dense[3])
    for a, b in zip(tiled[3], dense[3]):
        assert rel_l2(a, b) < 1e-6


@pytest.mark.parametrize("Sq,Skv", [(100, 150), (200, 70)])
def test_dense_gqa_ragged(Sq, Skv):
    _compare(Sq, Skv, 4, 2, with_dlse=True)


def test_sliding_window_block_mask_with_learnable_bias():
    bias = (0.1 * torch.randn(2, 33, dtype=torch.float64)).requires_grad_(True)

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, torch.clamp(kv_idx - q_idx, -16, 16) + 16]

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 150)

    _compare(300, 300, 2, 1, rel_bias, window)


def test_fully_masked_rows_and_sq_not_multiple_of_tile():
    def late_start(b, h, q_idx, kv_idx):
        return (q_idx >= 70) & (kv_idx <= q_idx)

    _compare(190, 260, 2, 1, None, late_start)


@pytest.mark.parametrize("Sq,Skv", [(1, 1), (1, 300), (300, 1)])
def test_single_row_and_single_key(Sq, Skv):
    """One Q tile that is mostly padding, or one key in a mostly padded KV tile."""
    _compare(Sq, Skv, 2, 1, with_dlse=True)


def test_kv_tiles_that_visit_no_query_tile():
    """One query row that sees the first 101 keys: the later KV tiles have empty Q-direction lists (a zero-trip loop
    in the kernel, whose dK and dV must still come out as zeros). Not plain causal: a row with one key has P = 1
    and dS = 0 exactly, and its rounding noise makes no comparison."""
    def near_start(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + 100

    _compare(1, 300, 2, 2, None, near_start)
