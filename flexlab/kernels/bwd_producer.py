"""The backward's producer warp: K and V once per CTA, then one (Q, dO) tile pair per step into the stage ring.

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
from .layout import tma_tiles
from .stage_waits import acquire_empty


class BwdProducer:
    """TMA loads of the backward kernel (mixed into `FlexBwdSm90`)."""

    @cute.jit
    def load(self, mQ, mK, mV, mdO, sQ, sK, sV, sdO, tma_q, tma_k, tma_v, tma_do, pipe_kv, pipe_qdo,
             n_block: Int32, head_kv: Int32, batch: Int32, qhead_per_kvhead: Int32, num_m_blocks: Int32, sparse,
             stats):
        """Producer warp: K and V once, then (Q, dO[, LSE2, D]) per query tile of every query head in the GQA group.

        `stats`: None, or (mLSE2, mDpsum, sLSE2, sDpsum) when the row statistics travel through shared memory."""
        gK = cute.local_tile(mK[None, None, head_kv, batch], (self.tile_n, self.head_dim), (n_block, 0))
        gV = cute.local_tile(mV[None, None, head_kv, batch], (self.tile_n, self.head_dim), (n_block, 0))
        tKsK, tKgK = tma_tiles(tma_k, sK, gK)
        tVsV, tVgV = tma_tiles(tma_v, sV, gV)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pipe_kv.producer_acquire(kv_state)
        cute.copy(tma_k, tKgK, tKsK, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
        cute.copy(tma_v, tVgV, tVsV, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        for g in cutlass.range(qhead_per_kvhead, unroll=1):
            head = head_kv * qhead_per_kvhead + g
            gQ = cute.local_tile(mQ[None, None, head, batch], (self.tile_m, self.head_dim), (None, 0))
            gdO = cute.local_tile(mdO[None, None, head, batch], (self.tile_m, self.head_dim), (None, 0))
            tQsQ, tQgQ = tma_tiles(tma_q, sQ, gQ)
            tdOsdO, tdOgdO = tma_tiles(tma_do, sdO, gdO)
            sched = KvSchedule(sparse, batch, head, n_block, num_m_blocks)
            for i in cutlass.range(sched.total, unroll=1):
                m_block = sched.block(i)
                acquire_empty(pipe_qdo, state, self.try_wait_first)
                bar = pipe_qdo.producer_get_barrier(state)
                cute.copy(tma_q, tQgQ[None, m_block], tQsQ[None, state.index], tma_bar_ptr=bar)
                cute.copy(tma_do, tdOgdO[None, m_block], tdOsdO[None, state.index], tma_bar_ptr=bar)
                if cutlass.const_expr(stats is not None):
                    self.load_row_stats(stats, batch, head, m_block, state.index, bar)
                state.advance()

    @cute.jit
    def load_row_stats(self, stats, batch: Int32, head: Int32, m_block: Int32, stage: Int32, bar):
        """LSE2 and D of the step's tile_m query rows -> this stage's slots (bulk copies on the stage barrier, whose
        expected byte count includes them: `FlexBwdSm90.stats_bytes`).

        The rows exist for every listed query tile: the launcher pads both buffers to whole tiles (and mask blocks).
        Non-tensor bulk copies are not elected by the DSL, so one lane issues them."""
        mLSE2, mDpsum, sLSE2, sDpsum = stats
        atom = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), mLSE2.element_type)
        pairs = ((mLSE2, sLSE2), (mDpsum, sDpsum))
        with cute.arch.elect_one():
            for k in cutlass.range_constexpr(2):
                src, dst = pairs[k]
                rows = cute.local_tile(src[batch, head, None], (self.tile_m,), (m_block,))
                cute.copy(atom, cute.group_modes(rows, 0, 1), cute.group_modes(dst[None, stage], 0, 1), mbar_ptr=bar)
