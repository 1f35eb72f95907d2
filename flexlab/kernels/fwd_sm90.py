"""flexlab's Hopper (sm90a) forward attention kernel with flex hooks.

Structure (one CTA = one tile of `tile_m` query rows of one head):
  * warpgroup 0 is the producer: after giving registers back (`setmaxnreg`), one warp issues TMA loads of Q once and
    of K/V blocks into a `num_stages` ring, each stage guarded by a full/empty mbarrier pair;
  * warpgroups 1..n are consumers, 64 query rows each: S = Q K^T with wgmma from shared memory, score_mod and masks on
    the fp32 accumulator in registers, online softmax in base 2, then O += P V with P kept in registers (RS wgmma).
    The softmax of block j runs while the tensor cores finish P_{j-1} V_{j-1} (intra-warpgroup overlap), and the two
    consumer warpgroups take turns issuing GEMMs through named barriers (ping-pong), so one warpgroup's softmax hides
    under the other's matmuls;
  * epilogue: O is normalised, converted to 16 bit, written to shared memory (over Q) with stmatrix and stored with
    one TMA bulk copy, which also clips rows past Sq; LSE goes straight from registers.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync, warp, warpgroup
from cutlass.cute.nvgpu import OperandMajorMode
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from .block_sparse import KvSchedule
from .config import FwdConfig
from .layout import as_operand_a, bshd_view, convert_to_16bit, rows_view, tma_tiles, transpose_smem
from .mask import apply_mask_mod, mask_kv_tail
from .named_barrier import FwdBarrier
from .score_mod import apply_score_mod
from .softmax import OnlineSoftmax, rescale_rows
from .tile_scheduler import current_tile

LOG2_E = math.log2(math.e)

# When to apply the key-tail mask to a block (trace-time choice per call site).
TAIL_NEVER, TAIL_ALWAYS, TAIL_IF_LAST = 0, 1, 2


@cute.jit
def wgmma(tiled_mma: cute.TiledMma, acc: cute.Tensor, t_a: cute.Tensor, t_b: cute.Tensor,
          zero_init: cutlass.Constexpr[bool], wait: cutlass.Constexpr[int]):
    """Issue one warpgroup GEMM over all K slices; `wait` = groups left in flight afterwards (-1: don't wait)."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)  # a fresh atom: its accumulate flag is mutated below
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(t_a.shape[2])):
        cute.gemm(atom, acc, t_a[None, None, k], t_b[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    if cutlass.const_expr(wait >= 0):
        warpgroup.wait_group(wait)


class FlexFwdSm90:
    """Compile-time configuration of one kernel: tile config, dtype, and the (inlined) generated mods."""

    def __init__(self, cfg: FwdConfig, dtype, score_mod: Optional[Callable] = None,
                 mask_mod: Optional[Callable] = None, has_aux_tensors: bool = False):
        self.cfg = cfg.validate()
        self.dtype = dtype
        self.score_mod = score_mod
        self.mask_mod = mask_mod
        self.clamp_indices = has_aux_tensors  # captured buffers: never index past them on padded rows/cols
        self.tile_m, self.tile_n, self.head_dim = cfg.tile_m, cfg.tile_n, cfg.head_dim
        self.num_stages = cfg.num_stages
        self.num_wg = cfg.num_consumer_wgs
        self.num_consumer_threads = 128 * self.num_wg
        self.producer_regs, self.consumer_regs = cfg.register_split
        self.pingpong = cfg.pingpong and self.num_wg >= 2

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 softmax_scale: Float32, qhead_per_kvhead: Int32, heads_per_group: Int32, sparse, order,
                 aux_tensors: tuple, aux_scalars: tuple, stream: cuda.CUstream):
        """mQ/mO (B, Hq, Sq, D), mK/mV (B, Hkv, Skv, D) with unit stride on D; mLSE (B, Hq, Sq) fp32."""
        mQ, mK, mV, mO = [bshd_view(t) for t in (mQ, mK, mV, mO)]
        mLSE = cute.make_tensor(mLSE.iterator, cute.select(mLSE.layout, mode=[2, 1, 0]))  # (Sq, Hq, B)
        tile_m, tile_n, hd = self.tile_m, self.tile_n, self.head_dim
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.K, Float32,
            atom_layout_mnk=(self.num_wg, 1, 1), tiler_mn=(64, tile_n))
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.MN, Float32,
            atom_layout_mnk=(self.num_wg, 1, 1), tiler_mn=(64, hd), a_source=warpgroup.OperandSource.RMEM)
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, hd), self.dtype)
        sQ_layout = cute.tile_to_shape(atom, (tile_m, hd), order=(0, 1))
        sKV_layout = cute.tile_to_shape(atom, (tile_n, hd, self.num_stages), order=(0, 1, 2))
        load_op, store_op = cpasync.CopyBulkTensorTileG2SOp(), cpasync.CopyBulkTensorTileS2GOp()
        tma_q, mQ_t = cpasync.make_tiled_tma_atom(load_op, mQ, sQ_layout, (tile_m, hd))
        one_stage = cute.select(sKV_layout, mode=[0, 1])
        tma_k, mK_t = cpasync.make_tiled_tma_atom(load_op, mK, one_stage, (tile_n, hd))
        tma_v, mV_t = cpasync.make_tiled_tma_atom(load_op, mV, one_stage, (tile_n, hd))
        tma_o, mO_t = cpasync.make_tiled_tma_atom(store_op, mO, sQ_layout, (tile_m, hd))

        @cute.struct
        class Storage:
            mbar_q: cute.struct.MemRange[Int64, 2]
            mbar_k: cute.struct.MemRange[Int64, 2 * self.num_stages]
            mbar_v: cute.struct.MemRange[Int64, 2 * self.num_stages]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]

        log2_scale = Float32(LOG2_E) if cutlass.const_expr(self.score_mod is not None) else softmax_scale * LOG2_E
        num_m_blocks = cute.ceil_div(mQ.shape[0], tile_m)
        num_hb = mQ.shape[2] * mQ.shape[3]
        grid = [num_m_blocks * num_hb, 1, 1]
        tiles = (num_m_blocks, mQ.shape[2], num_hb, heads_per_group)
        self.kernel(mQ_t, mK_t, mV_t, mO_t, mLSE, tma_q, tma_k, tma_v, tma_o, softmax_scale, log2_scale,
                    qhead_per_kvhead, tiles, sparse, order, aux_tensors, aux_scalars, sQ_layout, sKV_layout,
                    tiled_mma_qk, tiled_mma_pv, Storage).launch(
            grid=grid, block=[self.cfg.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
               tma_q: cute.CopyAtom, tma_k: cute.CopyAtom, tma_v: cute.CopyAtom, tma_o: cute.CopyAtom,
               softmax_scale: Float32, log2_scale: Float32, qhead_per_kvhead: Int32, tiles, sparse, order,
               aux_tensors, aux_scalars, sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout,
               tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, Storage: cutlass.Constexpr):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v, tma_o):
                cpasync.prefetch_descriptor(atom)
        storage = SmemAllocator().allocate(Storage)
        consumer_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumer_threads // 32)
        tma_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        kv_bytes = self.tile_n * self.head_dim * self.dtype.width // 8
        pipe_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=1, producer_group=tma_thread,
            consumer_group=consumer_warps, tx_count=self.tile_m * self.head_dim * self.dtype.width // 8,
            defer_sync=True)
        pipe_k = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_k.data_ptr(), num_stages=self.num_stages, producer_group=tma_thread,
            consumer_group=consumer_warps, tx_count=kv_bytes, defer_sync=True)
        pipe_v = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_v.data_ptr(), num_stages=self.num_stages, producer_group=tma_thread,
            consumer_group=consumer_warps, tx_count=kv_bytes, defer_sync=True)
        pipeline.pipeline_init_arrive()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sV = storage.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        m_block, head, batch = current_tile(order, *tiles)
        seqlen_k = mK.shape[0]
        sched = KvSchedule(sparse, batch, head, m_block, cute.ceil_div(seqlen_k, self.tile_n))
        pipeline.pipeline_init_wait()

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.load(mQ, mK, mV, sQ, sK, sV, tma_q, tma_k, tma_v, pipe_q, pipe_k, pipe_v,
                          m_block, head, batch, head // qhead_per_kvhead, sched)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            tidx = cute.arch.thread_idx()[0] - 128
            self.consume(mQ, mO, mLSE, sQ, sK, transpose_smem(sV), tma_o, tiled_mma_qk, tiled_mma_pv,
                         pipe_q, pipe_k, pipe_v, tidx, warp_idx, m_block, head, batch, seqlen_k, sched,
                         softmax_scale, log2_scale, aux_tensors, aux_scalars, sQ_layout, storage)

    @cute.jit
    def load(self, mQ, mK, mV, sQ, sK, sV, tma_q, tma_k, tma_v, pipe_q, pipe_k, pipe_v,
             m_block: Int32, head: Int32, batch: Int32, head_kv: Int32, sched: KvSchedule):
        """Producer warp: Q once, then K one block ahead of V so QK of block j can start before PV of block j-1."""
        gQ = cute.local_tile(mQ[None, None, head, batch], (self.tile_m, self.head_dim), (m_block, 0))
        tQsQ, tQgQ = tma_tiles(tma_q, sQ, gQ)
        gK = cute.local_tile(mK[None, None, head_kv, batch], (self.tile_n, self.head_dim), (None, 0))
        gV = cute.local_tile(mV[None, None, head_kv, batch], (self.tile_n, self.head_dim), (None, 0))
        tKsK, tKgK = tma_tiles(tma_k, sK, gK)
        tVsV, tVgV = tma_tiles(tma_v, sV, gV)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pipe_q.producer_acquire(q_state)
        cute.copy(tma_q, tQgQ, tQsQ, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        total = sched.total
        if total > 0:
            pipe_k.producer_acquire(state)
            cute.copy(tma_k, tKgK[None, sched.block(0)], tKsK[None, state.index],
                      tma_bar_ptr=pipe_k.producer_get_barrier(state))
            for i in cutlass.range(1, total, unroll=1):
                prev = state.clone()
                state.advance()
                pipe_k.producer_acquire(state)
                cute.copy(tma_k, tKgK[None, sched.block(i)], tKsK[None, state.index],
                          tma_bar_ptr=pipe_k.producer_get_barrier(state))
                pipe_v.producer_acquire(prev)
                cute.copy(tma_v, tVgV[None, sched.block(i - 1)], tVsV[None, prev.index],
                          tma_bar_ptr=pipe_v.producer_get_barrier(prev))
            pipe_v.producer_acquire(state)
            cute.copy(tma_v, tVgV[None, sched.block(total - 1)], tVsV[None, state.index],
                      tma_bar_ptr=pipe_v.producer_get_barrier(state))

    @cute.jit
    def consume(self, mQ, mO, mLSE, sQ, sK, sVt, tma_o, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
                pipe_q, pipe_k, pipe_v, tidx: Int32, warp_idx: Int32, m_block: Int32, head: Int32, batch: Int32,
                seqlen_k: Int32, sched: KvSchedule, softmax_scale: Float32, log2_scale: Float32,
                aux_tensors, aux_scalars, sQ_layout, storage):
        wg = cute.arch.make_warp_uniform(tidx // 128)
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        wg_mma_qk = tiled_mma_qk.get_slice(wg * 128)
        wg_mma_pv = tiled_mma_pv.get_slice(wg * 128)
        tSrQ = wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ))
        tSrK = wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK))
        tOrVt = wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(sVt))
        tOrP = wg_mma_pv.make_fragment_A(wg_mma_pv.partition_shape_A((self.tile_m, self.tile_n)))
        acc_O = cute.make_rmem_tensor(wg_mma_pv.partition_shape_C((self.tile_m, self.head_dim)), Float32)
        s_shape = wg_mma_qk.partition_shape_C((self.tile_m, self.tile_n))
        coords = thr_mma_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        num_rows = cute.size(rows_view(acc_O), mode=[0])
        softmax = OnlineSoftmax(log2_scale, num_rows)
        softmax.reset()
        row_scale = cute.make_rmem_tensor(num_rows, Float32)
        acc_O.fill(0.0)

        seqlen_q = mQ.shape[0]
        q_start = m_block * self.tile_m
        q_last, kv_last = seqlen_q - 1, seqlen_k - 1
        mods = (batch, head, q_start, q_last, kv_last, softmax_scale, aux_tensors, aux_scalars)
        dense = cutlass.const_expr(sched.sparse is None)

        if cutlass.const_expr(self.pingpong):
            if wg == 0:  # the first consumer warpgroup goes first
                cute.arch.barrier_arrive(barrier_id=int(FwdBarrier.TURN_WG1), number_of_threads=256)

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipe_q.consumer_wait(q_state)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        total = sched.total
        num_partial = sched.num_partial
        if total > 0:
            # First block: S only (its PV happens in the next step).
            acc_S = cute.make_rmem_tensor(s_shape, Float32)
            pipe_k.consumer_wait(state)
            wgmma(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, state.index], True, 0)
            pipe_k.consumer_release(state)
            n_block = sched.block(0)
            if num_partial > 0:
                self.mod_scores(acc_S, coords, n_block, seqlen_k, mods, True, TAIL_ALWAYS)
            else:
                self.mod_scores(acc_S, coords, n_block, seqlen_k, mods, False, TAIL_ALWAYS)
            softmax.step(acc_S, row_scale)
            convert_to_16bit(as_operand_a(acc_S), tOrP)
            # Partial blocks (mask_mod), then full blocks (no mask_mod); dense: no mask_mod, tail only at step 0.
            tail = TAIL_NEVER if dense else TAIL_IF_LAST
            for i in cutlass.range(1, num_partial, unroll=1):
                state = self.overlapped_step(i, state, sched, tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt,
                                             tOrP, acc_O, s_shape, coords, softmax, row_scale, pipe_k, pipe_v,
                                             wg, seqlen_k, mods, True, tail)
            for i in cutlass.range(cutlass.max(num_partial, 1), total, unroll=1):
                state = self.overlapped_step(i, state, sched, tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt,
                                             tOrP, acc_O, s_shape, coords, softmax, row_scale, pipe_k, pipe_v,
                                             wg, seqlen_k, mods, False, tail)
            # Last block: PV only.
            pipe_v.consumer_wait(state)
            wgmma(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, state.index], False, 0)
            pipe_v.consumer_release(state)
            state.advance()

        lse = cute.make_rmem_tensor(num_rows, Float32)
        softmax.finalize(lse, row_scale)
        rescale_rows(acc_O, row_scale)
        self.epilogue(acc_O, lse, coords, mO, mLSE, sQ_layout, storage, tma_o, tiled_mma_pv, tidx, warp_idx,
                      m_block, head, batch, seqlen_q)

    @cute.jit
    def overlapped_step(self, i: Int32, state, sched: KvSchedule, tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt,
                        tOrP, acc_O, s_shape, coords, softmax: OnlineSoftmax, row_scale, pipe_k, pipe_v, wg: Int32,
                        seqlen_k: Int32, mods, use_mask_mod: cutlass.Constexpr[bool], tail: cutlass.Constexpr[int]):
        """S_i = Q K_i^T and O += P_{i-1} V_{i-1} issued back to back; softmax(S_i) overlaps the PV GEMM."""
        prev = state.clone()
        state.advance()
        acc_S = cute.make_rmem_tensor(s_shape, Float32)
        pipe_k.consumer_wait(state)
        self.wait_turn(wg)
        wgmma(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, state.index], True, -1)
        pipe_v.consumer_wait(prev)
        wgmma(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, prev.index], False, -1)
        self.pass_turn(wg)
        warpgroup.wait_group(1)  # S_i ready; PV still on the tensor cores
        pipe_k.consumer_release(state)
        self.mod_scores(acc_S, coords, sched.block(i), seqlen_k, mods, use_mask_mod, tail)
        softmax.step(acc_S, row_scale)
        warpgroup.wait_group(0)
        pipe_v.consumer_release(prev)
        convert_to_16bit(as_operand_a(acc_S), tOrP)
        rescale_rows(acc_O, row_scale)
        return state

    @cute.jit
    def mod_scores(self, acc_S, coords, n_block: Int32, seqlen_k: Int32, mods,
                   use_mask_mod: cutlass.Constexpr[bool], tail: cutlass.Constexpr[int]):
        """score_mod, then mask_mod (partial blocks only), then the key-tail mask."""
        batch, head, q_start, q_last, kv_last, softmax_scale, aux_tensors, aux_scalars = mods
        kv_start = n_block * self.tile_n
        if cutlass.const_expr(self.score_mod is not None):
            apply_score_mod(acc_S, coords, self.score_mod, softmax_scale, batch, head, q_start, kv_start, q_last,
                            kv_last, self.clamp_indices, aux_tensors, aux_scalars)
        if cutlass.const_expr(use_mask_mod and self.mask_mod is not None):
            apply_mask_mod(acc_S, coords, self.mask_mod, batch, head, q_start, kv_start, q_last, kv_last,
                           self.clamp_indices, aux_tensors, aux_scalars)
        if cutlass.const_expr(tail == TAIL_ALWAYS):
            mask_kv_tail(acc_S, coords, kv_start, seqlen_k)
        if cutlass.const_expr(tail == TAIL_IF_LAST):
            if kv_start + self.tile_n > seqlen_k:
                mask_kv_tail(acc_S, coords, kv_start, seqlen_k)

    def wait_turn(self, wg):
        if cutlass.const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=int(FwdBarrier.TURN_WG1) + wg, number_of_threads=256)

    def pass_turn(self, wg):
        if cutlass.const_expr(self.pingpong):
            if cutlass.const_expr(self.num_wg == 2):
                nxt = 1 - wg
            else:
                nxt = (wg + 1) % self.num_wg
            cute.arch.barrier_arrive(barrier_id=int(FwdBarrier.TURN_WG1) + nxt, number_of_threads=256)

    @cute.jit
    def epilogue(self, acc_O, lse, coords, mO, mLSE, sQ_layout, storage, tma_o, tiled_mma_pv, tidx: Int32,
                 warp_idx: Int32, m_block: Int32, head: Int32, batch: Int32, seqlen_q: Int32):
        """O -> 16 bit -> shared memory (over Q) -> one TMA store; LSE from the lanes that own column 0."""
        rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
        convert_to_16bit(acc_O, rO)
        sO = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        # Both warpgroups must be done reading Q before O overwrites it.
        cute.arch.barrier(barrier_id=int(FwdBarrier.EPILOGUE), number_of_threads=self.num_consumer_threads)
        st_atom = cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        thr_st = cute.make_tiled_copy_C(st_atom, tiled_mma_pv).get_slice(tidx)
        cute.copy(st_atom, thr_st.retile(rO), thr_st.partition_D(sO))

        c_rows = rows_view(coords)
        if c_rows[0, 0][1] == 0:
            q_base = m_block * self.tile_m
            for r in cutlass.range_constexpr(cute.size(lse)):
                q_idx = q_base + c_rows[r, 0][0]
                if q_idx < seqlen_q:
                    mLSE[q_idx, head, batch] = lse[r]

        cute.arch.fence_view_async_shared()
        cute.arch.barrier_arrive(barrier_id=int(FwdBarrier.EPILOGUE), number_of_threads=self.num_consumer_threads + 32)
        if warp_idx == 4:
            cute.arch.barrier(barrier_id=int(FwdBarrier.EPILOGUE), number_of_threads=self.num_consumer_threads + 32)
            gO = cute.local_tile(mO[None, None, head, batch], (self.tile_m, self.head_dim), (m_block, 0))
            tOsO, tOgO = tma_tiles(tma_o, sO, gO)
            with cute.arch.elect_one():
                cute.copy(tma_o, tOsO, tOgO)
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)
