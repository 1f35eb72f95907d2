"""Exact mask density (kept (q, kv) pairs / Sq·Skv) from a BlockMask, without evaluating the whole S×S grid.

Full blocks count their whole (edge-clipped) area; empty blocks count nothing; only the partial blocks, a thin band
for the common masks, are evaluated element by element with the mask_mod. TFLOP/s numbers use this density, so a
peer that skips masked work is credited only for the work the mask keeps.
"""
from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

from ..mask.block_mask import BLOCK_FULL, BLOCK_PARTIAL, block_states
from ..mods import evaluate_mask_mod


def _block_extent(n_blocks: int, block: int, length: int, device) -> torch.Tensor:
    """Number of real (unpadded) positions in each block: `block` everywhere but the ragged last one."""
    ext = torch.full((n_blocks,), block, dtype=torch.float64, device=device)
    ext[-1] = length - block * (n_blocks - 1)
    return ext


def kept_pairs(block_mask: BlockMask) -> torch.Tensor:
    """float64 (B_mask, H_mask): kept (q, kv) pairs for each batch/head the mask distinguishes."""
    Sq, Skv = block_mask.seq_lengths
    q_bs, kv_bs = block_mask.BLOCK_SIZE
    states = block_states(block_mask)
    n_q, n_kv = states.shape[-2:]
    device = states.device
    area = torch.outer(_block_extent(n_q, q_bs, Sq, device), _block_extent(n_kv, kv_bs, Skv, device))
    kept = ((states == BLOCK_FULL).to(torch.float64) * area).sum(dim=(-2, -1))
    partial = (states == BLOCK_PARTIAL).nonzero().tolist()
    # Group the partial blocks by (b, h, q block): one mask evaluation per group.
    groups: dict[tuple[int, int, int], list[int]] = {}
    for b, h, qb, kb in partial:
        groups.setdefault((b, h, qb), []).append(kb)
    for (b, h, qb), kbs in groups.items():
        q_idx = torch.arange(qb * q_bs, min(Sq, (qb + 1) * q_bs), device=device)
        kv_idx = torch.cat([torch.arange(kb * kv_bs, min(Skv, (kb + 1) * kv_bs), device=device) for kb in kbs])
        b_idx = torch.tensor([b], device=device)
        h_idx = torch.tensor([h], device=device)
        kept[b, h] += evaluate_mask_mod(block_mask.mask_mod, b_idx, h_idx, q_idx, kv_idx).sum().double()
    return kept


def mask_density(block_mask: BlockMask | None) -> float:
    """Fraction of (q, kv) pairs the mask keeps, averaged over batch and heads (1.0 without a mask)."""
    if block_mask is None:
        return 1.0
    Sq, Skv = block_mask.seq_lengths
    return float(kept_pairs(block_mask).mean().item()) / (Sq * Skv)
