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

Options in `FwdConfig` (off by default):
  * `persistent_ctas`: a grid of at most that many CTAs, each looping over tiles (`tile_scheduler.tile_coords`). The
    producer issues the next tile's first K before its Q, and when shared memory allows (`separate_o`) O gets its own
    buffer, so the next Q lands while this tile's last PV GEMM and epilogue run; otherwise O stays over Q and the next
    Q waits until the TMA store has read it;
  * `dynamic_tiles` (with `persistent_ctas`): the producer warp claims each next tile from a global counter in launch
    order and hands it to the consumers through shared-memory slots (`tile_scheduler.claim_tile`), so CTAs that
    finish early take more tiles; the launcher's default where tiles are short (`runtime.launch.runs_dynamic`);
  * `cluster_m` = 2 (dense grids): CTAs pair up in clusters over neighbouring Q tiles of one head; each producer
    loads half of every K/V block with a multicast TMA copy that lands in both CTAs, and a stage is refilled only
    once the consumers of both CTAs have released it (their release arrives on both CTAs' empty barriers). With
    `persistent_ctas` each cluster walks pairs of tiles (`tile_scheduler.pair_coords`), the launcher's default for
    dense tiles of mid length (`runtime.launch.runs_persistent_clusters`);
  * `split_tail` (static persistent, dense): the tiles after the last whole round are cut into even runs of KV
    blocks, one per worker, and the parts of a cut tile merged by the last to finish (`kernels.split_tail`);
  * `rescale_before_pv`, `exp2_poly`, `early_block_index`, `mask_early`: see `FwdConfig`.
Debug-only stage removal (`FwdConfig.ablate`, names in `config.ABLATIONS`) is confined to `ablated(...)` checks in
`load_kv`, `overlapped_step`, the first/last block of `consume_tile`, `mod_scores`, `OnlineSoftmax` and `epilogue`.
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
from .config import TILE_SLOT_WORDS, TILE_SLOTS, FwdConfig
from .layout import as_operand_a, bshd_view, convert_to_16bit, rows_view, tma_tiles, transpose_smem
from .mask import (FRAGMENT_ROWS, apply_band_mask, apply_band_words, apply_fragment_bits, apply_mask_bits,
                   apply_mask_mod, band_for, band_words, load_fragment_bits, mask_kv_tail, mask_mod_bits)
from .named_barrier import FwdBarrier
from .score_mod import apply_score_mod
from .softmax import OnlineSoftmax, rescale_rows
from .split_tail import SplitTail, merge_parts, publish_and_arrive
from .stage_waits import acquire_empty, release_after, wait_full
from .tile_scheduler import (claim_tile, cluster_pair_tile, current_tile, hand_over_tile, pair_coords, take_tile,
                             tile_coords)

LOG2_E = math.log2(math.e)


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
        self.persistent = cfg.persistent
        self.dynamic = cfg.dynamic_tiles
        self.separate_o = cfg.separate_o
        self.cluster_m = cfg.cluster_m
        self.mask_bits = cfg.mask_bits
        self.split_tail = cfg.split_tail
        self.ablate = frozenset(cfg.ablate)

    def ablated(self, stage: str) -> bool:
        """Trace-time: whether this (debug) build removes `stage` (see `config.ABLATIONS`)."""
        return stage in self.ablate

    def storage_class(self, sQ_layout, sKV_layout):
        """The shared-storage struct: barriers, Q (also O unless `separate_o`), the K and V rings, optionally O.
        Built from a field dict (this module's annotations are strings, which `cute.struct` does not evaluate)."""
        def buffer(layout):
            return cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layout)], 1024]
        fields = {"mbar_q": cute.struct.MemRange[Int64, 2],
                  "mbar_k": cute.struct.MemRange[Int64, 2 * self.num_stages],
                  "mbar_v": cute.struct.MemRange[Int64, 2 * self.num_stages]}
        if self.dynamic:
            fields["mbar_tile"] = cute.struct.MemRange[Int64, 2 * TILE_SLOTS]
            fields["tile_slots"] = cute.struct.MemRange[Int32, TILE_SLOTS * TILE_SLOT_WORDS]
        if self.split_tail:
            fields["tail_flag"] = cute.struct.MemRange[Int32, 4]
        fields.update(sQ=buffer(sQ_layout), sK=buffer(sKV_layout), sV=buffer(sKV_layout))
        if self.separate_o:
            fields["sO"] = buffer(sQ_layout)
        return cute.struct(type("Storage", (), {"__annotations__": fields}))

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: Optional[cute.Tensor], softmax_scale: Float32, qhead_per_kvhead: Int32,
                 heads_per_group: Int32, sparse, order, workspace, aux_tensors: tuple, aux_scalars: tuple,
                 stream: cuda.CUstream):
        """mQ/mO (B, Hq, Sq, D), mK/mV (B, Hkv, Skv, D) with unit stride on D; mLSE (B, Hq, Sq) fp32, or None for
        an inference call that does not return it (the row statistics then never leave the registers);
        `workspace`: with `dynamic_tiles` the zeroed int32 (1,) tile counter, with `split_tail` (zeroed int32 arrival
        counters, fp32 partials) as `runtime.launch.scheduler_workspace` allocates them, else None."""
        mQ, mK, mV, mO = [bshd_view(t) for t in (mQ, mK, mV, mO)]
        if cutlass.const_expr(mLSE is not None):
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
        kv_op = load_op
        if cutlass.const_expr(self.cluster_m > 1):
            if cutlass.const_expr(sparse is not None):
                raise ValueError("FwdConfig.cluster_m=2 shares K/V between two Q tiles: dense grids only")
            kv_op = cpasync.CopyBulkTensorTileG2SMulticastOp()
        if cutlass.const_expr(self.cfg.ragged_first_tile and sparse is None):
            raise ValueError("FwdConfig.ragged_first_tile moves the padded Q rows by the block lists' tiling: "
                             "block-sparse grids only")
        if cutlass.const_expr(self.cfg.ragged_first_tile and self.clamp_indices
                              and (self.score_mod is not None or (self.mask_mod is not None and not self.mask_bits))):
            raise ValueError("FwdConfig.ragged_first_tile: mods that read captured tensors would index them at the "
                             "first tile's rows before 0; store the mask as bits (mask_bits) instead")
        if cutlass.const_expr(self.split_tail and sparse is not None):
            raise ValueError("FwdConfig.split_tail cuts tiles into even runs of KV blocks: dense grids only")
        tma_k, mK_t = cpasync.make_tiled_tma_atom(kv_op, mK, one_stage, (tile_n, hd), num_multicast=self.cluster_m)
        tma_v, mV_t = cpasync.make_tiled_tma_atom(kv_op, mV, one_stage, (tile_n, hd), num_multicast=self.cluster_m)
        tma_o, mO_t = cpasync.make_tiled_tma_atom(store_op, mO, sQ_layout, (tile_m, hd))

        Storage = self.storage_class(sQ_layout, sKV_layout)
        log2_scale = Float32(LOG2_E) if cutlass.const_expr(self.score_mod is not None) else softmax_scale * LOG2_E
        num_m_blocks = cute.ceil_div(mQ.shape[0], tile_m)
        num_hb = mQ.shape[2] * mQ.shape[3]
        grid = [num_m_blocks * num_hb, 1, 1]
        if cutlass.const_expr(self.persistent):
            grid = [cutlass.min(num_m_blocks * num_hb, self.cfg.persistent_ctas), 1, 1]
        tiles = (num_m_blocks, mQ.shape[2], num_hb, heads_per_group)
        launch = {}
        if cutlass.const_expr(self.cluster_m > 1):  # pairs of Q tiles (`tile_scheduler.cluster_pair_tile`)
            num_pairs = cute.ceil_div(num_m_blocks, self.cluster_m)
            grid = [num_pairs * num_hb * self.cluster_m, 1, 1]
            if cutlass.const_expr(self.persistent):
                grid = [cutlass.min(num_pairs * num_hb, self.cfg.persistent_ctas // self.cluster_m) * self.cluster_m,
                        1, 1]
            tiles = (num_pairs, mQ.shape[2], num_hb, heads_per_group)
            launch = {"cluster": [self.cluster_m, 1, 1]}
        # `ragged_first_tile`: the first tile's O leaves by plain stores (a TMA store cannot start at a negative row)
        mO_rows = mO if cutlass.const_expr(self.cfg.ragged_first_tile) else None
        self.kernel(mQ_t, mK_t, mV_t, mO_t, mLSE, mO_rows, tma_q, tma_k, tma_v, tma_o, softmax_scale, log2_scale,
                    qhead_per_kvhead, tiles, sparse, order, workspace, aux_tensors, aux_scalars, sQ_layout,
                    sKV_layout, tiled_mma_qk, tiled_mma_pv, Storage).launch(
            grid=grid, block=[self.cfg.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1,
            use_pdl=self.cfg.chained_launch, **launch)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE, mO_rows,
               tma_q: cute.CopyAtom, tma_k: cute.CopyAtom, tma_v: cute.CopyAtom, tma_o: cute.CopyAtom,
               softmax_scale: Float32, log2_scale: Float32, qhead_per_kvhead: Int32, tiles, sparse, order,
               workspace, aux_tensors, aux_scalars, sQ_layout: cute.ComposedLayout,
               sKV_layout: cute.ComposedLayout, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, Storage: cutlass.Constexpr):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        bits = None  # `mask_bits`: partial-block masks stored as bits, passed after the four block lists
        if cutlass.const_expr(self.mask_bits):
            bits = sparse[4]
            sparse = (sparse[0], sparse[1], sparse[2], sparse[3])
        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v, tma_o):
                cpasync.prefetch_descriptor(atom)
        storage = SmemAllocator().allocate(Storage)
        consumer_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumer_threads // 32)
        tma_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        # Q is released by every consumer warp after its last QK GEMM, except in a persistent kernel whose O reuses Q's
        # buffer: there the storing warp releases it once the TMA store has read O.
        q_releasers = consumer_warps
        if cutlass.const_expr(self.persistent and not self.separate_o):
            q_releasers = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        kv_bytes = self.tile_n * self.head_dim * self.dtype.width // 8
        pipe_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=1, producer_group=tma_thread,
            consumer_group=q_releasers, tx_count=self.tile_m * self.head_dim * self.dtype.width // 8,
            defer_sync=True)
        # K/V: with a cluster, a stage holds halves from both CTAs' producers (the full barrier still expects the whole
        # block) and is free again only when every consumer warp of both CTAs has released it.
        kv_consumers, kv_cluster, cluster_shape = consumer_warps, {}, None
        if cutlass.const_expr(self.cluster_m > 1):
            kv_consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumer_threads)
            kv_cluster = {"cta_layout_vmnk": cute.make_layout((1, self.cluster_m, 1, 1)), "mcast_mode_mn": (0, 1),
                          "enable_multicast_signaling": True}
            cluster_shape = cute.make_layout((self.cluster_m, 1))
        pipe_k = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_k.data_ptr(), num_stages=self.num_stages, producer_group=tma_thread,
            consumer_group=kv_consumers, tx_count=kv_bytes, defer_sync=True, **kv_cluster)
        pipe_v = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_v.data_ptr(), num_stages=self.num_stages, producer_group=tma_thread,
            consumer_group=kv_consumers, tx_count=kv_bytes, defer_sync=True, **kv_cluster)
        handoff = None  # dynamic tiles: (slot pipeline, slot words) from the producer warp to the consumers
        if cutlass.const_expr(self.dynamic):
            pipe_tile = pipeline.PipelineAsync.create(
                barrier_storage=storage.mbar_tile.data_ptr(), num_stages=TILE_SLOTS, producer_group=tma_thread,
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumer_threads),
                defer_sync=True)
            handoff = (pipe_tile, storage.tile_slots.get_tensor(cute.make_layout((TILE_SLOT_WORDS, TILE_SLOTS))))
        tail = None  # split_tail: (workspace, the consumers' shared flag)
        if cutlass.const_expr(self.split_tail):
            tail = (workspace, storage.tail_flag.get_tensor(cute.make_layout(4)))
        pipeline.pipeline_init_arrive(cluster_shape)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sV = storage.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sO = sQ
        if cutlass.const_expr(self.separate_o):
            sO = storage.sO.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        if cutlass.const_expr(self.cfg.chained_launch):
            # (`chained_launch`) the kernel before may still be writing what this one reads, or reading what it
            # writes: every global access below comes after its end
            cute.arch.griddepcontrol_wait()
            if cutlass.const_expr(self.persistent):
                cute.arch.griddepcontrol_launch_dependents()
        seqlen_k = mK.shape[0]
        first = None  # one-tile-per-CTA grid: this CTA's tile, looked up while the barriers initialise
        if cutlass.const_expr(not self.persistent):
            if cutlass.const_expr(self.cluster_m > 1):
                m_block, head, batch = cluster_pair_tile(*tiles)
            else:
                m_block, head, batch = current_tile(order, *tiles)
            sched = KvSchedule(sparse, batch, head, m_block, cute.ceil_div(seqlen_k, self.tile_n))
            first = (m_block, head, batch, sched)
        num_kv_blocks = cute.ceil_div(seqlen_k, self.tile_n)
        pipeline.pipeline_init_wait(cluster_shape)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.load(mQ, mK, mV, sQ, sK, sV, tma_q, tma_k, tma_v, pipe_q, pipe_k, pipe_v, qhead_per_kvhead,
                          tiles, sparse, order, num_kv_blocks, first, workspace, handoff)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            tidx = cute.arch.thread_idx()[0] - 128
            self.consume(mQ, mO if cutlass.const_expr(mO_rows is None) else (mO, mO_rows), mLSE, sQ, sO, sK,
                         transpose_smem(sV), tma_o, tiled_mma_qk, tiled_mma_pv, pipe_q, pipe_k, pipe_v, tidx,
                         warp_idx, tiles, sparse, order, num_kv_blocks, first, seqlen_k, softmax_scale,
                         log2_scale, aux_tensors, aux_scalars, handoff, bits, tail)

    # ------------------------------------------------------------------ producer
    @cute.jit
    def load(self, mQ, mK, mV, sQ, sK, sV, tma_q, tma_k, tma_v, pipe_q, pipe_k, pipe_v, qhead_per_kvhead: Int32,
             tiles, sparse, order, num_kv_blocks: Int32, first, workspace, handoff):
        """Producer warp: this CTA's tile, or (persistent) every G-th tile from its block index and then, with
        `split_tail`, its run of the tail's parts, or (dynamic) its block index first and then whatever tile the
        counter hands out, each passed on to the consumers."""
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        if cutlass.const_expr(self.dynamic):
            pipe_tile, slots = handoff
            slot = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, TILE_SLOTS)
            tile = Int32(cute.arch.block_idx()[0])
            num_tiles = tiles[0] * tiles[2]
            while tile < num_tiles:
                # Claimed now, used after this tile's loads: the atomic's round trip hides behind them.
                next_tile = claim_tile(workspace, num_tiles)
                m_block, head, batch = tile_coords(tile, order, *tiles)
                sched = KvSchedule(sparse, batch, head, m_block, num_kv_blocks)
                hand_over_tile(pipe_tile, slots, slot, sched, m_block, head, batch)
                slot.advance()
                q_state, state = self.load_tile(mQ, mK, mV, sQ, sK, sV, tma_q, tma_k, tma_v, pipe_q, pipe_k,
                                                pipe_v, m_block, head, batch, head // qhead_per_kvhead, sched,
                                                q_state, state)
                tile = next_tile
            hand_over_tile(pipe_tile, slots, slot, None)
        elif cutlass.const_expr(self.persistent):
            tile, stride, whole_end, split = self.persistent_plan(tiles, num_kv_blocks)
            while tile < whole_end:
                m_block, head, batch = self.persistent_coords(tile, order, tiles)
                sched = KvSchedule(sparse, batch, head, m_block, num_kv_blocks)
                q_state, state = self.load_tile(mQ, mK, mV, sQ, sK, sV, tma_q, tma_k, tma_v, pipe_q, pipe_k,
                                                pipe_v, m_block, head, batch, head // qhead_per_kvhead, sched,
                                                q_state, state)
                tile += stride
            if cutlass.const_expr(split is not None):  # this worker's run of the tail, unit by unit
                it = split.begin
                while it < split.end:
                    t, part_first, part_end = split.unit(it)
                    m_block, head, batch = self.persistent_coords(split.whole_end + t, order, tiles)
                    sched = KvSchedule(None, batch, head, m_block, num_kv_blocks, part=(part_first, part_end))
                    q_state, state = self.load_tile(mQ, mK, mV, sQ, sK, sV, tma_q, tma_k, tma_v, pipe_q, pipe_k,
                                                    pipe_v, m_block, head, batch, head // qhead_per_kvhead, sched,
                                                    q_state, state)
                    it = (t + 1) * split.blocks
            if cutlass.const_expr(self.cluster_m > 1):  # the partner releases our stages remotely: wait for it
                pipe_k.producer_tail(state.clone())
                pipe_v.producer_tail(state.clone())
        else:
            m_block, head, batch, sched = first
            q_state, state = self.load_tile(mQ, mK, mV, sQ, sK, sV, tma_q, tma_k, tma_v, pipe_q, pipe_k, pipe_v,
                                            m_block, head, batch, head // qhead_per_kvhead, sched, q_state, state)
            if cutlass.const_expr(self.cluster_m > 1):
                # The partner CTA's consumers release our stages with remote arrives (and our multicast halves fill
                # its buffers): this CTA stays until every stage has been released by both.
                pipe_k.producer_tail(state.clone())
                pipe_v.producer_tail(state.clone())

    def persistent_plan(self, tiles, num_kv_blocks: Int32) -> tuple:
        """A static persistent CTA's walk, the same for its producer and consumers: (first tile, stride, end of the
        whole tiles, the split tail or None). Tiles, and the stride, count pairs with clusters. Without `split_tail`
        every tile is whole."""
        bid, grid = Int32(cute.arch.block_idx()[0]), Int32(cute.arch.grid_dim()[0])
        if cutlass.const_expr(self.cluster_m > 1):
            bid, grid = bid // self.cluster_m, grid // self.cluster_m
        num_tiles = tiles[0] * tiles[2]
        if cutlass.const_expr(not self.split_tail):
            return bid, grid, num_tiles, None
        split = SplitTail(num_tiles, grid, bid, num_kv_blocks)
        return bid, grid, split.whole_end, split

    @cute.jit
    def persistent_coords(self, tile: Int32, order, tiles) -> tuple:
        """(m_block, head, batch) of a persistent CTA's tile number `tile` (with clusters: pair number)."""
        if cutlass.const_expr(self.cluster_m > 1):
            return pair_coords(tile, *tiles)
        return tile_coords(tile, order, *tiles)

    @cute.jit
    def load_tile(self, mQ, mK, mV, sQ, sK, sV, tma_q, tma_k, tma_v, pipe_q, pipe_k, pipe_v,
                  m_block: Int32, head: Int32, batch: Int32, head_kv: Int32, sched: KvSchedule, q_state, state):
        """Q once, then K one block ahead of V so QK of block j can start before PV of block j-1.

        Persistent: the first K goes before Q, so it can land while the previous tile still holds the Q buffer."""
        gQ = cute.local_tile(self.rows_of_tiles(mQ[None, None, head, batch]), (self.tile_m, self.head_dim),
                             (m_block, 0))
        tQsQ, tQgQ = tma_tiles(tma_q, sQ, gQ)
        gK = cute.local_tile(mK[None, None, head_kv, batch], (self.tile_n, self.head_dim), (None, 0))
        gV = cute.local_tile(mV[None, None, head_kv, batch], (self.tile_n, self.head_dim), (None, 0))
        if cutlass.const_expr(self.cluster_m > 1):  # this CTA's half of each block, multicast to the cluster
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            cta_layout = cute.make_layout(self.cluster_m)
            tKsK, tKgK = cpasync.tma_partition(tma_k, rank, cta_layout, cute.group_modes(sK, 0, 2),
                                               cute.group_modes(gK, 0, 2))
            tVsV, tVgV = cpasync.tma_partition(tma_v, rank, cta_layout, cute.group_modes(sV, 0, 2),
                                               cute.group_modes(gV, 0, 2))
        else:
            tKsK, tKgK = tma_tiles(tma_k, sK, gK)
            tVsV, tVgV = tma_tiles(tma_v, sV, gV)
        if cutlass.const_expr(not self.persistent):
            acquire_empty(pipe_q, q_state, self.cfg.try_wait_first)
            cute.copy(tma_q, tQgQ, tQsQ, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))

        total = sched.total
        first_block = sched.first_block()
        if total > 0:
            self.load_kv(pipe_k, tma_k, tKgK, tKsK, state, first_block, True)
        if cutlass.const_expr(self.persistent):
            acquire_empty(pipe_q, q_state, self.cfg.try_wait_first)
            cute.copy(tma_q, tQgQ, tQsQ, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
            q_state.advance()
        if total > 0:
            prev_block = first_block
            for i in cutlass.range(1, total, unroll=1):
                prev = state.clone()
                state.advance()
                n_block = sched.block(i)
                self.load_kv(pipe_k, tma_k, tKgK, tKsK, state, n_block, False)
                self.load_kv(pipe_v, tma_v, tVgV, tVsV, prev, prev_block, i == 1)
                prev_block = n_block
            self.load_kv(pipe_v, tma_v, tVgV, tVsV, state, prev_block, total == 1)
            state.advance()
        return q_state, state

    @cute.jit
    def load_kv(self, pipe, tma, tXgX, tXsX, state, n_block: Int32, first_step):
        """K or V block `n_block` into the stage `state` points at; `first_step`: the tile's first block (the
        kv_loads ablation copies only that one)."""
        if cutlass.const_expr(self.ablated("kv_loads")):
            if first_step:
                pipe.producer_acquire(state)
                cute.copy(tma, tXgX[None, n_block], tXsX[None, state.index],
                          tma_bar_ptr=pipe.producer_get_barrier(state))
            else:  # mark the stage full without a copy: consumers reuse whatever it holds
                pipe.sync_object_empty.wait(state.index, state.phase)
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive(pipe.producer_get_barrier(state))
        else:
            multicast = {}  # with a cluster, this CTA's half of the block lands in both CTAs
            if cutlass.const_expr(self.cluster_m > 1):
                multicast = {"mcast_mask": cutlass.Int16((1 << self.cluster_m) - 1)}
            acquire_empty(pipe, state, self.cfg.try_wait_first)
            cute.copy(tma, tXgX[None, n_block], tXsX[None, state.index],
                      tma_bar_ptr=pipe.producer_get_barrier(state), **multicast)

    # ------------------------------------------------------------------ consumers
    @cute.jit
    def consume(self, mQ, mO, mLSE, sQ, sO, sK, sVt, tma_o, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
                pipe_q, pipe_k, pipe_v, tidx: Int32, warp_idx: Int32, tiles, sparse, order, num_kv_blocks: Int32,
                first, seqlen_k: Int32, softmax_scale: Float32, log2_scale: Float32, aux_tensors, aux_scalars,
                handoff, bits, tail):
        wg = cute.arch.make_warp_uniform(tidx // 128)
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        wg_mma_qk = tiled_mma_qk.get_slice(wg * 128)
        wg_mma_pv = tiled_mma_pv.get_slice(wg * 128)
        frags = (wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ)),  # tSrQ
                 wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK)),  # tSrK
                 wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(sVt)),  # tOrVt
                 wg_mma_pv.make_fragment_A(wg_mma_pv.partition_shape_A((self.tile_m, self.tile_n))))  # tOrP
        acc_O = cute.make_rmem_tensor(wg_mma_pv.partition_shape_C((self.tile_m, self.head_dim)), Float32)
        s_shape = wg_mma_qk.partition_shape_C((self.tile_m, self.tile_n))
        coords = thr_mma_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        num_rows = cute.size(rows_view(acc_O), mode=[0])
        softmax = OnlineSoftmax(log2_scale, num_rows, self.cfg.exp2_poly, not self.ablated("exp2"),
                                self.cfg.lazy_rescale)
        row_scale = cute.make_rmem_tensor(num_rows, Float32)
        stored = None  # (bits, this thread's first accumulator row, its word of a stored row = lane % 4)
        if cutlass.const_expr(bits is not None):
            stored = (bits, coords[0][0], coords[0][1] // 2)

        if cutlass.const_expr(self.pingpong):
            if wg == 0:  # the first consumer warpgroup goes first (the token carries over from tile to tile)
                cute.arch.barrier_arrive(barrier_id=int(FwdBarrier.TURN_WG1), number_of_threads=256)

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        args = (mQ, mO, mLSE, sO, tma_o, tiled_mma_qk, tiled_mma_pv, frags, acc_O, s_shape, coords, softmax,
                row_scale, pipe_q, pipe_k, pipe_v, tidx, warp_idx, wg, seqlen_k, softmax_scale, aux_tensors,
                aux_scalars, stored)
        if cutlass.const_expr(self.dynamic):
            pipe_tile, slots = handoff
            slot = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, TILE_SLOTS)
            valid, m_block, head, batch, known = take_tile(pipe_tile, slots, slot)
            slot.advance()
            while valid > 0:
                sched = KvSchedule(sparse, batch, head, m_block, num_kv_blocks, known)
                q_state, state = self.consume_tile(*args, m_block, head, batch, sched, q_state, state)
                valid, m_block, head, batch, known = take_tile(pipe_tile, slots, slot)
                slot.advance()
        elif cutlass.const_expr(self.persistent):
            tile, stride, whole_end, split = self.persistent_plan(tiles, num_kv_blocks)
            while tile < whole_end:
                m_block, head, batch = self.persistent_coords(tile, order, tiles)
                sched = KvSchedule(sparse, batch, head, m_block, num_kv_blocks)
                q_state, state = self.consume_tile(*args, m_block, head, batch, sched, q_state, state)
                tile += stride
            if cutlass.const_expr(split is not None):  # this worker's run of the tail, unit by unit
                workspace, flag = tail
                it = split.begin
                while it < split.end:
                    t, part_first, part_end = split.unit(it)
                    m_block, head, batch = self.persistent_coords(split.whole_end + t, order, tiles)
                    sched = KvSchedule(None, batch, head, m_block, num_kv_blocks, part=(part_first, part_end))
                    cut = Int32(cutlass.select_(part_end - part_first < split.blocks, 1, 0))
                    q_state, state = self.consume_tile(*args, m_block, head, batch, sched, q_state, state,
                                                       (split, workspace, flag, t, cut))
                    it = (t + 1) * split.blocks
        else:
            m_block, head, batch, sched = first
            self.consume_tile(*args, m_block, head, batch, sched, q_state, state)
        if cutlass.const_expr(self.separate_o):  # (persistent kernels only)
            if warp_idx == 4:  # the last O store must have read shared memory before the CTA exits
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def consume_tile(self, mQ, mO, mLSE, sO, tma_o, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, frags,
                     acc_O, s_shape, coords, softmax: OnlineSoftmax, row_scale, pipe_q, pipe_k, pipe_v, tidx: Int32,
                     warp_idx: Int32, wg: Int32, seqlen_k: Int32, softmax_scale: Float32, aux_tensors, aux_scalars,
                     stored, m_block: Int32, head: Int32, batch: Int32, sched: KvSchedule, q_state, state,
                     part=None):
        """One Q tile: the KV mainloop, then normalisation and the epilogue. Returns the advanced pipeline states.
        `part` = (split, workspace, flag, tail tile, cut): a unit of the split tail, which, when `cut` is set,
        publishes itself and stores only if it arrived last, merged with the other parts (`kernels.split_tail`)."""
        tSrQ, tSrK, tOrVt, tOrP = frags
        softmax.reset()
        acc_O.fill(0.0)
        seqlen_q = mQ.shape[0]
        q_start = m_block * self.tile_m - self.first_tile_pad(seqlen_q)
        q_last, kv_last = seqlen_q - 1, seqlen_k - 1
        mods = (batch, head, q_start, q_last, kv_last, softmax_scale, aux_tensors, aux_scalars)
        if cutlass.const_expr(stored is not None):  # now also this tile's batch, head and Q tile
            stored = (*stored, batch, head, m_block)

        wait_full(pipe_q, q_state, self.cfg.try_wait_first)
        total = sched.total
        num_partial = sched.num_partial
        if total > 0:
            # First block: S only (its PV happens in the next step).
            acc_S = cute.make_rmem_tensor(s_shape, Float32)
            words = self.stored_words(stored, Int32(0), True)
            wait_full(pipe_k, state, self.cfg.try_wait_first)
            wgmma(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, state.index], True, 0)
            pipe_k.consumer_release(state)
            # The key tail needs masking in the last KV block only, and that block always comes first: dense grids
            # walk the blocks from the last one down, and under a block mask the host lists a ragged last block
            # first among the partial ones (`runtime.sparsity.kernel_block_mask`). So only this step tests for it;
            # inside the loops ptxas turned the test into a second pass of selects on every block.
            n_block = sched.block(0)
            if num_partial > 0:
                self.mod_scores(acc_S, coords, n_block, seqlen_k, mods, True, True, words)
            else:
                self.mod_scores(acc_S, coords, n_block, seqlen_k, mods, False, True)
            if cutlass.const_expr(not self.ablated("softmax")):
                softmax.step(acc_S, row_scale)
            convert_to_16bit(as_operand_a(acc_S), tOrP)
            # Partial blocks (mask_mod), then full blocks (no mask_mod); no key-tail test in either loop.
            for i in cutlass.range(1, num_partial, unroll=1):
                state = self.overlapped_step(i, state, sched, tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt,
                                             tOrP, acc_O, s_shape, coords, softmax, row_scale, pipe_k, pipe_v,
                                             wg, seqlen_k, mods, True, stored)
            for i in cutlass.range(cutlass.max(num_partial, 1), total, unroll=1):
                state = self.overlapped_step(i, state, sched, tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt,
                                             tOrP, acc_O, s_shape, coords, softmax, row_scale, pipe_k, pipe_v,
                                             wg, seqlen_k, mods, False, None)
            self.release_q_after_mainloop(pipe_q, q_state)
            # Last block: PV only.
            wait_full(pipe_v, state, self.cfg.try_wait_first)
            if cutlass.const_expr(self.cfg.rescale_before_pv and not self.ablated("softmax")):
                rescale_rows(acc_O, row_scale)
            if cutlass.const_expr(not self.ablated("pv")):
                wgmma(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, state.index], False, 0)
            pipe_v.consumer_release(state)
            state.advance()
        else:
            self.release_q_after_mainloop(pipe_q, q_state)

        lse = cute.make_rmem_tensor(cute.size(row_scale), Float32)
        softmax.finalize(lse, row_scale)
        rescale_rows(acc_O, row_scale)
        keep = None  # whole tiles always store
        if cutlass.const_expr(part is not None):
            split, workspace, flag, t, cut = part
            rank = Int32(0)
            if cutlass.const_expr(self.cluster_m > 1):
                rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            keep = Int32(1)
            if cut != 0:
                keep = publish_and_arrive(split, workspace, flag, acc_O, lse, t, rank, self.cluster_m, tidx,
                                          self.num_consumer_threads)
                if keep != 0:
                    merge_parts(split, workspace, acc_O, lse, t, rank, self.cluster_m, tidx,
                                self.num_consumer_threads)
        self.epilogue(acc_O, lse, coords, mO, mLSE, sO, tma_o, tiled_mma_pv, pipe_q, q_state, tidx, warp_idx,
                      m_block, head, batch, seqlen_q, keep)
        q_state.advance()
        return q_state, state

    def first_tile_pad(self, seqlen_q):
        """Rows Q tile 0 starts before row 0: the padding of a ragged last tile, moved to the first one
        (`FwdConfig.ragged_first_tile`), else 0."""
        if cutlass.const_expr(self.cfg.ragged_first_tile):
            return cute.ceil_div(seqlen_q, self.tile_m) * self.tile_m - seqlen_q
        return Int32(0)

    def rows_of_tiles(self, mX):
        """`mX` (rows, head_dim) of one head, shifted so that tile t of `local_tile` covers the rows Q tile t covers
        (`first_tile_pad`): with `ragged_first_tile` tile 0 starts at a negative row, which TMA zero-fills on loads;
        a TMA store there is an illegal instruction, so that tile's O leaves by `store_rows` instead."""
        if cutlass.const_expr(self.cfg.ragged_first_tile):
            return cute.domain_offset((-self.first_tile_pad(mX.shape[0]), 0), mX)
        return mX

    @cute.jit
    def store_rows(self, rO, tiled_mma_pv, tidx: Int32, mO_rows, q_base: Int32, head: Int32, batch: Int32):
        """This thread's O elements of the rows at or after row 0 of a tile that starts at row `q_base` < 0, stored
        one by one (`ragged_first_tile`: one tile per head, so their cost is small beside its GEMMs)."""
        coords = tiled_mma_pv.get_slice(tidx).partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim)))
        for i in cutlass.range_constexpr(cute.size(rO)):
            q_idx = q_base + coords[i][0]
            if q_idx >= 0:
                mO_rows[q_idx, coords[i][1], head, batch] = rO[i]

    def release_q_after_mainloop(self, pipe_q, q_state):
        """Persistent kernel with its own O buffer: Q is free once this warpgroup's last QK GEMM has completed."""
        if cutlass.const_expr(self.persistent and self.separate_o):
            pipe_q.consumer_release(q_state)

    @cute.jit
    def overlapped_step(self, i: Int32, state, sched: KvSchedule, tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt,
                        tOrP, acc_O, s_shape, coords, softmax: OnlineSoftmax, row_scale, pipe_k, pipe_v, wg: Int32,
                        seqlen_k: Int32, mods, use_mask_mod: cutlass.Constexpr[bool], stored):
        """S_i = Q K_i^T and O += P_{i-1} V_{i-1} issued back to back; softmax(S_i) overlaps the PV GEMM. Never the
        ragged last KV block (that one is step 0), so no key-tail mask."""
        no_pv = self.ablated("pv")
        serial = self.ablated("overlap")  # each GEMM waited for at once: nothing overlaps the softmax
        with_softmax = not self.ablated("softmax")
        prev = state.clone()
        state.advance()
        early_mask = cutlass.const_expr(self.cfg.mask_early and use_mask_mod and self.mask_mod is not None
                                        and not self.ablated("mask_mod"))
        n_block = Int32(0)
        if cutlass.const_expr(self.cfg.early_block_index or early_mask):
            n_block = sched.block_of_kind(i, use_mask_mod)  # issued before the waits: its latency hides behind them
        acc_S = cute.make_rmem_tensor(s_shape, Float32)
        wait_full(pipe_k, state, self.cfg.try_wait_first)
        self.wait_turn(wg)
        stage, prev_stage = state.index, prev.index
        if cutlass.const_expr(self.cfg.uniform_stage):
            stage, prev_stage = cute.arch.make_warp_uniform(stage), cute.arch.make_warp_uniform(prev_stage)
        wgmma(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, stage], True, 0 if serial else -1)
        if cutlass.const_expr(self.cfg.rescale_before_pv and with_softmax):
            rescale_rows(acc_O, row_scale)  # by the previous block's row scale, while the QK GEMM runs
        wait_full(pipe_v, prev, self.cfg.try_wait_first)
        if cutlass.const_expr(not no_pv):
            wgmma(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, prev_stage], False, 0 if serial else -1)
        self.pass_turn(wg)
        words = self.stored_words(stored, i, use_mask_mod)
        keep_bits = None
        band = band_for(self.mask_mod, acc_S, self.cfg.band_mask) if early_mask else None
        if cutlass.const_expr(early_mask):
            batch, head, q_start, q_last, kv_last, _, aux_tensors, aux_scalars = mods
            if cutlass.const_expr(band is not None):  # a band's words: index arithmetic alone
                keep_bits = cute.make_rmem_tensor(FRAGMENT_ROWS, cutlass.Uint32)
                band_words(keep_bits, cute.size(acc_S), coords, band, batch, head, q_start, n_block * self.tile_n,
                           aux_tensors, aux_scalars)
            else:
                keep_bits = cute.make_rmem_tensor(-(-cute.size(acc_S) // 32), cutlass.Uint32)
                mask_mod_bits(keep_bits, coords, self.mask_mod, batch, head, q_start, n_block * self.tile_n, q_last,
                              kv_last, self.clamp_indices, aux_tensors, aux_scalars)
        warpgroup.wait_group(0 if no_pv else 1)  # S_i ready; PV still on the tensor cores
        # Partial blocks that evaluate mask_mod keep ptxas's schedule: a mask's live values beside a P.V operand held
        # longer raised spills (gallery block_diffusion 156 -> 216 bytes).
        anchored = cutlass.const_expr(self.cfg.anchored_release and with_softmax
                                      and (not use_mask_mod or self.mask_mod is None or stored is not None))
        if cutlass.const_expr(not anchored):
            pipe_k.consumer_release(state)
        if cutlass.const_expr(not (self.cfg.early_block_index or early_mask)):
            n_block = sched.block_of_kind(i, use_mask_mod)
        self.mod_scores(acc_S, coords, n_block, seqlen_k, mods, use_mask_mod and not early_mask, False, words)
        if cutlass.const_expr(early_mask):
            if cutlass.const_expr(band is not None):
                apply_band_words(acc_S, keep_bits)
            else:
                apply_mask_bits(acc_S, keep_bits)
        moved = None
        if cutlass.const_expr(with_softmax):
            # (partial blocks rescale eagerly: a heavy inline mask spilled more with the vote's registers, and with
            # stored bits ptxas hoisted the P.V wait above the exponentials again; they are a few steps of a tile)
            moved = softmax.step(acc_S, row_scale, use_mask_mod)
        if cutlass.const_expr(anchored):
            release_after(pipe_k, state, acc_S[0])  # once the first probability is known
        warpgroup.wait_group(0)
        pipe_v.consumer_release(prev)
        convert_to_16bit(as_operand_a(acc_S), tOrP)
        if cutlass.const_expr(with_softmax and not self.cfg.rescale_before_pv):
            if cutlass.const_expr(moved is None):
                rescale_rows(acc_O, row_scale)
            else:
                if moved:  # lazy rescaling: while no row of this warp moves its reference, every row_scale is 1
                    rescale_rows(acc_O, row_scale)
        return state

    def stored_words(self, stored, position: Int32, partial: cutlass.Constexpr[bool]):
        """With `mask_bits`, this thread's words of partial block `position` (a trace-time helper; `partial`:
        the step is a partial block's), else None. Step 0 loads them whatever its block (position 0 always exists)."""
        if cutlass.const_expr(stored is None or not partial or self.ablated("mask_mod")):
            return None
        bits, row, word, batch, head, m_block = stored
        words = cute.make_rmem_tensor(FRAGMENT_ROWS, cutlass.Uint32)
        load_fragment_bits(words, bits, batch, head, m_block, position, row, word)
        return words

    @cute.jit
    def mod_scores(self, acc_S, coords, n_block: Int32, seqlen_k: Int32, mods,
                   use_mask_mod: cutlass.Constexpr[bool], mask_tail: cutlass.Constexpr[bool], words=None):
        """score_mod, then mask_mod (partial blocks only; from the stored `words` with `mask_bits`), then the
        key-tail mask (`mask_tail`: step 0 only)."""
        batch, head, q_start, q_last, kv_last, softmax_scale, aux_tensors, aux_scalars = mods
        kv_start = n_block * self.tile_n
        if cutlass.const_expr(self.score_mod is not None and not self.ablated("score_mod")):
            apply_score_mod(acc_S, coords, self.score_mod, softmax_scale, batch, head, q_start, kv_start, q_last,
                            kv_last, self.clamp_indices, aux_tensors, aux_scalars)
        if cutlass.const_expr(use_mask_mod and words is not None):
            apply_fragment_bits(acc_S, words)
        elif cutlass.const_expr(use_mask_mod and self.mask_mod is not None and not self.ablated("mask_mod")):
            band = band_for(self.mask_mod, acc_S, self.cfg.band_mask)
            if cutlass.const_expr(band is not None):
                apply_band_mask(acc_S, coords, band, batch, head, q_start, kv_start, aux_tensors, aux_scalars)
            else:
                apply_mask_mod(acc_S, coords, self.mask_mod, batch, head, q_start, kv_start, q_last, kv_last,
                               self.clamp_indices, aux_tensors, aux_scalars)
        if cutlass.const_expr(mask_tail):
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
    def epilogue(self, acc_O, lse, coords, mO, mLSE, sO, tma_o, tiled_mma_pv, pipe_q, q_state, tidx: Int32,
                 warp_idx: Int32, m_block: Int32, head: Int32, batch: Int32, seqlen_q: Int32, keep=None):
        """O -> 16 bit -> shared memory (over Q, or its own buffer) -> one TMA store; LSE from the lanes that own
        column 0. `keep` (split tail): 0 for a part of a cut tile that another part stores, which then writes
        neither; the shared-memory steps and barriers run all the same."""
        store = not self.ablated("store")
        # (`ragged_first_tile`: O's TMA tensor and O as a plain tensor, for the first tile's stores)
        mO_tma = mO[0] if cutlass.const_expr(self.cfg.ragged_first_tile) else mO
        mO_rows = mO[1] if cutlass.const_expr(self.cfg.ragged_first_tile) else None
        q_base = m_block * self.tile_m - self.first_tile_pad(seqlen_q)
        rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
        convert_to_16bit(acc_O, rO)
        if cutlass.const_expr(self.separate_o):
            if warp_idx == 4:  # the previous tile's O store has finished reading sO (its lane waits, others pass)
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        # All warpgroups must be done reading Q (or the last O store done reading sO) before O overwrites it.
        cute.arch.barrier(barrier_id=int(FwdBarrier.EPILOGUE), number_of_threads=self.num_consumer_threads)
        if cutlass.const_expr(store):
            st_atom = cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
            thr_st = cute.make_tiled_copy_C(st_atom, tiled_mma_pv).get_slice(tidx)
            cute.copy(st_atom, thr_st.retile(rO), thr_st.partition_D(sO))
        else:
            # Ablation: a store that never happens (seqlen_q is never negative) keeps O live, so that the compiler
            # cannot delete the P·V GEMMs whose results nothing would read any more.
            if cutlass.const_expr(mLSE is not None):  # (sweeps run ablations with the LSE output)
                if seqlen_q < 0:
                    mLSE[0, head, batch] = acc_O[0]

        writes = Int32(1) if keep is None else keep  # (a constant for whole tiles: the tests fold away)
        if cutlass.const_expr(mLSE is not None):
            c_rows = rows_view(coords)
            if c_rows[0, 0][1] == 0:
                if writes != 0:
                    for r in cutlass.range_constexpr(cute.size(lse)):
                        q_idx = q_base + c_rows[r, 0][0]
                        if q_idx < seqlen_q:
                            if cutlass.const_expr(self.cfg.ragged_first_tile):
                                if q_idx >= 0:  # (the first tile's rows before 0)
                                    mLSE[q_idx, head, batch] = lse[r]
                            else:
                                mLSE[q_idx, head, batch] = lse[r]

        tma_writes = writes
        if cutlass.const_expr(store and self.cfg.ragged_first_tile):
            if q_base < 0:  # the first tile: its rows from 0 on, from registers; no TMA store
                self.store_rows(rO, tiled_mma_pv, tidx, mO_rows, q_base, head, batch)
            tma_writes = cutlass.select_(q_base < 0, Int32(0), writes)
        if cutlass.const_expr(store):
            stored = int(FwdBarrier.O_STORED if self.persistent else FwdBarrier.EPILOGUE)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier_arrive(barrier_id=stored, number_of_threads=self.num_consumer_threads + 32)
            if warp_idx == 4:
                cute.arch.barrier(barrier_id=stored, number_of_threads=self.num_consumer_threads + 32)
                gO = cute.local_tile(self.rows_of_tiles(mO_tma[None, None, head, batch]),
                                     (self.tile_m, self.head_dim), (m_block, 0))
                tOsO, tOgO = tma_tiles(tma_o, sO, gO)
                with cute.arch.elect_one():
                    if tma_writes != 0:
                        cute.copy(tma_o, tOsO, tOgO)
                    cute.arch.cp_async_bulk_commit_group()
                    if cutlass.const_expr(not self.separate_o):
                        cute.arch.cp_async_bulk_wait_group(0, read=True)
        if cutlass.const_expr(self.persistent and not self.separate_o):
            if warp_idx == 4:  # O (over Q) has been read by the store: the next tile's Q may land
                cute.arch.sync_warp()
                pipe_q.consumer_release(q_state)
