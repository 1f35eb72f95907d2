"""Which KV blocks one Q tile visits, in which order, and whether each needs mask_mod.

With a BlockMask, a Q tile visits its partial blocks (`kv_indices`, mask_mod applied) and then its full blocks
(`full_kv_indices`, no mask_mod); empty blocks are never listed, so never loaded. Without one, it visits every KV
block from the last to the first. Either way the only block that needs the sequence-tail mask comes first: the host
lists a ragged last KV block first among the partial ones (`runtime.sparsity.kernel_block_mask`).
Producer and consumers build the same `KvSchedule`, so they walk the same list without talking to each other.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .carry import Carried


class KvSchedule(Carried):
    """Trace-time helper; `sparse` is None (dense) or (kv_num, kv_idx, full_num, full_idx) int32 tensors whose batch
    and head modes may have size 1 (broadcast)."""

    _FIELDS = ("sparse", "b", "h", "m", "num_partial", "num_full", "num_kv_blocks")

    def __init__(self, sparse, batch: Int32, head: Int32, m_block: Int32, num_kv_blocks: Int32):
        self.sparse = sparse
        self.num_kv_blocks = Int32(num_kv_blocks)
        self.m = m_block
        if cutlass.const_expr(sparse is not None):
            kv_num, _, full_num, _ = sparse
            # A mask built with B=1 or H=1 broadcasts over that mode.
            self.b = batch % kv_num.shape[0]
            self.h = head % kv_num.shape[1]
            self.num_partial = Int32(kv_num[self.b, self.h, m_block])
            self.num_full = Int32(full_num[self.b, self.h, m_block])
        else:
            self.b, self.h = Int32(0), Int32(0)
            self.num_partial = Int32(0)
            self.num_full = self.num_kv_blocks

    @property
    def total(self):
        return self.num_partial + self.num_full

    @cute.jit
    def block(self, i: Int32) -> Int32:
        """KV block index of step i (partial blocks first)."""
        if cutlass.const_expr(self.sparse is None):
            return self.num_kv_blocks - 1 - i
        else:
            _, kv_idx, _, full_idx = self.sparse
            j = i - self.num_partial
            n = Int32(0)
            if i < self.num_partial:
                n = Int32(kv_idx[self.b, self.h, self.m, i])
            else:
                n = Int32(full_idx[self.b, self.h, self.m, j])
            return n
