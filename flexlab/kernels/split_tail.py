"""The last wave of a grid split over every SM: the forward's by KV blocks (`FwdConfig.split_tail`), the backward's
by query steps (`TailPiece`, at the end).

A persistent grid of G workers (CTAs, or 2-CTA clusters walking pairs of Q tiles) over N tiles runs ceil(N / G)
rounds, and when N is not a multiple of G the last round leaves SMs idle: 2048 tiles of a dense B4·S4k row on 132
SMs take 16 rounds for 15.5 rounds of work. Here the whole rounds stay one tile per worker, and the tiles after them
(the "tail") are cut into one even run of KV blocks per worker, so every worker ends at about the same time.

  * The tail is the N mod G last tiles, plus one more round of G when that remainder is under half a round: each
    worker's run then spans between half a tile and one and a half tiles, so a tile is cut into at most three parts
    and a worker holds at most two parts of cut tiles (its first and its last unit). A grid with fewer tiles than
    workers puts them all in the tail: runs are shorter, a tile has more parts, and the merge takes any number.
  * A worker computes each part of a cut tile as a tile of its own (same K/V pipeline, same softmax), normalises it,
    and publishes O (fp32, in its register order) and the LSE rows to its slot of a global workspace. It then counts
    itself in on the tile's arrival counter. Whichever part arrives last merges them all (O = sum of exp(lse_p - lse)
    O_p) and stores O and the LSE as a whole tile would. No worker ever waits for another.
  * The merge reads every part back from the workspace, its own included, in worker order: the result then has the
    same bits whichever part arrived last, so a call repeats bitwise (folding the others into its own registers
    would round in an order that changes with the arrival order from launch to launch).
  * The last arrival puts the counter back to 0, so the workspace is ready for the next launch on the stream.

Workspace (`runtime.launch.scheduler_workspace`, sized by `FwdConfig.split_tail_workspace`): `arrivals` int32, one
per tail tile and CTA of a cluster; `partials` fp32, `SPLIT_TAIL_SLOTS` slots per CTA. The backward's parts publish
and count themselves in the same way (`publish`, `arrive`), and their sums are added (`add_parts`).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .carry import Carried
from .config import SPLIT_TAIL_SLOTS
from .layout import rows_view
from .named_barrier import FwdBarrier
from .softmax import rescale_rows


class SplitTail(Carried):
    """Trace-time helper: the tail's shape for one launch, built the same way by the producer and the consumers.

    `num_tiles`: tiles (or pairs) of the grid; `workers`: CTAs (or clusters); `worker`: this one; `blocks`: KV blocks
    per tile (dense: every tile the same)."""

    _FIELDS = ("blocks", "worker", "whole_end", "iters", "sharers", "begin", "end")

    def __init__(self, num_tiles: Int32, workers: Int32, worker: Int32, blocks: Int32):
        rem = num_tiles % workers
        # one more round in the tail when the remainder is under half a round (and there is a whole round to take)
        extra = _where(rem * 2 < workers, workers, 0)
        extra = _where(num_tiles >= rem + workers, extra, 0)
        tail = rem + _where(rem > 0, extra, 0)
        self.blocks = blocks
        self.worker = worker
        self.whole_end = num_tiles - tail  # tiles below this run whole, one per worker per round
        self.iters = tail * blocks  # KV blocks in the tail, numbered tile by tile
        # workers with a run: all of them unless the tail has fewer blocks than there are workers (then one each)
        self.sharers = _where(self.iters < workers, self.iters, workers)
        self.sharers = _where(self.sharers < 1, 1, self.sharers)
        self.begin = self.run_start(worker)
        self.end = self.run_start(worker + 1)

    def run_start(self, worker: Int32) -> Int32:
        """First tail block of `worker`'s run (runs are as even as integer division makes them; workers past the
        sharers have empty runs at the end)."""
        return _where(worker < self.sharers, worker, self.sharers) * self.iters // self.sharers

    def worker_of(self, it: Int32) -> Int32:
        """The worker whose run holds tail block `it`; the workers from one block's to another's all hold a part of
        the blocks between (no run is empty below the sharers)."""
        return ((it + 1) * self.sharers - 1) // self.iters

    def unit(self, it: Int32) -> tuple:
        """(tail tile, first position, end position) of the unit starting at tail block `it` of this worker's run:
        positions count a tile's KV blocks in the kernel's visiting order."""
        t = it // self.blocks
        return t, it - t * self.blocks, _where(self.end - t * self.blocks < self.blocks, self.end - t * self.blocks,
                                               self.blocks)

    def slot_of(self, worker: Int32, t: Int32) -> Int32:
        """Which of `worker`'s two slots holds its part of tail tile `t`: 0 if that part is its run's first unit."""
        return _where(self.run_start(worker) // self.blocks == t, 0, 1)


class TailPiece(Carried):
    """The backward's form of the split tail: one CTA per KV tile, the first `whole` tiles in one kernel
    (`BwdConfig.whole_tiles_only`) and the tiles after them in a second one launched behind it
    (`BwdConfig.split_tail`), `parts` CTAs per tile, each walking an even share of the tile's `steps` query steps
    (numbered across the GQA group, head by head). The launcher picks `parts` so those shares fill the last waves
    evenly (`bwd_config.split_parts`). dK and dV of a cut tile are sums over its steps: each part publishes its own,
    and the last to arrive adds all of them in part order (the same bits whichever came last) and stores them. Built
    from the CTA index of the second kernel by every warp; on Python ints too (the host-side tests).

    `tile`: the KV tile (in the first kernel's launch order) this CTA works on; [`lo`, `hi`): its steps; `t`: the
    tile's place among the cut ones (its arrival counter); `part`: which part of it this is."""

    _FIELDS = ("tile", "lo", "hi", "t", "part", "parts")

    def __init__(self, piece: Int32, whole: Int32, parts: Int32, steps: Int32):
        self.parts = parts
        self.t = piece // parts
        self.part = piece - self.t * parts
        self.tile = whole + self.t
        self.lo = self.part * steps // parts
        self.hi = (self.part + 1) * steps // parts

    @staticmethod
    def of_this_cta(whole: Int32, parts: Int32, steps: Int32) -> "TailPiece":
        """The piece of the CTA running this code (the second kernel's 1-D grid: one CTA per piece)."""
        return TailPiece(Int32(cute.arch.block_idx()[0]), whole, parts, steps)

    def slot(self, part: Int32) -> Int32:
        """The workspace slot of `part` of this CTA's tile (one per CTA of the cut waves)."""
        return self.t * self.parts + part

    def head_steps(self, g: Int32, num_m_blocks: Int32) -> tuple:
        """(first, end) of this CTA's steps among query head `g`'s of the group (`KvSchedule`'s `part`; empty
        where the range misses that head)."""
        base = g * num_m_blocks
        first = _clamp(self.lo - base, 0, num_m_blocks)
        return _uniform(first), _uniform(_clamp(self.hi - base, first, num_m_blocks))


@cute.jit
def publish_and_arrive(split: SplitTail, workspace, flag: cute.Tensor, acc_o: cute.Tensor, lse: cute.Tensor,
                       t: Int32, rank: Int32, cluster_m: cutlass.Constexpr[int], tidx: Int32,
                       num_threads: cutlass.Constexpr[int]) -> Int32:
    """Consumer threads: write this part of tail tile `t` to our slot, count it in, and return 1 in every thread if
    this part arrived last (it then merges the others, `merge_parts`), else 0."""
    arrivals, partials = workspace
    cta = split.worker * cluster_m + rank
    base = (cta * SPLIT_TAIL_SLOTS + split.slot_of(split.worker, t)) * _slot_words((acc_o, lse), num_threads)
    publish(partials, base, (acc_o, lse), tidx, num_threads)

    def which():  # (the tile's counter, how many parts it has)
        parts = split.worker_of((t + 1) * split.blocks - 1) - split.worker_of(t * split.blocks) + 1
        return t * cluster_m + rank, parts
    return arrive(arrivals, which, flag, tidx, int(FwdBarrier.SPLIT_TAIL), num_threads)


@cute.jit
def publish(partials: cute.Tensor, base: Int32, frags: tuple, tidx: Int32, num_threads: cutlass.Constexpr[int]):
    """Write this thread's fragments (fp32 register tensors) to the slot at `base`, element k of all threads side by
    side (coalesced), one fragment after another."""
    offset = 0
    for f in cutlass.range_constexpr(len(frags)):
        frag = frags[f]
        for k in cutlass.range_constexpr(cute.size(frag)):
            partials[base + (offset + k) * num_threads + tidx] = frag[k]
        offset += cute.size(frag)


@cute.jit
def arrive(arrivals: cute.Tensor, which, flag: cute.Tensor, tidx: Int32, barrier_id: cutlass.Constexpr[int],
           num_threads: cutlass.Constexpr[int]) -> Int32:
    """After `publish`: count this part in on its tile's arrival counter; 1 in every thread if it came last of the
    tile's parts (the counter is then put back to 0 for the next launch, and the other parts' writes are visible),
    else 0. `which()` gives (counter, parts), worked out by the one thread that counts; `flag`: one int32 of shared
    memory the threads share the answer through."""
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=num_threads)
    if tidx == 0:
        counter, parts = which()
        cute.arch.fence_acq_rel_gpu()  # every consumer's writes (ordered before the barrier) before the count
        old = Int32(cute.arch.atomic_add(arrivals.iterator + counter, Int32(1), sem="relaxed", scope="gpu"))
        last = Int32(0)
        if old == parts - 1:
            last = Int32(1)
            arrivals[counter] = Int32(0)  # every part is in: ready for the next launch
            cute.arch.fence_acq_rel_gpu()  # the other parts' writes before our reads of them
        flag[0] = last
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=num_threads)
    return Int32(flag[0])


@cute.jit
def merge_parts(split: SplitTail, workspace, acc_o: cute.Tensor, lse: cute.Tensor, t: Int32, rank: Int32,
                cluster_m: cutlass.Constexpr[int], tidx: Int32, num_threads: cutlass.Constexpr[int]):
    """The last part of tail tile `t`: merge every worker's part, this one's included, into this thread's O rows and
    LSE (natural log, -inf for a row no part saw a key of), in worker order from the workspace, two at a time."""
    _, partials = workspace
    n_o = cute.size(acc_o)
    n_rows = cute.size(lse)
    words = _slot_words((acc_o, lse), num_threads)
    log2_e = Float32(1.4426950408889634)
    part = cute.make_rmem_tensor_like(acc_o, Float32)
    w_own = cute.make_rmem_tensor_like(lse, Float32)
    w_part = cute.make_rmem_tensor_like(lse, Float32)
    first = split.worker_of(t * split.blocks)
    last = split.worker_of((t + 1) * split.blocks - 1)
    base = ((first * cluster_m + rank) * SPLIT_TAIL_SLOTS + split.slot_of(first, t)) * words
    for k in cutlass.range_constexpr(n_o):
        acc_o[k] = partials[base + k * num_threads + tidx]
    for r in cutlass.range_constexpr(n_rows):
        lse[r] = partials[base + (n_o + r) * num_threads + tidx]
    for w in cutlass.range(first + 1, last + 1, unroll=1):
        base = ((w * cluster_m + rank) * SPLIT_TAIL_SLOTS + split.slot_of(w, t)) * words
        for k in cutlass.range_constexpr(n_o):
            part[k] = partials[base + k * num_threads + tidx]
        for r in cutlass.range_constexpr(n_rows):
            other = Float32(partials[base + (n_o + r) * num_threads + tidx])
            high = cutlass.max(lse[r], other)
            if high == -Float32.inf:  # neither part saw a key of this row: O stays 0, the LSE -inf
                w_own[r] = Float32(1.0)
                w_part[r] = Float32(0.0)
            else:
                a = cute.math.exp2((lse[r] - high) * log2_e, fastmath=True)
                b = cute.math.exp2((other - high) * log2_e, fastmath=True)
                total = a + b
                w_own[r] = a / total
                w_part[r] = b / total
                lse[r] = high + cute.math.log2(total, fastmath=True) / log2_e
        rescale_rows(acc_o, w_own)
        rescale_rows(part, w_part)
        o_rows, p_rows = rows_view(acc_o), rows_view(part)
        for r in cutlass.range_constexpr(n_rows):
            o_rows[r, None].store(o_rows[r, None].load() + p_rows[r, None].load())


@cute.jit
def publish_sums(piece: TailPiece, workspace, flag: cute.Tensor, frags: tuple, tidx: Int32,
                 barrier_id: cutlass.Constexpr[int], num_threads: cutlass.Constexpr[int]) -> Int32:
    """A part of a cut backward tile: publish its dK and dV sums (`frags`), count it in, and return 1 in every
    consumer thread if it came last (it then adds all parts, `add_parts`, and stores), else 0."""
    arrivals, partials = workspace
    publish(partials, piece.slot(piece.part) * _slot_words(frags, num_threads), frags, tidx, num_threads)
    return arrive(arrivals, lambda: (piece.t, piece.parts), flag, tidx, barrier_id, num_threads)


@cute.jit
def add_parts(piece: TailPiece, workspace, frags: tuple, tidx: Int32, num_threads: cutlass.Constexpr[int]):
    """The last part of a cut backward tile: sum every part's published dK and dV, this one's included, in part
    order into this thread's fragments, so the sums have the same bits whichever part arrived last."""
    _, partials = workspace
    words = _slot_words(frags, num_threads)
    _read_slot(partials, piece.slot(0) * words, frags, tidx, num_threads, False)
    for j in cutlass.range(1, piece.parts, unroll=1):
        _read_slot(partials, piece.slot(j) * words, frags, tidx, num_threads, True)


@cute.jit
def _read_slot(partials: cute.Tensor, base: Int32, frags: tuple, tidx: Int32, num_threads: cutlass.Constexpr[int],
               add: cutlass.Constexpr[bool]):
    """This thread's elements of the slot at `base` (laid out as `publish` writes them) into `frags`, or with `add`
    added to them."""
    offset = 0
    for f in cutlass.range_constexpr(len(frags)):
        frag = frags[f]
        for k in cutlass.range_constexpr(cute.size(frag)):
            value = partials[base + (offset + k) * num_threads + tidx]
            frag[k] = frag[k] + value if add else value
        offset += cute.size(frag)


def _where(cond, a, b):
    """`a if cond else b` for DSL values in a kernel, and for Python ints (the host-side tests of the partition)."""
    if isinstance(cond, bool):
        return a if cond else b
    return Int32(cutlass.select_(cond, Int32(a), Int32(b)))


def _uniform(x):
    """`x` marked warp-uniform in a kernel (loop bounds and tile coordinates then live in uniform registers, as a
    grid's block index does); Python ints as they are."""
    return x if isinstance(x, int) else cute.arch.make_warp_uniform(x)


def _clamp(x, low, high):
    """`x` limited to [low, high], for DSL values and Python ints alike."""
    x = _where(x < low, low, x)
    return _where(x > high, high, x)


def _slot_words(frags: tuple, num_threads: int) -> int:
    """fp32 words of one published part: every consumer thread's fragments (the forward's O and LSE rows, the
    backward's dK and dV)."""
    return num_threads * sum(cute.size(f) for f in frags)
