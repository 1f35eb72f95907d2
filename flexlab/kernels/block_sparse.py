"""Which KV blocks one Q tile visits, in which order, and whether each needs mask_mod.

With a BlockMask, a Q tile visits its partial blocks (`kv_indices`, mask_mod applied) and then its full blocks
(`full_kv_indices`, no mask_mod); empty blocks are never listed, so never loaded. Without one, it visits every KV
block from the last to the first. Either way the only block that needs the sequence-tail mask comes first: the host
lists a ragged last KV block first among the partial ones (`runtime.sparsity.kernel_block_mask`).
Producer and consumers build the same `KvSchedule`, so they walk the same list without talking to each other.

The first block's index is read together with the two counts, not after them: a tile's first K load waits on that
index, and reading it only once the counts said which list it is in put two global-memory round trips in front of
every tile's first TMA load (sliding windows and documents have many short tiles).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .carry import Carried


class KvSchedule(Carried):
    """Trace-time helper; `sparse` is None (dense) or (kv_num, kv_idx, full_num, full_idx) int32 tensors whose batch
    and head modes may have size 1 (broadcast), and whose last mode is never empty.

    `known` = (num_partial, num_full) when another warp already read them (a dynamic tile scheduler hands them over
    in shared memory); then nothing is read here. `part` = (first position, end position), dense only: the tile's
    steps from `first` up to `end` alone (a part of a tile cut by `kernels.split_tail`). `rotate`, dense only: the
    walk starts `m_block` (mod the block count) blocks below the last and wraps around, so that the tiles of one
    head, run side by side, each visit a different block at any one time (the backward's `rotate_dense_walk`)."""

    _FIELDS = ("sparse", "b", "h", "m", "num_partial", "num_full", "num_kv_blocks", "skip", "shift")

    def __init__(self, sparse, batch: Int32, head: Int32, m_block: Int32, num_kv_blocks: Int32, known=None,
                 part=None, rotate: bool = False):
        self.sparse = sparse
        self.num_kv_blocks = Int32(num_kv_blocks)
        self.m = m_block
        self.skip = None  # positions before this part's first (dense parts only)
        self.shift = None  # how far below the last block a rotated dense walk starts
        if cutlass.const_expr(rotate):
            if cutlass.const_expr(sparse is not None):
                raise ValueError("a rotated walk is a dense schedule only (block lists keep their order)")
            self.shift = Int32(m_block) % self.num_kv_blocks
        if cutlass.const_expr(part is not None):
            if cutlass.const_expr(sparse is not None):
                raise ValueError("a part of a tile (split_tail) is a dense schedule only")
            self.skip = Int32(part[0])
        if cutlass.const_expr(sparse is not None):
            kv_num, _, full_num, _ = sparse
            # A mask built with B=1 or H=1 broadcasts over that mode.
            self.b = batch % kv_num.shape[0]
            self.h = head % kv_num.shape[1]
            if cutlass.const_expr(known is not None):
                self.num_partial, self.num_full = (Int32(x) for x in known)
            else:
                self.num_partial = Int32(kv_num[self.b, self.h, m_block])
                self.num_full = Int32(full_num[self.b, self.h, m_block])
        else:
            self.b, self.h = Int32(0), Int32(0)
            self.num_partial = Int32(0)
            self.num_full = self.num_kv_blocks
            if cutlass.const_expr(part is not None):
                self.num_full = Int32(part[1]) - self.skip

    @cute.jit
    def first_block(self) -> Int32:
        """`block(0)` without waiting for the counts first: both lists' first entries are read beside them and one
        is picked after (the producer's first K load waits on this index)."""
        if cutlass.const_expr(self.sparse is None):
            return self._dense(0)
        else:
            _, kv_idx, _, full_idx = self.sparse
            first_partial = Int32(kv_idx[self.b, self.h, self.m, 0])
            first_full = Int32(full_idx[self.b, self.h, self.m, 0])
            return Int32(cutlass.select_(self.num_partial > 0, first_partial, first_full))

    def _dense(self, i):
        """Dense grids walk the KV blocks from the last one down (a part starts `skip` steps in; a rotated walk
        `shift` blocks lower, wrapping around to the last block after block 0)."""
        n = self.num_kv_blocks - 1 - i
        if cutlass.const_expr(self.skip is not None):
            n = n - self.skip
        if cutlass.const_expr(self.shift is not None):
            n = n - self.shift
            n = cutlass.select_(n < 0, n + self.num_kv_blocks, n)
        return n

    @property
    def total(self):
        return self.num_partial + self.num_full

    @cute.jit
    def block(self, i: Int32) -> Int32:
        """KV block index of step i (partial blocks first)."""
        if cutlass.const_expr(self.sparse is None):
            return self._dense(i)
        else:
            _, kv_idx, _, full_idx = self.sparse
            j = i - self.num_partial
            n = Int32(0)
            if i < self.num_partial:
                n = Int32(kv_idx[self.b, self.h, self.m, i])
            else:
                n = Int32(full_idx[self.b, self.h, self.m, j])
            return n

    @cute.jit
    def partial_block(self, i: Int32) -> Int32:
        """`block(i)` on a partial step, 0 on a full one: for a caller that uses the index on partial steps alone
        (a full step then reads no list)."""
        if cutlass.const_expr(self.sparse is None):
            return self._dense(i)
        else:
            _, kv_idx, _, _ = self.sparse
            n = Int32(0)
            if i < self.num_partial:
                n = Int32(kv_idx[self.b, self.h, self.m, i])
            return n

    @cute.jit
    def block_of_kind(self, i: Int32, partial: cutlass.Constexpr[bool]) -> Int32:
        """`block(i)` where the caller's loop already knows whether step i is a partial block (no branch)."""
        if cutlass.const_expr(self.sparse is None):
            return self._dense(i)
        else:
            _, kv_idx, _, full_idx = self.sparse
            if cutlass.const_expr(partial):
                return Int32(kv_idx[self.b, self.h, self.m, i])
            else:
                return Int32(full_idx[self.b, self.h, self.m, i - self.num_partial])
