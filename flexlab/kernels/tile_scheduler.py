"""Which (Q tile, head, batch) a CTA computes.

The grid is (heads, batch, Q tiles) so the hardware issues CTAs head-fastest: every head's first-ranked Q tile is
started before any second-ranked one. With a block mask the host ranks Q tiles longest-work-first (`order`, the
number of KV blocks a tile visits summed over batch and heads, descending); the heavy causal diagonal-far tiles then
start first and the short ones fill the tail of the wave instead of leaving SMs idle at the end.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@cute.jit
def current_tile(order) -> tuple:
    """(m_block, head, batch) of this CTA; `order` is None (identity) or an int32 tensor rank -> Q tile index."""
    head, batch, rank = cute.arch.block_idx()
    m_block = Int32(rank)
    if cutlass.const_expr(order is not None):
        m_block = Int32(order[rank])
    return m_block, Int32(head), Int32(batch)


def grid_shape(num_heads, batch, num_m_blocks) -> list:
    return [num_heads, batch, num_m_blocks]
