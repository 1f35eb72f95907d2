"""The backward's dQ path: one query tile's fp32 dQ partial, from registers to the global accumulator.

Several KV tiles (CTAs) add into the same dQ rows, so each step's partial goes registers -> shared memory -> one TMA
reduce-add per consumer warpgroup into the fp32 `dQaccum` buffer (`bwd_postprocess` scales and converts it). In
deterministic mode the reduce of query tile m waits (acquire) until every lower KV tile that visits m has reduced its
part, and signals (release) once its own has landed, so the fp32 sums are added in one fixed order.

Methods of `FlexBwdSm90` (a mixin): they read the kernel's static configuration from `self`.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .named_barrier import BwdBarrier


def dq_issuer():
    """True in the first warp of each consumer warpgroup, which issues that warpgroup's dQ reduce.

    A whole warp, not one thread: the TMA reduce copy elects its issuing lane with `elect.sync` over the full warp,
    which never completes when only one lane reaches it. The test reads only bits 5 and 6 of the thread index (the
    warp's place in its warpgroup), so it is the same in every lane and the branch stays convergent. Recomputed at
    each use rather than kept live through the main loop: at D=128 with a block mask even that one register made the
    consumers spill."""
    return (cute.arch.thread_idx()[0] % 128) < 32


class BwdDqReduce:
    """dQ partial -> shared memory -> TMA reduce-add (mixed into `FlexBwdSm90`)."""

    @cute.jit
    def reduce_dq(self, acc_dQ, tdQsdQ, tdQs, tdQg, tma_dq, m_block: Int32, order, batch: Int32, head: Int32,
                  wg: Int32):
        """Write this warpgroup's dQ partial to its shared-memory slab and add it into global memory with TMA.

        The caller has made sure the previous reduce finished reading the slab (`wait_dq_slab_free` before a barrier
        the whole warpgroup passes)."""
        cute.autovec_copy(acc_dQ, tdQsdQ)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=int(BwdBarrier.DQ_READY_WG1) + wg, number_of_threads=128)
        if dq_issuer():
            if cutlass.const_expr(self.deterministic):
                self.wait_dq_turn(order, batch, head, m_block, wg)
                cute.arch.sync_warp()  # every lane has seen the turn before the warp-collective copy
                cute.arch.fence_proxy("async.global")  # the acquire orders the TMA (async proxy) reduce too
            cute.copy(tma_dq, tdQs, tdQg[None, self.dq_tile_index(m_block, wg)])  # elects one lane itself
            # Every lane commits and waits on its own bulk group (empty for the lanes that issued nothing), so the
            # lane the copy elected is always covered without knowing which one it was.
            cute.arch.cp_async_bulk_commit_group()
            if cutlass.const_expr(self.deterministic):
                cute.arch.cp_async_bulk_wait_group(0, read=False)  # the reduce has landed in global memory
                cute.arch.fence_proxy("async.global")  # ... and is ordered before the generic-proxy release
                cute.arch.sync_warp()
                if cute.arch.lane_idx() == 0:
                    mdQsem = order[0]
                    sem = mdQsem.iterator + cute.crd2idx((batch, head, m_block, wg), mdQsem.layout)
                    cute.arch.red(sem, Int32(1), op="add", dtype=Int32, sem="release", scope="gpu")

    def dq_tile_index(self, m_block: Int32, wg: Int32):
        """Which of the (dq_rows, dq_cols) global boxes `tdQg` was cut into this warpgroup reduces into."""
        if cutlass.const_expr(self.dq_split_rows):
            return m_block * self.num_wg + wg  # boxes of 64 rows x head_dim: warpgroup wg has rows 64 wg .. 64 wg + 63
        return m_block  # boxes of tile_m rows x (head_dim / warpgroups); the column block was chosen per warpgroup

    @cute.jit
    def wait_dq_slab_free(self):
        """The previous dQ reduce of this warpgroup has finished reading its shared-memory slab (issuing warp only;
        a later barrier passes that on to the whole warpgroup)."""
        if dq_issuer():
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def wait_dq_turn(self, order, batch: Int32, head: Int32, m_block: Int32, wg: Int32):
        """Spin until every lower KV tile that visits this Q tile has reduced its dQ part (acquire).

        CTAs are launched so that the ones waited for were launched earlier (lower KV tile, same head and batch),
        so they can always finish."""
        mdQsem, mRank, rank_b, rank_h, n_block = order
        turn = n_block
        if cutlass.const_expr(mRank is not None):
            turn = Int32(mRank[rank_b, rank_h, n_block, m_block])
        sem = mdQsem.iterator + cute.crd2idx((batch, head, m_block, wg), mdQsem.layout)
        seen = Int32(-1)
        while seen != turn:
            seen = cute.arch.load(sem, Int32, sem="acquire", scope="gpu")
