"""The backward's dQ path: one query tile's fp32 dQ partial, from registers to the global accumulator.

Several KV tiles (CTAs) add into the same dQ rows, so each step's partial goes registers -> shared memory -> one TMA
reduce-add per consumer warpgroup into the fp32 `dQaccum` buffer (`bwd_postprocess` scales and converts it). In
deterministic mode the reduce of query tile m waits (acquire) until every KV tile before it in turn that visits m has
reduced its part, and signals (release) once its own has landed, so the fp32 sums are added in one fixed order (the
dQ warp issues every warpgroup's reduce of a step before waiting for them to land: `write_dq_in_turn`).

Who issues the reduce: with `BwdConfig.dq_warp` (the default, 1.01-1.29x faster main kernel), one warp of the
producer warpgroup that walks the same schedule (`write_dq`): a consumer warpgroup only writes its slab and arrives on
DQ_FULL, and waits on DQ_EMPTY before writing the next one. Without it, the first warp of each consumer warpgroup.
With `BwdConfig.dq_bulk_reduce` the slab leaves by a plain bulk reduce of its contiguous bytes instead of a TMA
tensor reduce (the same bulk group, waits and turns). With `BwdConfig.dq_red` (head dim 256) there is no slab: every
consumer thread adds its partial into `dQaccum` with 16-byte vector reductions, in the same fragment order; in
deterministic mode each warp waits for its turn and releases it itself (`red_dq`).

The partial travels in fragment order (`fragment_order`): element i of consumer thread t's accumulator sits at
(i // 4) * 512 + 4 t + i % 4 of its warpgroup's slab, in shared memory and in `dQaccum` alike, and the postprocess
puts the elements back in place. Each thread then writes its partial with 16-byte stores from one base address, each
warp's store filling 512 contiguous bytes. A row-major slab cost a 2-way bank conflict on every store even when
128-byte swizzled: the accumulator's 8-byte pieces of one half-warp fall on 4 rows, and the 16-byte swizzle maps
rows 2r and 2r + 1 onto the same 32 banks (Nsight: 256 excess shared wavefronts per step, 9% of the kernel's).

Methods of `FlexBwdSm90` (a mixin): they read the kernel's static configuration from `self`.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import OperandMajorMode
from cutlass.cutlass_dsl import dsl_user_op

from .config import TILE_SLOTS
from .layout import tma_tiles
from .named_barrier import BwdBarrier
from .tile_scheduler import consumer_state_at, take_tile

# consumer warpgroup (128 threads) + the dQ warp
DQ_HANDOFF_THREADS = 128 + 32
# A slab leaves shared memory as one (elements / 256, 256) fp32 TMA box: a box spans at most 256 elements a side.
SLAB_LINE = 256
# `dq_red` in deterministic mode: every warp of a consumer warpgroup releases the turn counter once.
RED_RELEASES_PER_TURN = 4


def make_dq_tiled_mma(dtype, head_dim: int, num_wg: int, split_rows: bool, swap_ab: bool = False, tile_m: int = 64):
    """dQ = dS K over the consumer warpgroups: each forms 64 query rows over every column (`split_rows`) or every
    row over head_dim / num_wg columns; or (`swap_ab`) dQ^T = K^T dS^T, each forming 64 head-dim rows over all
    tile_m query columns (A = K^T read transposed from shared memory). The postprocess builds the same one to find
    where each element belongs."""
    if swap_ab:
        return sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, OperandMajorMode.MN, OperandMajorMode.K, Float32, atom_layout_mnk=(num_wg, 1, 1),
            tiler_mn=(64, tile_m))
    return sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, OperandMajorMode.K, OperandMajorMode.MN, Float32,
        atom_layout_mnk=(num_wg, 1, 1) if split_rows else (1, num_wg, 1),
        tiler_mn=(64, head_dim if split_rows else head_dim // num_wg))


def dq_fragment_shape(thr_mma, tile_m: int, head_dim: int, swap_ab: bool):
    """Shape of one thread's dQ accumulator: over (tile_m, head_dim), or (head_dim, tile_m) when transposed."""
    return thr_mma.partition_shape_C((head_dim, tile_m) if swap_ab else (tile_m, head_dim))


def dq_slab_layout(slab_elems: int, num_wg: int):
    """Shared memory of the consumers' dQ partials: one (slab_elems / 256, 256) row-major slab per warpgroup."""
    return cute.make_layout((slab_elems // SLAB_LINE, SLAB_LINE, num_wg), stride=(SLAB_LINE, 1, slab_elems))


def dq_accum_lines(mdQaccum: cute.Tensor, head_dim: int):
    """(lines, 256, H, B) view of the (B, H, Sq_pad, head_dim) fp32 accumulator, whose (batch, head) block is a
    sequence of slabs: the TMA reduce's destination. Sq_pad is a multiple of tile_m (64, 80 or 128) and a slab of
    tile_m * head_dim / warpgroups elements a multiple of 256, so the lines are whole."""
    B, H, S = mdQaccum.shape[0], mdQaccum.shape[1], mdQaccum.shape[2]
    return cute.make_tensor(mdQaccum.iterator, cute.make_layout(
        (S * head_dim // SLAB_LINE, SLAB_LINE, H, B),
        stride=(SLAB_LINE, 1, mdQaccum.stride[1], mdQaccum.stride[0])))


def fragment_order(slab: cute.Tensor, thread: Int32, frag_shape) -> cute.Tensor:
    """Thread `thread` (0-127 in its warpgroup)'s view of a slab (shared or global memory) shaped like its dQ
    accumulator fragment: element i (numbered column-major, as in a compact fragment) at (i // 4) * 512 +
    4 thread + i % 4, so that four consecutive elements make one 16-byte access."""
    n = cute.size(frag_shape)
    threads = cute.make_tensor(slab.iterator, cute.make_layout((4, n // 4, 128), stride=(1, 512, 4)))
    return cute.composition(threads[None, None, thread], cute.make_layout(frag_shape))


@dsl_user_op
def bulk_reduce_add_f32(global_address: Int64, shared_address: Int32, num_bytes: Int32, *, loc=None, ip=None):
    """Add `num_bytes` of fp32 from shared memory into global memory as one asynchronous bulk operation (one lane
    issues it; it joins the issuing thread's bulk group, so `cp_async_bulk_commit_group` / `wait_group` cover it).
    Both addresses 16-byte aligned, `num_bytes` a multiple of 16."""
    operands = [Int64(global_address).ir_value(loc=loc, ip=ip), Int32(shared_address).ir_value(loc=loc, ip=ip),
                Int32(num_bytes).ir_value(loc=loc, ip=ip)]
    llvm.inline_asm(None, operands,
                    "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;", "l,r,r",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def red_add_f32x4(address: Int64, a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None, ip=None):
    """Four fp32 adds into 16 aligned bytes of global memory in one vector reduction (sm_90, no return value)."""
    llvm.inline_asm(None, [Int64(address).ir_value(loc=loc, ip=ip)] + [Float32(x).ir_value(loc=loc, ip=ip)
                                                                      for x in (a, b, c, d)],
                    "red.global.add.v4.f32 [$0], {$1, $2, $3, $4};", "l,f,f,f,f", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


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
        the whole warpgroup passes). With a dQ warp the slab comes back through DQ_EMPTY instead, and the reduce is
        that warp's job."""
        if cutlass.const_expr(self.dq_red):
            self.red_dq(acc_dQ, tdQg, m_block, order, batch, head, wg)
            return
        if cutlass.const_expr(self.dq_warp):
            cute.arch.barrier(barrier_id=int(BwdBarrier.DQ_EMPTY_WG1) + wg, number_of_threads=DQ_HANDOFF_THREADS)
            cute.autovec_copy(acc_dQ, tdQsdQ)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier_arrive(barrier_id=int(BwdBarrier.DQ_FULL_WG1) + wg, number_of_threads=DQ_HANDOFF_THREADS)
            return
        cute.autovec_copy(acc_dQ, tdQsdQ)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=int(BwdBarrier.DQ_READY_WG1) + wg, number_of_threads=128)
        if dq_issuer():
            self.issue_dq_reduce(tdQs, tdQg, tma_dq, m_block, order, batch, head, wg)
            if cutlass.const_expr(self.deterministic):
                self.release_landed(order, batch, head, m_block, (wg,))

    @cute.jit
    def red_dq(self, acc_dQ, gdQ, m_block: Int32, order, batch: Int32, head: Int32, wg: Int32):
        """`BwdConfig.dq_red`: this thread's partial added straight into its slab of `dQaccum` (`gdQ` = `dq_slabs`),
        four fragment-order elements per vector reduction, at the addresses the slab path would have reached.

        Deterministic mode orders the adds warp by warp: each warp waits until the four warps of every KV tile before
        this one in turn have released the slab's counter (`RED_RELEASES_PER_TURN`), adds, and releases it once its
        lanes' reductions are ordered before lane 0's release by the warp barrier. No shared memory, no dQ warp."""
        slab = gdQ[None, None, self.dq_tile_index(m_block, wg)]
        address = slab.iterator.toint() + Int64((cute.arch.thread_idx()[0] % 128) * 16)
        if cutlass.const_expr(self.deterministic):
            self.wait_dq_turn(order, batch, head, m_block, wg)  # every lane polls: one request per warp
        for k in cutlass.range_constexpr(cute.size(acc_dQ) // 4):
            red_add_f32x4(address + k * 512 * 4, acc_dQ[4 * k], acc_dQ[4 * k + 1], acc_dQ[4 * k + 2],
                          acc_dQ[4 * k + 3])
        if cutlass.const_expr(self.deterministic):
            cute.arch.sync_warp()
            if cute.arch.lane_idx() == 0:
                self.release_dq_turn(order[0], batch, head, m_block, wg)

    @cute.jit
    def issue_dq_reduce(self, tdQs, tdQg, tma_dq, m_block: Int32, order, batch: Int32, head: Int32, wg: Int32):
        """One whole warp: TMA reduce-add of warpgroup `wg`'s slab into Q tile `m_block`, in deterministic mode in its
        fixed turn (acquire before; `release_landed` releases it). Returns with the copy in flight."""
        if cutlass.const_expr(self.deterministic):
            self.wait_dq_turn(order, batch, head, m_block, wg)
            cute.arch.sync_warp()  # every lane has seen the turn before the warp-collective copy
            cute.arch.fence_proxy("async.global")  # the acquire orders the TMA (async proxy) reduce too
        if cutlass.const_expr(self.cfg.dq_bulk_reduce):  # (`tdQs` the slab, `tdQg` = `dq_slabs`: plain tensors)
            if cute.arch.lane_idx() == 0:
                slab = tdQg[None, None, self.dq_tile_index(m_block, wg)]
                bulk_reduce_add_f32(slab.iterator.toint(), tdQs.iterator.toint(), Int32(cute.size(tdQs) * 4))
        else:
            cute.copy(tma_dq, tdQs, tdQg[None, self.dq_tile_index(m_block, wg)])  # elects one lane itself
        # Every lane commits and waits on its own bulk group (empty for the lanes that issued nothing), so the lane
        # the copy elected is always covered without knowing which one it was.
        cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def release_landed(self, order, batch: Int32, head: Int32, m_block: Int32, wgs: tuple):
        """Deterministic mode, the warp that issued the reduces of warpgroups `wgs` into Q tile `m_block`: wait for
        them to land in global memory, then release each one's turn."""
        cute.arch.cp_async_bulk_wait_group(0, read=False)
        cute.arch.fence_proxy("async.global")  # the landed reduces are ordered before the generic-proxy releases
        cute.arch.sync_warp()
        if cute.arch.lane_idx() == 0:
            for i in cutlass.range_constexpr(len(wgs)):
                self.release_dq_turn(order[0], batch, head, m_block, wgs[i])

    @cute.jit
    def release_dq_turn(self, mdQsem, batch: Int32, head: Int32, m_block: Int32, wg: Int32):
        """One release of this slab's turn counter (one lane, after its warp's adds are ordered before it)."""
        sem = mdQsem.iterator + cute.crd2idx((batch, head, m_block, wg), mdQsem.layout)
        cute.arch.red(sem, Int32(1), op="add", dtype=Int32, sem="release", scope="gpu")

    def reduce_operands(self, tma_dq, slab: cute.Tensor, gdQ: cute.Tensor) -> tuple:
        """(source, destination) of a warpgroup's reduces from shared-memory `slab` into `gdQ` (`dq_slabs`): TMA
        partitions of both, or with `dq_bulk_reduce` the tensors themselves."""
        if cutlass.const_expr(self.cfg.dq_bulk_reduce):
            return slab, gdQ
        return tma_tiles(tma_dq, slab, gdQ)

    def dq_tile_index(self, m_block: Int32, wg: Int32):
        """Which of the slabs `tdQg` was cut into this warpgroup reduces into: Q tile m_block's slabs follow each
        other, one per warpgroup, in its (tile_m, head_dim) block of `dQaccum`."""
        return m_block * self.num_wg + wg

    def dq_slabs(self, mdQ: cute.Tensor, head: Int32, batch: Int32):
        """This (batch, head)'s block of `dQaccum` (`dq_accum_lines`) cut into slabs: (lines, 256, slab)."""
        lines = self.dq_rows * self.dq_cols // SLAB_LINE
        return cute.local_tile(mdQ[None, None, head, batch], (lines, SLAB_LINE), (None, 0))

    @cute.jit
    def wait_dq_slab_free(self):
        """The previous dQ reduce of this warpgroup has finished reading its shared-memory slab (issuing warp only;
        a later barrier passes that on to the whole warpgroup). Nothing to do with a dQ warp (DQ_EMPTY says it)."""
        if cutlass.const_expr(not self.dq_warp and not self.dq_red):
            if dq_issuer():
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def write_dq(self, mdQ, storage, sdQ_layout, tma_dq, n_block: Int32, head_kv: Int32, batch: Int32,
                 qhead_per_kvhead: Int32, num_m_blocks: Int32, sparse, mdQsem, mRank, tiles, piece=None):
        """The dQ warp (`BwdConfig.dq_warp`): the reduces of this CTA's KV tile, or (`tiles`, persistent CTAs) of
        every tile the producer warp hands over (`write_dq_tile`).

        The slabs start free, which the warp says once up front (DQ_EMPTY); the consumers wait for a hand-back before
        every write of a partial, whichever tile it belongs to, and once more at the end of the CTA. (A hand-back up
        front per tile would race: the warp could arrive twice on DQ_EMPTY before the consumers passed it once. So
        persistent CTAs never stage anything over the slabs, `FlexBwdSm90.epilogue`.)"""
        for w in cutlass.range_constexpr(self.num_wg):
            cute.arch.barrier_arrive(barrier_id=int(BwdBarrier.DQ_EMPTY_WG1) + w, number_of_threads=DQ_HANDOFF_THREADS)
        if cutlass.const_expr(tiles is not None):
            pipe_tile, slots = tiles[2], tiles[3]
            done = Int32(0)
            valid, n_block, head_kv, batch, _ = take_tile(pipe_tile, slots, consumer_state_at(TILE_SLOTS, done))
            while valid > 0:
                self.write_dq_tile(mdQ, storage, sdQ_layout, tma_dq, n_block, head_kv, batch, qhead_per_kvhead,
                                   num_m_blocks, sparse, mdQsem, mRank)
                done += 1
                valid, n_block, head_kv, batch, _ = take_tile(pipe_tile, slots, consumer_state_at(TILE_SLOTS, done))
        else:
            self.write_dq_tile(mdQ, storage, sdQ_layout, tma_dq, n_block, head_kv, batch, qhead_per_kvhead,
                               num_m_blocks, sparse, mdQsem, mRank, piece)

    @cute.jit
    def write_dq_tile(self, mdQ, storage, sdQ_layout, tma_dq, n_block: Int32, head_kv: Int32, batch: Int32,
                      qhead_per_kvhead: Int32, num_m_blocks: Int32, sparse, mdQsem, mRank, piece=None):
        """For every step of the consumers' walk of one KV tile and every consumer warpgroup, wait for its partial
        (DQ_FULL), reduce it into global memory with TMA (in deterministic mode in its fixed turn), and hand the slab
        back once the copy has read it (DQ_EMPTY)."""
        sdQ = storage.sdQ.get_tensor(sdQ_layout)  # (lines, 256, warpgroup)
        for g in cutlass.range(qhead_per_kvhead, unroll=1):
            head = head_kv * qhead_per_kvhead + g
            sched = self.head_schedule(sparse, batch, head, g, n_block, num_m_blocks, piece)
            order = (mdQsem, mRank, sched.b, sched.h, n_block)
            gdQ = self.dq_slabs(mdQ, head, batch)
            slabs = [self.reduce_operands(tma_dq, sdQ[None, None, w], gdQ) for w in range(self.num_wg)]  # per wg
            for i in cutlass.range(sched.total, unroll=1):
                m_block = sched.block(i)
                if cutlass.const_expr(self.deterministic):
                    self.write_dq_in_turn(slabs, tma_dq, m_block, order, batch, head)
                else:
                    for w in cutlass.range_constexpr(self.num_wg):
                        cute.arch.barrier(barrier_id=int(BwdBarrier.DQ_FULL_WG1) + w,
                                          number_of_threads=DQ_HANDOFF_THREADS)
                        self.issue_dq_reduce(slabs[w][0], slabs[w][1], tma_dq, m_block, order, batch, head, w)
                        cute.arch.cp_async_bulk_wait_group(0, read=True)
                        cute.arch.barrier_arrive(barrier_id=int(BwdBarrier.DQ_EMPTY_WG1) + w,
                                                 number_of_threads=DQ_HANDOFF_THREADS)

    @cute.jit
    def write_dq_in_turn(self, slabs, tma_dq, m_block: Int32, order, batch: Int32, head: Int32):
        """The dQ warp's step in deterministic mode: every warpgroup's reduce issued in its turn, then one wait for
        all of them to land before the turns are released and the slabs handed back. Waiting for each reduce
        before issuing the next put two round trips to global memory on every step's path instead of one."""
        for w in cutlass.range_constexpr(self.num_wg):
            cute.arch.barrier(barrier_id=int(BwdBarrier.DQ_FULL_WG1) + w, number_of_threads=DQ_HANDOFF_THREADS)
            self.issue_dq_reduce(slabs[w][0], slabs[w][1], tma_dq, m_block, order, batch, head, w)
        self.release_landed(order, batch, head, m_block, tuple(range(self.num_wg)))
        for w in cutlass.range_constexpr(self.num_wg):
            cute.arch.barrier_arrive(barrier_id=int(BwdBarrier.DQ_EMPTY_WG1) + w, number_of_threads=DQ_HANDOFF_THREADS)

    @cute.jit
    def wait_dq_turn(self, order, batch: Int32, head: Int32, m_block: Int32, wg: Int32):
        """Spin until every KV tile before this one in turn that visits this Q tile has reduced its dQ part
        (acquire): the lower tiles (turn = n_block) without a block mask, else the rank table's.

        Each turn releases the counter once (TMA reduce) or once per warp (`dq_red`), so the count reaches
        turn * releases exactly when every earlier turn is done: no later turn can release before that.
        CTAs are launched in turn order (`bwd_launch.turn_tile_order`), so the ones waited for were launched
        earlier and can always finish."""
        mdQsem, mRank, rank_b, rank_h, n_block = order
        turn = n_block
        if cutlass.const_expr(mRank is not None):
            turn = Int32(mRank[rank_b, rank_h, n_block, m_block])
        target = turn * (RED_RELEASES_PER_TURN if self.dq_red else 1)
        sem = mdQsem.iterator + cute.crd2idx((batch, head, m_block, wg), mdQsem.layout)
        seen = Int32(-1)
        while seen < target:
            seen = cute.arch.load(sem, Int32, sem="acquire", scope="gpu")
