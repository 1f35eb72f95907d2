"""Which (Q tile, head, batch) a CTA computes: L2-aware grouping of heads, longest-work-first Q tiles.

The grid is 1-D. CTAs are dealt out in groups of `heads_per_group` (batch, head) pairs, chosen on the host so that
the K/V of one group fit in L2 together (`flexlab.runtime.schedule.heads_per_group`); inside a group the Q-tile rank is the slow index and the head the fast one.
So while a group runs, every K/V block is fetched from HBM once and then re-read from L2 by the other Q tiles, and
every head's rank-0 tile starts before any rank-1 tile. With a block mask the host ranks Q tiles longest-work-first
(`order`: KV blocks visited, summed over batch and heads, descending), so heavy tiles start early and light ones fill
the tail of the last wave instead of leaving SMs idle.

With K/V multicast (`FwdConfig.cluster_m` = 2, dense grids only) the grid is dealt out in pairs: the two CTAs of a
cluster take Q tiles 2r and 2r + 1 of the same head, so every K/V block they load is the same one. Persistent
clusters walk pairs the same way (`pair_coords`): cluster c takes pairs c, c + G/2, ...

A persistent kernel (`FwdConfig.persistent_ctas`) launches fewer CTAs than tiles; CTA c then computes tiles c, c + G,
c + 2G, ... (G = grid size) in the same rank order, so each "wave" of G tiles is exactly the wave the one-tile-per-CTA
grid would start, and heavy tiles still come first. When tiles differ in length that fixed deal leaves some CTAs with
more work than others. With `FwdConfig.dynamic_tiles` a CTA instead claims its next tile from a global counter as it
starts one (`claim_tile`), so tiles are handed out in launch order to whichever CTA is free, as the hardware does for a
one-tile-per-CTA grid. The producer warp claims and reads the tile's schedule, then hands it to the consumer warpgroups
through a small ring of shared-memory slots (`hand_over_tile`, `take_tile`).
"""
from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32

from .block_sparse import KvSchedule


@cute.jit
def current_tile(order, num_m_blocks: Int32, num_heads: Int32, num_hb: Int32, heads_per_group: Int32) -> tuple:
    """(m_block, head, batch) of this CTA; `order` is None (identity) or an int32 tensor rank -> Q tile index."""
    return tile_coords(Int32(cute.arch.block_idx()[0]), order, num_m_blocks, num_heads, num_hb, heads_per_group)


@cute.jit
def tile_coords(tile: Int32, order, num_m_blocks: Int32, num_heads: Int32, num_hb: Int32,
                heads_per_group: Int32) -> tuple:
    """(m_block, head, batch) of tile number `tile` in launch order."""
    tiles_per_group = heads_per_group * num_m_blocks
    group = tile // tiles_per_group
    r = tile - group * tiles_per_group
    first_hb = group * heads_per_group
    group_size = cutlass.min(heads_per_group, num_hb - first_hb)
    rank = r // group_size
    hb = first_hb + r - rank * group_size
    batch = hb // num_heads
    head = hb - batch * num_heads
    m_block = rank
    if cutlass.const_expr(order is not None):
        m_block = Int32(order[rank])
    return m_block, head, batch


@cute.jit
def cluster_pair_tile(num_pairs: Int32, num_heads: Int32, num_hb: Int32, heads_per_group: Int32) -> tuple:
    """(m_block, head, batch) of this CTA in a grid of 2-CTA clusters, one pair of Q tiles per cluster."""
    return pair_coords(Int32(cute.arch.block_idx()[0]) // 2, num_pairs, num_heads, num_hb, heads_per_group)


@cute.jit
def pair_coords(pair: Int32, num_pairs: Int32, num_heads: Int32, num_hb: Int32, heads_per_group: Int32) -> tuple:
    """(m_block, head, batch) of this CTA's half of pair number `pair`: the pair's rank comes from the same grouped
    order as `tile_coords` (one "tile" per pair of Q tiles), the CTA's rank in its cluster picks the even or odd tile.
    With an odd number of Q tiles the last pair's second tile lies past Sq: its loads read zeros and its stores are
    clipped."""
    pair_rank, head, batch = tile_coords(pair, None, num_pairs, num_heads, num_hb, heads_per_group)
    return pair_rank * 2 + Int32(cute.arch.block_idx()[0]) % 2, head, batch


@cute.jit
def claim_tile(counter: cute.Tensor, num_tiles: Int32) -> Int32:
    """The tile this CTA takes after its current one (>= num_tiles: none left); called by a whole warp, once per tile.

    Tiles below the grid size G are the CTAs' first ones, so claim k returns tile G + k. Every CTA claims once per tile
    it runs, its last claim coming back empty: exactly num_tiles claims in all, and the one that reads num_tiles - 1
    is the last touch of the counter in this launch. It puts the counter back to 0 for the next launch on the stream."""
    old = Int32(0)
    if cute.arch.lane_idx() == 0:
        old = Int32(cute.arch.atomic_add(counter.iterator, Int32(1), sem="relaxed", scope="gpu"))
        if old == num_tiles - 1:
            counter[0] = Int32(0)
    old = cute.arch.shuffle_sync(old, 0)
    return old + Int32(cute.arch.grid_dim()[0])


@cute.jit
def hand_over_tile(pipe, slots: cute.Tensor, slot, sched: Optional[KvSchedule], m_block: Int32 = 0, head: Int32 = 0,
                   batch: Int32 = 0):
    """Producer warp: write a tile (or, `sched=None`, the end of the work) into the next slot and mark it full."""
    valid = sched is not None
    counts = (sched.num_partial, sched.num_full) if valid else (Int32(0), Int32(0))
    hand_over_words(pipe, slots, slot, (Int32(1 if valid else 0), Int32(m_block), Int32(head), Int32(batch)) + counts)


@cute.jit
def hand_over_words(pipe, slots: cute.Tensor, slot, words: tuple):
    """Producer warp: `words` (valid first, then the tile's coordinates) into the next slot, marked full once
    written. The backward hands over (valid, KV tile, KV head, batch)."""
    pipe.producer_acquire(slot)
    if cute.arch.lane_idx() == 0:
        for k in cutlass.range_constexpr(len(words)):
            slots[k, slot.index] = words[k]
        pipe.producer_commit(slot)


@cute.jit
def take_tile(pipe, slots: cute.Tensor, slot) -> tuple:
    """Consumer threads: (valid, m_block, head, batch, (partial blocks, full blocks)) from the slot."""
    pipe.consumer_wait(slot)
    valid, m_block, head, batch = (Int32(slots[k, slot.index]) for k in range(4))
    known = tuple(Int32(slots[k, slot.index]) for k in range(4, 6))
    pipe.consumer_release(slot)
    return valid, m_block, head, batch, known


def consumer_state_at(stages: int, uses: Int32):
    """The consumer's pipeline state after `uses` stages of a `stages`-deep ring, rebuilt from that one count: a
    persistent backward CTA carries its tile count through its tiles rather than the K/V and tile-slot states (three
    registers each, carried through every step otherwise)."""
    return pipeline.PipelineState(stages, uses, uses % stages, (uses // stages) % 2)
