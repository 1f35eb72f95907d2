"""The backward's producer warp: K and V once per KV tile, then one (Q, dO) tile pair per step into the stage ring.

With `BwdConfig.stats_in_smem` each stage also receives the step's LSE2 and D rows (tile_m fp32 each, one bulk copy
apiece, completing on the stage's barrier), so the consumers read them from shared memory instead of waiting on
per-thread global loads after the S^T and dP^T GEMMs. Producer and consumers walk the same `KvSchedule`, so they
visit the same query tiles without talking to each other.

Methods of `FlexBwdSm90` (a mixin): they read the kernel's static configuration from `self`.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync

from .block_sparse import KvSchedule
from .config import TILE_SLOT_WORDS, TILE_SLOTS
from .layout import tma_tiles
from .split_tail import TailPiece
from .stage_waits import acquire_empty
from .tile_scheduler import claim_tile, hand_over_words


class BwdProducer:
    """TMA loads of the backward kernel (mixed into `FlexBwdSm90`)."""

    @cute.jit
    def load(self, mQ, mK, mV, mdO, sQ, sK, sV, sdO, tma_q, tma_k, tma_v, tma_do, pipe_kv, pipe_qdo,
             n_block: Int32, head_kv: Int32, batch: Int32, qhead_per_kvhead: Int32, num_m_blocks: Int32, sparse,
             stats, tiles, piece=None):
        """Producer warp: this CTA's KV tile, or (`BwdConfig.persistent_ctas`) its block index first and then every
        tile the counter hands out, each passed on to the consumers and the dQ warp before its loads.

        `stats`: None, or (mLSE2, mDpsum, sLSE2, sDpsum) when the row statistics travel through shared memory;
        `tiles`: None, or (tile counter, tile count, slot pipeline, slot words, tile order, KV tiles, KV heads);
        `piece`: None, or (`split_tail`) the shape of the cut tail (`TailPiece.of_this_cta`): this CTA loads its
        part's steps alone."""
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        if cutlass.const_expr(tiles is not None):
            counter, num_tiles, pipe_tile, slots = tiles[0], tiles[1], tiles[2], tiles[3]
            slot = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, TILE_SLOTS)
            work = Int32(cute.arch.block_idx()[0])
            while work < num_tiles:
                # Claimed now, used after this tile's loads: the atomic's round trip hides behind them.
                next_work = claim_tile(counter, num_tiles)
                n_block, head_kv, batch = self.work_coords(work, tiles)
                hand_over_words(pipe_tile, slots, slot, (Int32(1), n_block, head_kv, batch, Int32(0), Int32(0)))
                slot.advance()
                kv_state, state = self.load_tile(mQ, mK, mV, mdO, sQ, sK, sV, sdO, tma_q, tma_k, tma_v, tma_do,
                                                 pipe_kv, pipe_qdo, n_block, head_kv, batch, qhead_per_kvhead,
                                                 num_m_blocks, sparse, stats, kv_state, state)
                work = next_work
            hand_over_words(pipe_tile, slots, slot, tuple(Int32(0) for _ in range(TILE_SLOT_WORDS)))
        else:
            self.load_tile(mQ, mK, mV, mdO, sQ, sK, sV, sdO, tma_q, tma_k, tma_v, tma_do, pipe_kv, pipe_qdo, n_block,
                           head_kv, batch, qhead_per_kvhead, num_m_blocks, sparse, stats, kv_state, state, piece)

    @cute.jit
    def work_coords(self, work: Int32, tiles) -> tuple:
        """(KV tile, KV head, batch) of work item `work`: a row of the launcher's order, or KV tiles fastest."""
        order, num_n_blocks, num_kv_heads = tiles[4], tiles[5], tiles[6]
        if cutlass.const_expr(order is not None):
            return Int32(order[work, 0]), Int32(order[work, 1]), Int32(order[work, 2])
        hb = work // num_n_blocks
        return work - hb * num_n_blocks, hb % num_kv_heads, hb // num_kv_heads

    @cute.jit
    def load_tile(self, mQ, mK, mV, mdO, sQ, sK, sV, sdO, tma_q, tma_k, tma_v, tma_do, pipe_kv, pipe_qdo,
                  n_block: Int32, head_kv: Int32, batch: Int32, qhead_per_kvhead: Int32, num_m_blocks: Int32, sparse,
                  stats, kv_state, state, piece=None):
        """K and V of one KV tile (once the consumers have released the last tile's), then (Q, dO[, LSE2, D]) per
        query tile of every query head in the GQA group. Returns the advanced pipeline states."""
        gK = cute.local_tile(mK[None, None, head_kv, batch], (self.tile_n, self.head_dim), (n_block, 0))
        gV = cute.local_tile(mV[None, None, head_kv, batch], (self.tile_n, self.head_dim), (n_block, 0))
        tKsK, tKgK = tma_tiles(tma_k, sK, gK)
        tVsV, tVgV = tma_tiles(tma_v, sV, gV)
        pipe_kv.producer_acquire(kv_state)
        cute.copy(tma_k, tKgK, tKsK, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
        cute.copy(tma_v, tVgV, tVsV, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
        kv_state.advance()

        for g in cutlass.range(qhead_per_kvhead, unroll=1):
            head = head_kv * qhead_per_kvhead + g
            gQ = cute.local_tile(mQ[None, None, head, batch], (self.tile_m, self.head_dim), (None, 0))
            gdO = cute.local_tile(mdO[None, None, head, batch], (self.tile_m, self.head_dim), (None, 0))
            tQsQ, tQgQ = tma_tiles(tma_q, sQ, gQ)
            tdOsdO, tdOgdO = tma_tiles(tma_do, sdO, gdO)
            sched = self.head_schedule(sparse, batch, head, g, n_block, num_m_blocks, piece)
            for i in cutlass.range(sched.total, unroll=1):
                m_block = sched.block(i)
                if cutlass.const_expr(self.split_qdo):
                    # dO's half first: the consumers free it before Q's (`QdoStages.release_do`)
                    pipe_qdo.acquire_do(state)
                    bar, bar_do = pipe_qdo.producer_get_barrier(state), pipe_qdo.do_barrier(state)
                    cute.copy(tma_do, tdOgdO[None, m_block], tdOsdO[None, state.index], tma_bar_ptr=bar_do)
                    pipe_qdo.acquire_q(state)
                    cute.copy(tma_q, tQgQ[None, m_block], tQsQ[None, state.index], tma_bar_ptr=bar)
                else:
                    acquire_empty(pipe_qdo, state, self.try_wait_first)
                    bar = bar_do = pipe_qdo.producer_get_barrier(state)
                    cute.copy(tma_q, tQgQ[None, m_block], tQsQ[None, state.index], tma_bar_ptr=bar)
                    cute.copy(tma_do, tdOgdO[None, m_block], tdOsdO[None, state.index], tma_bar_ptr=bar_do)
                if cutlass.const_expr(stats is not None):
                    self.load_row_stats(stats, batch, head, m_block, state.index, bar, bar_do)
                state.advance()
        return kv_state, state

    def head_schedule(self, sparse, batch: Int32, head: Int32, g: Int32, n_block: Int32, num_m_blocks: Int32,
                      piece) -> KvSchedule:
        """The query tiles KV tile `n_block` visits for query head `head` (the group's `g`-th), walked alike by the
        producer, the consumers and the dQ warp: all of them, or (`piece`, the cut tail's shape; dense) this CTA's
        share. (The CTA's `TailPiece` is rebuilt here from its index, not kept live through the steps.)"""
        rotate = self.cfg.rotate_dense_walk and sparse is None
        if cutlass.const_expr(piece is None):
            return KvSchedule(sparse, batch, head, n_block, num_m_blocks, rotate=rotate)
        part = TailPiece.of_this_cta(*piece).head_steps(g, num_m_blocks)
        return KvSchedule(sparse, batch, head, n_block, num_m_blocks, part=part, rotate=rotate)

    @cute.jit
    def load_row_stats(self, stats, batch: Int32, head: Int32, m_block: Int32, stage: Int32, bar, bar_do):
        """LSE2 and D of the step's tile_m query rows -> this stage's slots (bulk copies on the stage barriers, LSE2's
        with Q on `bar`, D's with dO on `bar_do`, whose expected byte counts include them: `FlexBwdSm90.stats_bytes`).

        The rows exist for every listed query tile: the launcher pads both buffers to whole tiles (and mask blocks).
        Non-tensor bulk copies are not elected by the DSL, so one lane issues them."""
        mLSE2, mDpsum, sLSE2, sDpsum = stats
        atom = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), mLSE2.element_type)
        pairs = ((mLSE2, sLSE2, bar), (mDpsum, sDpsum, bar_do))
        with cute.arch.elect_one():
            for k in cutlass.range_constexpr(2):
                src, dst, on = pairs[k]
                rows = cute.local_tile(src[batch, head, None], (self.tile_m,), (m_block,))
                cute.copy(atom, cute.group_modes(rows, 0, 1), cute.group_modes(dst[None, stage], 0, 1), mbar_ptr=on)
