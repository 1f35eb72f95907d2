"""Accumulating captured-tensor gradients (learnable biases) from the backward kernel, fast or bit-reproducible.

Many score elements add into one table entry: every (q, kv) on a diagonal hits the same relative-position bias, and
with offsets clipped at +-max_distance almost every score of a long row hits one of the two edge entries. One
global atomic per score then queues thousands of threads on a handful of L2 lines. So each consumer thread keeps a
*run* per gradient buffer (`GradRun`): the element it last added to and the sum so far, in registers, carried across
the steps of the CTA. An add to the same element only adds in the register; a different element first sends the
open run to global memory with one atomic. Walking a thread's scores row by row (one key, every query of the step:
`kernels.layout.row_major_order`), a per-key table, a per-head scalar or a clipped offset far from the diagonal each
make one long run. At the end (`flush_aux_grads`) a warp whose lanes all hold the same element sums it with shuffles
and adds once.

In fp32 the order of the atomics changes the rounding from run to run. For deterministic mode the buffer is int64
instead: each run's sum is rounded once to a multiple of 2^-FIXED_POINT_BITS and added as an integer, and integer
addition is associative, so the total is the same bits in any order (a thread's runs, and a warp's shuffle sums,
are formed in a fixed order). The host turns it back into floats (`from_fixed_point`). Range: |sum| < 2^(63 -
FIXED_POINT_BITS) = 2^31; resolution 2^-32 (2.3e-10).

Generated `score_mod_aux_grad` code calls `add_aux_grad(dst, coord, value)` with `dst` a gradient tensor or a
`GradRun` over one; the buffer's element type picks the mode at trace time, so one generated function serves both.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

FIXED_POINT_BITS = 32
_SCALE = float(2 ** FIXED_POINT_BITS)
_LIMIT = float(2 ** (62 - FIXED_POINT_BITS))  # clamp before converting so one add cannot overflow int64


class GradRun:
    """One consumer thread's open run over a gradient buffer: `offset` (the element, -1 before the first add) and
    `total` live in registers for the whole CTA (rmem tensors, so they need no carrying through the loops)."""

    def __init__(self, tensor: cute.Tensor):
        self.tensor = tensor
        self.offset = cute.make_rmem_tensor(1, Int32)
        self.total = cute.make_rmem_tensor(1, Float32)
        self.offset[0] = Int32(-1)
        self.total[0] = Float32(0.0)


@cute.jit
def atomic_add_grad(dst: cute.Tensor, offset, value: Float32):
    """dst's element at `offset` += value: an fp32 atomic, or an exact fixed-point integer atomic for int64 buffers."""
    ptr = dst.iterator + offset
    if cutlass.const_expr(dst.element_type is Int64):
        clamped = cutlass.max(cutlass.min(value, Float32(_LIMIT)), Float32(-_LIMIT))
        cute.arch.atomic_add(ptr, (clamped * Float32(_SCALE)).to(Int64))
    else:
        cute.arch.atomic_add(ptr, value)


@cute.jit
def add_aux_grad(dst, coord, value: Float32):
    """dst[coord] += value, where a value of 0 (a masked or padded score) adds nothing and, for a `GradRun`, leaves
    its run open: straight to global memory for a tensor, or into the thread's open run for a `GradRun` (another
    element sends the run first). Branch-free but for one predicated atomic, so that the index math and loads of
    consecutive scores can overlap."""
    if cutlass.const_expr(isinstance(dst, GradRun)):
        prev, total = dst.offset[0], dst.total[0]
        offset = cutlass.select_(value == Float32(0.0), prev, Int32(cute.crd2idx(coord, dst.tensor.layout)))
        same = offset == prev
        pending = cutlass.select_(same, Float32(0.0), total)
        if pending != Float32(0.0):
            atomic_add_grad(dst.tensor, prev, pending)
        dst.total[0] = cutlass.select_(same, total + value, value)
        dst.offset[0] = offset
    else:
        if value != Float32(0.0):
            atomic_add_grad(dst, cute.crd2idx(coord, dst.layout), value)


def accumulates_through_add_aux_grad(module) -> bool:
    """Whether a generated-mods module adds its captured-tensor gradients through `add_aux_grad` (what this code
    generator emits), the one test both the per-thread runs and deterministic mode's fixed point rely on: code that
    indexes the gradient buffers itself gets neither."""
    return getattr(module, "add_aux_grad", None) is add_aux_grad


@cute.jit
def flush_aux_grads(runs: tuple):
    """Send every open run (all lanes of the warp together): one shuffle-summed atomic where the warp's lanes hold
    the same element, one atomic per lane otherwise. The shuffles run on every lane unconditionally (no warp
    collective under a branch); only the atomics are conditional."""
    for run in cutlass.range_constexpr(len(runs)):
        offset, total = runs[run].offset[0], runs[run].total[0]
        warp_total = cute.arch.warp_reduction_sum(total)
        one_element = cute.arch.vote_all_sync(offset == cute.arch.shuffle_sync(offset, 0))
        lane_share = cutlass.select_(cute.arch.lane_idx() == 0, warp_total, Float32(0.0))
        send = cutlass.select_(one_element, lane_share, total)
        if send != Float32(0.0):
            atomic_add_grad(runs[run].tensor, offset, send)
        runs[run].offset[0] = Int32(-1)
        runs[run].total[0] = Float32(0.0)


def from_fixed_point(buffer):
    """The fp32 gradient an int64 fixed-point buffer holds (torch tensor in, torch tensor out)."""
    import torch
    return (buffer.to(torch.float64) / _SCALE).to(torch.float32)
