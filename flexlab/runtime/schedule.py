"""Host mirror of the forward kernel's CTA order (`flexlab.kernels.tile_scheduler`), and its one host-side knob.

`issue_order` lists tiles in the order the hardware starts them, so the block-sparsity inspector can simulate SM
load with the kernel's real rule instead of a copy of it.
"""
from __future__ import annotations

from functools import lru_cache

import torch

# K/V bytes one group of (batch, head) pairs may keep in L2 while it runs. The H200's 50 MiB L2 is two halves, and a
# line read by SMs on both sides can sit in both, so what stays resident for a whole grid is nearer 25 MiB.
# Block-sparse grids (causal, windows, documents) read part of each head's K/V per Q tile and rank tiles
# longest-work-first across the group, so they take wide groups; dense grids stream every K/V block through every
# Q tile and want few heads in flight. H200, D=128 forward, kernel time (benchmarks/results/fwd_l2_groups_h200_*):
# dense B4 S4k 1.04-1.06x and B8 S1k 1.05x with 8 MiB over 32 MiB (at 32 MiB the kernel read 2.7x the minimum
# bytes from HBM); the document rows lost 4-11% and causal 0-10% with 8 MiB.
L2_BUDGET_BYTES = 32 * 1024 * 1024
L2_BUDGET_DENSE_BYTES = 8 * 1024 * 1024


@lru_cache(maxsize=1024)
def heads_per_group(seqlen_k: int, head_dim: int, elem_bytes: int, qhead_per_kvhead: int, num_hb: int,
                    block_sparse: bool = True, l2_budget_bytes: int | None = None) -> int:
    """How many (batch, head) pairs share L2 at a time: K+V of one KV head, split over the query heads reading it."""
    if l2_budget_bytes is None:
        l2_budget_bytes = L2_BUDGET_BYTES if block_sparse else L2_BUDGET_DENSE_BYTES
    per_qhead = max(1, 2 * seqlen_k * head_dim * elem_bytes // max(1, qhead_per_kvhead))
    return max(1, min(num_hb, l2_budget_bytes // per_qhead))


def issue_order(num_m_blocks: int, num_hb: int, group: int, order: torch.Tensor | None = None) -> torch.Tensor:
    """(num_m_blocks * num_hb, 2) int64 rows (m_block, batch * heads + head) in CTA launch order.

    Same arithmetic as the device: groups of `group` (batch, head) pairs; inside a group the Q-tile rank is the slow
    index and the head the fast one; rank -> Q tile through `order` (longest-work-first) when given.
    """
    bid = torch.arange(num_m_blocks * num_hb)
    per_group = group * num_m_blocks
    g = bid // per_group
    r = bid - g * per_group
    first = g * group
    size = torch.clamp(num_hb - first, max=group)
    rank = r // size
    hb = first + r - rank * size
    m = order.long().cpu()[rank] if order is not None else rank
    return torch.stack([m, hb], dim=1)
