"""Host mirror of the forward kernel's CTA order (`flexlab.kernels.tile_scheduler`), and its one host-side knob.

`issue_order` lists tiles in the order the hardware starts them, so the block-sparsity inspector can simulate SM
load with the kernel's real rule instead of a copy of it.
"""
from __future__ import annotations

from functools import lru_cache

import torch

L2_BUDGET_BYTES = 32 * 1024 * 1024  # half of the H200's L2: K/V of one head group stay resident while it runs


@lru_cache(maxsize=1024)
def heads_per_group(seqlen_k: int, head_dim: int, elem_bytes: int, qhead_per_kvhead: int, num_hb: int,
                    l2_budget_bytes: int = L2_BUDGET_BYTES) -> int:
    """How many (batch, head) pairs share L2 at a time: K+V of one KV head, split over the query heads reading it."""
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
