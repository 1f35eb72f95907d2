"""The waits and arrives on a TMA pipeline's stages, shared by the forward and backward kernels.

`try_first` (`FwdConfig.try_wait_first`, `BwdConfig.try_wait_first`): one `mbarrier.try_wait` without a
suspend-time hint comes first, and only a stage still not ready enters the wait loop whose hint lets the hardware
put the warps to sleep (NANOSLEEP.SYNCS in the SASS). FA4's kernels wait that way in effect; the plain wait sleeps at
the first miss. Trace-time choice: without it the generated code is the plain wait, unchanged.

Anchored arrives (`release_after`, `arrive_after`): ptxas keeps a `wgmma.wait_group` behind an mbarrier arrive that
precedes it in the program, but hoists arrives freely. An arrive whose count is computed from a value holds itself,
and the wait behind it, until that value exists: the one handle we have on where ptxas waits for a GEMM.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def wait_full(pipe, state, try_first: bool) -> None:
    """A consumer's wait until the stage `state` points at has been filled."""
    if try_first:
        pipe.consumer_wait(state, pipe.consumer_try_wait(state))
    else:
        pipe.consumer_wait(state)


def acquire_empty(pipe, state, try_first: bool) -> None:
    """The producer's wait until the stage `state` points at is free again."""
    if try_first:
        pipe.producer_acquire(state, pipe.producer_try_acquire(state))
    else:
        pipe.producer_acquire(state)


# Bits no arithmetic produces (the hardware's NaN is 0x7FFFFFFF): `release_after` compares against them.
_NEVER_BITS = -0x3FFFFF  # 0xFFC00001 as a signed 32-bit value


@dsl_user_op
def _float_bits(x: Float32, *, loc=None, ip=None) -> Int32:
    return Int32(llvm.inline_asm(T.i32(), [Float32(x).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=r,f",
                                 has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


def _count_after(*anchors: Float32) -> Int32:
    """1, computed from every value of `anchors` (2 only for bits no arithmetic produces). Several anchors are joined
    by OR-ing their bits, which keeps them apart from `_NEVER_BITS`: its sign bit is set, and no probability's is
    (the hardware's NaN is positive)."""
    bits = _float_bits(anchors[0])
    for a in anchors[1:]:
        bits = bits | _float_bits(a)
    return cutlass.select_(bits == Int32(_NEVER_BITS), Int32(2), Int32(1))


@cute.jit
def release_after(pipe, state, anchor: Float32):
    """`pipe.consumer_release(state)`, whose arrive ptxas cannot schedule before `anchor` is computed.

    The arrive count is 1 unless `anchor` holds bits no arithmetic produces: always 1, but ptxas must wait for
    `anchor` to know it. ptxas keeps a warpgroup's later `wgmma.wait_group` behind this arrive; left alone, it hoists
    both to the top of the forward's softmax (in every kernel but the plain dense one), so the exponentials waited
    for the P.V GEMM they were meant to overlap (`FwdConfig.anchored_release`)."""
    count = _count_after(anchor)
    if pipe.is_signaling_thread:
        cute.arch.mbarrier_arrive(pipe.sync_object_empty.get_barrier(state.index), pipe.consumer_mask,
                                  arrive_count=count)


@cute.jit
def arrive_after(mbar, anchors: list):
    """One arrive per warp on `mbar`, an mbarrier nobody waits on (initialised with count 1, so every arrive
    completes a phase), that ptxas cannot schedule before every value of `anchors` is computed: a wgmma wait that
    follows it in the program stays behind it (`BwdConfig.anchored_wait`)."""
    count = _count_after(*anchors)
    if cute.arch.lane_idx() == 0:
        cute.arch.mbarrier_arrive(mbar, arrive_count=count)


@dataclass(frozen=True)
class QdoStages:
    """The backward's Q/dO ring with Q and dO landing on separate barriers (`BwdConfig.split_qdo_wait`), shaped like
    the one pipeline it replaces: `q` (Q and the LSE2 rows) is what `consumer_wait` waits for and
    `producer_get_barrier` returns; `do` (dO and the D rows) has its own wait (`wait_do`) and barrier (`do_barrier`).
    One pipeline state walks both halves (they share stage and phase); the step releases dO's half before Q's
    (`release_do`, `release_q`) and the producer refills dO's first (`acquire_do`, `acquire_q`). (A dataclass, as the
    DSL's pipelines are, so that a loop can carry it.)"""

    q: Any
    do: Any

    def acquire_do(self, state):
        """The producer's wait for dO's half of the stage (freed first), arming its barrier."""
        self.do.producer_acquire(state)

    def acquire_q(self, state):
        self.q.producer_acquire(state)

    def producer_get_barrier(self, state):
        return self.q.producer_get_barrier(state)

    def do_barrier(self, state):
        return self.do.producer_get_barrier(state)

    def consumer_try_wait(self, state):
        return self.q.consumer_try_wait(state)

    def consumer_wait(self, state, try_token=None):
        self.q.consumer_wait(state, try_token)

    def wait_do(self, state):
        self.do.consumer_wait(state)

    def consumer_release(self, state):
        self.q.consumer_release(state)
        self.do.consumer_release(state)

    def release_do(self, state):
        """dO's half of the stage, once its last reader is done (before Q's, which dK still reads)."""
        self.do.consumer_release(state)

    def release_q(self, state):
        self.q.consumer_release(state)

