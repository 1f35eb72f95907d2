"""flexlab's Hopper (sm90a) backward attention kernel with flex hooks.

One CTA owns `tile_n` rows of K and V of one KV head (64 rows per consumer warpgroup) and walks every query tile that
attends to them, for every query head of its GQA group, so dK and dV are complete sums when the CTA ends: they are
stored once, without atomics, and are the same bits on every run. At head dim 256 (`BwdConfig.split_head_dim`) the
two consumer warpgroups share 64 key rows instead: each forms S^T and dP^T for half the step's query columns, writes
P^T and dS^T to shared memory, and after one barrier accumulates dV and dK for half the head dim from both halves
(A operands read transposed from shared memory), as the registers of a 64 x 256 fp32 dK and dV would not fit one
warpgroup.

  * warpgroup 0 is the producer: one warp loads K and V once, then Q and dO tiles into a `num_stages` ring (TMA);
    a second warp (the dQ warp, `BwdConfig.dq_warp`, on by default) issues the consumers' dQ reduces;
  * consumers compute the transposed scores S^T = K Q^T and dP^T = V dO^T, so P^T and dS^T come out of the
    accumulators already in the layout the dV += P^T dO and dK += dS^T Q GEMMs want as register operands;
  * P is recomputed from the forward's LSE (base 2, from `bwd_preprocess`): P = exp2(score_mod(s) * c - LSE2), with
    mask_mod applied on partial blocks only and the key tail masked; dS = P * (dP - D);
  * the code generator's `score_mod_bwd` turns dS into the gradient of the raw score, and `score_mod_aux_grad` adds
    the gradients of captured tensors (learnable biases), summed per thread in runs before their atomics
    (`bwd_aux_grad.GradRun`), both inlined per element;
  * dS is written to shared memory (double-buffered), both warpgroups compute half of dQ = dS K each (or, for
    steps that are not a multiple of 64 rows, half of dQ^T = K^T dS^T: `BwdConfig.dq_swap_ab`) and write it
    to a shared-memory slab in their accumulators' register order, which the dQ warp adds into the fp32 dQ buffer
    with one TMA reduce-add per warpgroup (`bwd_postprocess` puts the elements in place and scales them);
  * epilogue: dK (times the softmax scale) and dV go to shared memory over K and V and out with TMA stores.

The kernel's pieces live in one module each: `bwd_producer` (the TMA producer warp), `bwd_step` (the per-step math of
a consumer warpgroup) and `bwd_dq` (the dQ partial's way to global memory); this module holds the configuration,
the host launch, the role split, the consumer loop and the dK/dV epilogue.

Query-direction block sparsity comes from torch's BlockMask (q_num_blocks/q_indices and the full_* pair), walked by
the forward's `KvSchedule` with the roles of Q and KV swapped: partial blocks (mask_mod) first, then full blocks.

CTA order: KV tiles first (the CTAs of one head side by side, sharing Q and dO in L2); with a block mask outside
deterministic mode, the launcher's longest-first order within L2-sized head groups (`BwdConfig.lpt_order`); in
deterministic mode, the launcher's turn order (`bwd_launch.turn_tile_order`).

A cut last wave (dense, `BwdConfig.whole_tiles_only` then `BwdConfig.split_tail`): this kernel runs the whole
waves of tiles, and a second one the tiles after them, each as `parts` CTAs over shares of its query steps whose dK
and dV the last to finish adds up (`kernels.split_tail.TailPiece`).

Persistent CTAs (`BwdConfig.persistent_ctas`, where KV tiles walk few query tiles): one CTA per SM takes the tiles
in that same order, the producer warp claiming each next one from a global counter and handing it to the consumers
and the dQ warp through shared-memory slots (`tile_scheduler`). The consumers give K and V back after a tile's last
step and stage dK and dV in the dS buffers, so the next tile's K, V and first Q/dO stages load during the epilogue.

Deterministic mode: dK/dV are already run-to-run identical (one CTA, fixed order). dQ partials are fp32 sums over KV
tiles, so their order is fixed: before the TMA reduce-add of a warpgroup's partial into Q tile m, the issuing warp
waits (acquire) until a semaphore for (batch, head, m, half) counts the KV tiles that visit m before it (the lower
ones, n_block, when dense; with a block mask a host-built rank table, the higher ones first under the launcher's turn
order), and releases it once the reduce has landed. CTAs are launched in that turn order, so a CTA only ever waits
for CTAs launched before it. Captured-tensor gradients are
accumulated through `bwd_aux_grad.add_aux_grad`, which turns them into exact int64 fixed-point atomics in
deterministic mode.
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
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warp, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from .bwd_aux_grad import GradRun, flush_aux_grads
from .bwd_config import BwdConfig
from .bwd_dq import (DQ_HANDOFF_THREADS, SLAB_LINE, BwdDqReduce, dq_accum_lines, dq_fragment_shape, dq_issuer,
                     dq_slab_layout, fragment_order, make_dq_tiled_mma)
from .bwd_producer import BwdProducer
from .bwd_step import BwdStep, StepOperands, opaque_i32
from .config import TILE_SLOT_WORDS, TILE_SLOTS
from .layout import bshd_view, convert_to_16bit, tma_tiles, transpose_smem
from .named_barrier import BwdBarrier
from .split_tail import TailPiece, add_parts, publish_sums
from .stage_waits import QdoStages
from .tile_scheduler import consumer_state_at, take_tile

__all__ = ["BwdBarrier", "FlexBwdSm90", "dq_issuer", "fake_arguments"]

LOG2_E = math.log2(math.e)


class FlexBwdSm90(BwdProducer, BwdStep, BwdDqReduce):
    """Compile-time configuration of one backward kernel: tiles, dtype, and the inlined generated mods."""

    def __init__(self, cfg: BwdConfig, dtype, score_mod: Optional[Callable] = None,
                 score_mod_bwd: Optional[Callable] = None, aux_grad: Optional[Callable] = None,
                 mask_mod: Optional[Callable] = None, has_aux_tensors: bool = False, deterministic: bool = False,
                 grad_runs: bool = True, aux_grad_reads_score: bool = True):
        self.cfg = cfg.validate()
        self.dtype = dtype
        self.score_mod, self.score_mod_bwd, self.aux_grad, self.mask_mod = score_mod, score_mod_bwd, aux_grad, mask_mod
        if score_mod is None and (score_mod_bwd is not None or aux_grad is not None):
            raise ValueError("score_mod_bwd / aux_grad need the forward score_mod they differentiate")
        self.clamp_indices = has_aux_tensors
        # Captured-tensor gradients summed in per-thread runs before their atomics (`bwd_aux_grad.GradRun`); off for
        # generated code that does not add through `add_aux_grad` (it would index the buffers itself).
        self.grad_runs = grad_runs and aux_grad is not None
        # Deterministic: the dQ partials of one query tile are reduced in a fixed order of KV tiles (a semaphore per
        # tile and warpgroup half, taken in turn), so the fp32 sums, and so dQ, are the same bits on every run.
        self.deterministic = deterministic
        self.tile_m, self.tile_n, self.head_dim = cfg.tile_m, cfg.tile_n, cfg.head_dim
        self.mask_early = cfg.mask_early
        self.num_stages = cfg.num_stages
        self.num_wg = cfg.num_consumer_wgs
        self.num_consumer_threads = 128 * self.num_wg
        self.producer_regs, self.consumer_regs = cfg.register_split
        self.stats_in_smem, self.dk_after_dq = cfg.stats_in_smem, cfg.dk_after_dq
        self.try_wait_first = cfg.try_wait_first
        self.kv_tiles_first, self.dq_split_rows = cfg.kv_tiles_first, cfg.dq_split_rows
        self.dq_swap_ab = cfg.dq_swap_ab
        # Each consumer warpgroup's box of the dQ partial: all tile_m rows and head_dim / warpgroups columns, or (with
        # dq_split_rows) 64 rows and every column.
        self.dq_rows = 64 if self.dq_split_rows else self.tile_m
        self.dq_cols = self.head_dim if self.dq_split_rows else self.head_dim // self.num_wg
        # Where registers are tight, the dS store's swizzled base address is rebuilt in every step from the thread
        # index (about 30 integer instructions) instead of staying live: with dK's register operand beside the dQ
        # store (dk_after_dq), and with LSE2/D rows in shared memory on the block-sparse walk or 128-row tiles,
        # where keeping it spilled 8 bytes. Elsewhere it stays live (`consume` decides, knowing `sparse`).
        self.rebuild_ds_store = self.dk_after_dq
        # Lean register plan (a score_mod with a derivative to apply at D=128, or at D=64 with 128-row query tiles):
        # fp32 dK+dV (head_dim per thread), S, dP and the pre-mod scores (tile_m / 2 each) do not fit in 240
        # registers together, so dP^T is computed only after P is formed, and P is kept in 16 bits from then on.
        # A score_mod whose derivative is 1 (an additive bias) comes with no score_mod_bwd: dS is used as it is, and
        # unless its captured-tensor gradients read the score (`aux_grad_reads_score`: a multiplied weight's do, a
        # learnable bias table's do not) the pre-mod scores are never kept. Without captured-tensor gradients the
        # full plan then fits; with them the per-score index math and the open runs take the lean plan's registers
        # (the full plan spilled 64 bytes for a learnable relative bias at D=128 under a causal mask).
        self.needs_raw_scores = score_mod_bwd is not None or (aux_grad is not None and aux_grad_reads_score)
        # Head dim 256 (`BwdConfig.split_head_dim`): two warpgroups share the 64 key rows, so each holds half of
        # every accumulator and the full plan fits; P^T and dS^T reach the dV and dK GEMMs through shared memory.
        self.split = cfg.split_head_dim
        self.lean = ((self.needs_raw_scores or aux_grad is not None) and self.head_dim + self.tile_m > 128
                     and not self.split)
        self.early_dv = cfg.early_dv and not self.lean  # (the lean plan issues dV early in its own way)
        # `BwdConfig.split_qdo_wait` outside the lean plan: there the second wait, after P is formed, spilled 16 bytes
        # (learnable relative bias at D=128)
        self.split_qdo = cfg.split_qdo_wait and not self.lean
        self.dq_warp = cfg.dq_warp
        self.dq_red = cfg.dq_red
        self.persistent = cfg.persistent
        # `BwdConfig.partial_index_only`, where the consumers use a step's query-tile index on partial steps alone:
        # no score_mod (it reads the query index of every score), the dQ partial handed to the dQ warp, the LSE2/D
        # rows read from shared memory, no deterministic turns (they are keyed by the tile); not with stored mask
        # bits, where it measured level to slower.
        self.partial_index_only = (cfg.partial_index_only and score_mod is None and self.dq_warp and not self.dq_red
                                   and self.stats_in_smem and not deterministic and not cfg.mask_bits)
        if (cfg.split_tail or cfg.whole_tiles_only) and deterministic:
            raise ValueError("split_tail adds a cut tile's dK and dV in whichever order its parts finish, and its "
                             "parts' dQ turns would not follow the launch order: not in deterministic mode")
        if cfg.rotate_dense_walk and deterministic:
            raise ValueError("rotate_dense_walk starts each KV tile at a query tile of its own; deterministic mode "
                             "adds the dQ partials in a fixed tile order, which that walk would turn into waits")
        if self.persistent and deterministic:
            raise ValueError("persistent backward CTAs take tiles as they come; deterministic mode's dQ turns need "
                             "the launch order (persistent_ctas=0)")

    def stats_bytes(self) -> int:
        """Bytes of LSE2 and D rows that land with each Q/dO stage (0 unless stats_in_smem)."""
        return 2 * self.tile_m * 4 if self.stats_in_smem else 0

    def shared_storage(self, sKV_layout, sQ_layout, sdS_layout, sdQ_layout):
        """The shared-memory struct (mirrored by `BwdConfig.smem_bytes`): mbarriers and the optional per-stage
        LSE2/D rows first, then the tile buffers, 1 KiB aligned for the 128-byte swizzle."""
        Align, MemRange = cute.struct.Align, cute.struct.MemRange
        fields = {"mbar_kv": MemRange[Int64, 2], "mbar_qdo": MemRange[Int64, 2 * self.num_stages]}
        if self.split_qdo:  # dO's own full and empty barriers (`stage_waits.QdoStages`)
            fields["mbar_do"] = MemRange[Int64, 2 * self.num_stages]
        if self.cfg.anchored_wait:  # nobody waits on it (`stage_waits.arrive_after`)
            fields["mbar_anchor"] = MemRange[Int64, 1]
        if self.persistent:  # the producer warp's tile hand-over (`tile_scheduler.hand_over_words`)
            fields.update(mbar_tile=MemRange[Int64, 2 * TILE_SLOTS],
                          tile_slots=MemRange[Int32, TILE_SLOTS * TILE_SLOT_WORDS])
        if self.cfg.split_tail:  # which part of a cut tile came last (`split_tail.arrive`)
            fields["split_flag"] = Align[MemRange[Int32, 4], 16]
        if self.stats_in_smem:  # bulk-copy destinations: 16-byte aligned
            rows = self.tile_m * self.num_stages
            fields.update(sLSE2=Align[MemRange[Float32, rows], 16], sDpsum=Align[MemRange[Float32, rows], 16])
        for name, dtype, layout in (("sK", self.dtype, sKV_layout), ("sV", self.dtype, sKV_layout),
                                    ("sQ", self.dtype, sQ_layout), ("sdO", self.dtype, sQ_layout),
                                    ("sdS", self.dtype, sdS_layout), ("sdQ", Float32, sdQ_layout)):
            if name == "sdQ" and self.dq_red:  # the partials go from registers to global memory
                continue
            fields[name] = Align[MemRange[dtype, cute.cosize(layout)], 1024]
        # Built from a dict (not a class body) so the field list can depend on the configuration.
        Storage = cute.struct(type("Storage", (), {"__annotations__": fields}))
        return Storage

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mLSE2: cute.Tensor,
                 mDpsum: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
                 softmax_scale: Float32, qhead_per_kvhead: Int32, sparse, aux_tensors: tuple, aux_scalars: tuple,
                 aux_grads: tuple, mdQsem, mRank, mTileOrder, tile_counter, split_tail, stream: cuda.CUstream):
        """mQ/mdO (B, Hq, Sq, D), mK/mV/mdK/mdV (B, Hkv, Skv, D); mLSE2/mDpsum (B, Hq, Sq_pad) and mdQaccum
        (B, Hq, Sq_pad, D) fp32 with Sq_pad a multiple of tile_m; `sparse` = Q-direction block lists or None.
        Deterministic mode: mdQsem (B, Hq, Sq_pad / tile_m, consumer warpgroups) int32 zeros, and with a block mask
        mRank (Bm, Hm, KV tiles, Q tiles) int32: how many KV tiles visit that Q tile before this one in turn. With
        `lpt_order`, mTileOrder (B * Hkv * KV tiles, 3) int32: the (KV tile, KV head, batch) CTA i works on. With
        `persistent_ctas`, tile_counter: the zeroed int32 (1,) counter the CTAs claim tiles from (left at 0). With
        `whole_tiles_only`, split_tail = (whole tiles,): the CTAs of later tiles do nothing; with `split_tail`,
        split_tail = (whole tiles, parts per cut tile, zeroed int32 arrival counters, fp32 partials): this kernel runs
        the parts of the tiles after the whole ones (`kernels.split_tail.TailPiece`)."""
        if cutlass.const_expr((self.cfg.split_tail or self.cfg.whole_tiles_only) and sparse is not None):
            raise ValueError("BwdConfig.split_tail cuts tiles into even shares of their query steps: dense grids only")
        mQ, mK, mV, mdO, mdK, mdV = [bshd_view(t) for t in (mQ, mK, mV, mdO, mdK, mdV)]
        tile_m, tile_n, hd = self.tile_m, self.tile_n, self.head_dim
        mdQlines = dq_accum_lines(mdQaccum, hd)
        if cutlass.const_expr(self.split):
            # the warpgroups split S^T and dP^T by query columns and dK, dV by head-dim columns; P^T and dS^T are
            # read transposed from shared memory (key rows contiguous: wgmma's MN-major A)
            tiled_mma_sdp = sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.K, Float32,
                atom_layout_mnk=(1, self.num_wg, 1), tiler_mn=(64, tile_m // self.num_wg))
            tiled_mma_dkv = sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, OperandMajorMode.MN, OperandMajorMode.MN, Float32,
                atom_layout_mnk=(1, self.num_wg, 1), tiler_mn=(64, hd // self.num_wg))
        else:
            tiled_mma_sdp = sm90_utils.make_trivial_tiled_mma(  # S^T = K Q^T and dP^T = V dO^T
                self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.K, Float32,
                atom_layout_mnk=(self.num_wg, 1, 1), tiler_mn=(64, tile_m))
            tiled_mma_dkv = sm90_utils.make_trivial_tiled_mma(  # dV += P^T dO, dK += dS^T Q (A from registers)
                self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.MN, Float32,
                atom_layout_mnk=(self.num_wg, 1, 1), tiler_mn=(64, hd), a_source=warpgroup.OperandSource.RMEM)
        tiled_mma_dq = make_dq_tiled_mma(self.dtype, hd, self.num_wg, self.dq_split_rows, self.dq_swap_ab, tile_m)

        atom_d = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, hd), self.dtype)
        atom_ds = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, tile_n), self.dtype)
        sKV_layout = cute.tile_to_shape(atom_d, (tile_n, hd), order=(0, 1))
        sQ_layout = cute.tile_to_shape(atom_d, (tile_m, hd, self.num_stages), order=(0, 1, 2))
        # two dS buffers (one step's, while the other warpgroup may still read the last); with `split`, stages 2-3
        # hold P the same way
        sdS_layout = cute.tile_to_shape(atom_ds, (tile_m, tile_n, 4 if self.split else 2), order=(0, 1, 2))
        # fp32 dQ partials, one slab of dq_rows * dq_cols elements per warpgroup, in fragment order (`bwd_dq`)
        slab_elems = self.dq_rows * self.dq_cols
        sdQ_layout = dq_slab_layout(slab_elems, self.num_wg)

        load_op, store_op = cpasync.CopyBulkTensorTileG2SOp(), cpasync.CopyBulkTensorTileS2GOp()
        one_stage = cute.select(sQ_layout, mode=[0, 1])
        tma_q, mQ_t = cpasync.make_tiled_tma_atom(load_op, mQ, one_stage, (tile_m, hd))
        tma_do, mdO_t = cpasync.make_tiled_tma_atom(load_op, mdO, one_stage, (tile_m, hd))
        tma_k, mK_t = cpasync.make_tiled_tma_atom(load_op, mK, sKV_layout, (tile_n, hd))
        tma_v, mV_t = cpasync.make_tiled_tma_atom(load_op, mV, sKV_layout, (tile_n, hd))
        tma_dk, mdK_t = cpasync.make_tiled_tma_atom(store_op, mdK, sKV_layout, (tile_n, hd))
        tma_dv, mdV_t = cpasync.make_tiled_tma_atom(store_op, mdV, sKV_layout, (tile_n, hd))
        if cutlass.const_expr(self.dq_red or self.cfg.dq_bulk_reduce):  # the plain accumulator: no TMA reduce
            tma_dq, mdQ_t = None, mdQlines
        else:
            tma_dq, mdQ_t = cpasync.make_tiled_tma_atom(cpasync.CopyReduceBulkTensorTileS2GOp(), mdQlines,
                                                        cute.select(sdQ_layout, mode=[0, 1]),
                                                        (slab_elems // SLAB_LINE, SLAB_LINE))
        if cutlass.const_expr(self.stats_in_smem):
            # The producer's bulk copies of LSE2/D rows need 16-byte aligned sources. Row offsets are multiples of
            # tile_m * 4 bytes (the launcher pads rows to whole tiles) and torch allocations are 256-byte aligned.
            mLSE2, mDpsum = [cute.make_tensor(cute.make_ptr(Float32, t.iterator.toint(), cute.AddressSpace.gmem,
                                                            assumed_align=16), t.layout) for t in (mLSE2, mDpsum)]
        Storage = self.shared_storage(sKV_layout, sQ_layout, sdS_layout, sdQ_layout)

        # P = exp2(x * c - LSE2): x is the raw score (c folds in the softmax scale) or the modded, scaled score.
        log2_scale = Float32(LOG2_E) if cutlass.const_expr(self.score_mod is not None) else softmax_scale * LOG2_E
        # Grid (KV heads, batch, KV tiles), or with kv_tiles_first (KV tiles, KV heads, batch). Either way a lower
        # KV tile of the same (batch, head) is launched earlier, which deterministic mode's dQ ordering relies on
        # (with a table, `bwd_launch.turn_tile_order` launches every tile after those it waits for).
        grid = [cute.size(mK.shape[2]), cute.size(mK.shape[3]), cute.ceil_div(mK.shape[0], tile_n)]
        if cutlass.const_expr(self.kv_tiles_first):
            grid = [cute.ceil_div(mK.shape[0], tile_n), cute.size(mK.shape[2]), cute.size(mK.shape[3])]
        if cutlass.const_expr(mTileOrder is not None):  # one CTA per row of the launcher's order
            grid = [cute.size(mTileOrder.shape[0]), 1, 1]
        if cutlass.const_expr(self.persistent):  # at most persistent_ctas CTAs walking the tiles in that order
            grid = [cutlass.min(grid[0] * grid[1] * grid[2], self.cfg.persistent_ctas), 1, 1]
        if cutlass.const_expr(self.cfg.split_tail):  # `parts` CTAs per tile after the whole ones
            whole, parts = split_tail[0], split_tail[1]
            grid = [(grid[0] * grid[1] * grid[2] - whole) * parts, 1, 1]
        self.kernel(mQ_t, mK_t, mV_t, mdO_t, mdK_t, mdV_t, mdQ_t, mLSE2, mDpsum, tma_q, tma_k, tma_v, tma_do,
                    tma_dk, tma_dv, tma_dq, softmax_scale, log2_scale, qhead_per_kvhead, sparse, aux_tensors,
                    aux_scalars, aux_grads, mdQsem, mRank, mTileOrder, tile_counter, split_tail, sKV_layout,
                    sQ_layout, sdS_layout,
                    sdQ_layout, tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq, Storage).launch(
            grid=grid, block=[self.cfg.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1,
            use_pdl=self.cfg.split_tail or self.cfg.chained_launch)  # (the parts start while the last wave runs)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mdK: cute.Tensor,
               mdV: cute.Tensor, mdQ: cute.Tensor, mLSE2: cute.Tensor, mDpsum: cute.Tensor,
               tma_q: cute.CopyAtom, tma_k: cute.CopyAtom, tma_v: cute.CopyAtom, tma_do: cute.CopyAtom,
               tma_dk: cute.CopyAtom, tma_dv: cute.CopyAtom, tma_dq, softmax_scale: Float32,
               log2_scale: Float32, qhead_per_kvhead: Int32, sparse, aux_tensors, aux_scalars, aux_grads, mdQsem,
               mRank, mTileOrder, tile_counter, split_tail,
               sKV_layout: cute.ComposedLayout, sQ_layout: cute.ComposedLayout, sdS_layout: cute.ComposedLayout,
               sdQ_layout: cute.Layout, tiled_mma_sdp: cute.TiledMma, tiled_mma_dkv: cute.TiledMma,
               tiled_mma_dq: cute.TiledMma, Storage: cutlass.Constexpr):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if cutlass.const_expr(self.cfg.whole_tiles_only and not self.cfg.chained_launch):
            # the parts' kernel (launched behind this one with programmatic dependent launch) may start once every
            # CTA here has: its CTAs then take the SMs this kernel's last wave frees
            cute.arch.griddepcontrol_launch_dependents()
        bits = None  # `mask_bits`: partial-block masks stored as bits, passed after the four block lists
        if cutlass.const_expr(self.cfg.mask_bits):
            bits = sparse[4]
            sparse = (sparse[0], sparse[1], sparse[2], sparse[3])
        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v, tma_do, tma_dk, tma_dv, tma_dq):
                if cutlass.const_expr(atom is not None):  # (no dQ reduce atom with `dq_red`, `dq_bulk_reduce`)
                    cpasync.prefetch_descriptor(atom)
        storage = SmemAllocator().allocate(Storage)
        consumer_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumer_threads // 32)
        tma_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        kv_bytes = self.tile_n * self.head_dim * self.dtype.width // 8
        q_bytes = self.tile_m * self.head_dim * self.dtype.width // 8
        pipe_kv = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_kv.data_ptr(), num_stages=1, producer_group=tma_thread,
            consumer_group=consumer_warps, tx_count=2 * kv_bytes, defer_sync=True)
        if cutlass.const_expr(self.split_qdo):  # Q + LSE2 rows, dO + D rows on barriers of their own
            halves = [pipeline.PipelineTmaAsync.create(
                barrier_storage=bars.data_ptr(), num_stages=self.num_stages, producer_group=tma_thread,
                consumer_group=consumer_warps, tx_count=q_bytes + self.stats_bytes() // 2, defer_sync=True)
                for bars in (storage.mbar_qdo, storage.mbar_do)]
            pipe_qdo = QdoStages(*halves)
        else:
            pipe_qdo = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar_qdo.data_ptr(), num_stages=self.num_stages, producer_group=tma_thread,
                consumer_group=consumer_warps, tx_count=2 * q_bytes + self.stats_bytes(), defer_sync=True)
        if cutlass.const_expr(self.cfg.anchored_wait):
            if warp_idx == 0:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_init(storage.mbar_anchor.data_ptr(), 1)
        num_n_blocks = cute.ceil_div(mK.shape[0], self.tile_n)
        tiles = None  # persistent: (counter, tile count, slot pipeline, slot words, order, KV tiles, KV heads)
        if cutlass.const_expr(self.persistent):
            # consumed by every consumer thread and the dQ warp
            pipe_tile = pipeline.PipelineAsync.create(
                barrier_storage=storage.mbar_tile.data_ptr(), num_stages=TILE_SLOTS, producer_group=tma_thread,
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumer_threads + 32),
                defer_sync=True)
            num_tiles = num_n_blocks * cute.size(mK.shape[2]) * cute.size(mK.shape[3])
            if cutlass.const_expr(mTileOrder is not None):
                num_tiles = cute.size(mTileOrder.shape[0])
            tiles = (tile_counter, num_tiles, pipe_tile,
                     storage.tile_slots.get_tensor(cute.make_layout((TILE_SLOT_WORDS, TILE_SLOTS))), mTileOrder,
                     num_n_blocks, cute.size(mK.shape[2]))
        pipeline.pipeline_init_arrive()

        sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sV = storage.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        stats = None  # (mLSE2, mDpsum, sLSE2, sDpsum) when the row statistics travel through shared memory
        if cutlass.const_expr(self.stats_in_smem):
            rows = cute.make_layout((self.tile_m, self.num_stages))
            stats = (mLSE2, mDpsum, storage.sLSE2.get_tensor(rows), storage.sDpsum.get_tensor(rows))
        if cutlass.const_expr(mTileOrder is not None):  # `lpt_order`: the launcher's (KV tile, head, batch)
            work, _, _ = cute.arch.block_idx()
            n_block = Int32(mTileOrder[work, 0])
            head_kv = Int32(mTileOrder[work, 1])
            batch = Int32(mTileOrder[work, 2])
        else:
            if cutlass.const_expr(self.kv_tiles_first):
                n_block, head_kv, batch = cute.arch.block_idx()
            else:
                head_kv, batch, n_block = cute.arch.block_idx()
            head_kv, batch, n_block = Int32(head_kv), Int32(batch), Int32(n_block)
        num_m_blocks = cute.ceil_div(mQ.shape[0], self.tile_m)
        tail = None  # split_tail: (the tail's shape, workspace, the consumers' shared flag)
        if cutlass.const_expr(self.cfg.split_tail):  # a 1-D grid of parts of the tiles after the whole ones
            shape = (split_tail[0], split_tail[1], qhead_per_kvhead * num_m_blocks)
            piece = TailPiece.of_this_cta(*shape)
            # warp-uniform, as the block index of a 3-D grid is: the tile's addresses stay in uniform registers
            hb = piece.tile // num_n_blocks
            n_block = cute.arch.make_warp_uniform(piece.tile - hb * num_n_blocks)
            head_kv = cute.arch.make_warp_uniform(hb % cute.size(mK.shape[2]))
            batch = cute.arch.make_warp_uniform(hb // cute.size(mK.shape[2]))
            # (the piece is rebuilt where it is used: kept live through the steps it cost the D=128 loop ~3%)
            tail = (shape, (split_tail[2], split_tail[3]), storage.split_flag.get_tensor(cute.make_layout(4)))
        pipeline.pipeline_init_wait()
        if cutlass.const_expr(self.cfg.chained_launch and not self.cfg.split_tail):
            # Chained: this CTA may have started while the preprocess drained. Wait for its rows (LSE2, D) and
            # zeroed dQ sums. (The parts of a cut last wave read those rows without a wait of their own: they start
            # only once every CTA of the whole tiles' kernel has passed this one.)
            cute.arch.griddepcontrol_wait()
        if cutlass.const_expr(self.cfg.lets_next_in_early):
            # then let the next kernel (the postprocess, or the parts) begin its launch
            cute.arch.griddepcontrol_launch_dependents()
        roles = (mQ, mK, mV, mdO, mdK, mdV, mdQ, mLSE2, mDpsum, sQ, sK, sV, sdO, sdS, storage, sKV_layout, sdQ_layout,
                 tma_q, tma_k, tma_v, tma_do, tma_dk, tma_dv, tma_dq, tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq,
                 pipe_kv, pipe_qdo, warp_idx, n_block, head_kv, batch, qhead_per_kvhead, num_m_blocks, sparse,
                 softmax_scale, log2_scale, aux_tensors, aux_scalars, aux_grads, mdQsem, mRank, stats, bits, tiles,
                 tail)
        if cutlass.const_expr(self.cfg.whole_tiles_only):
            # the tiles from split_tail[0] on are the tail kernel's (in launch order, as a 1-D grid would number them)
            if n_block + num_n_blocks * (head_kv + cute.size(mK.shape[2]) * batch) < split_tail[0]:
                self.run_roles(*roles)
        else:
            self.run_roles(*roles)
        if cutlass.const_expr(self.cfg.split_tail):
            # no CTA of the parts ends before the whole tiles' kernel has: work queued after this kernel (the dQ
            # postprocess) then finds every tile's dQ partials added, however the stream orders a dependent launch
            cute.arch.griddepcontrol_wait()

    @cute.jit
    def run_roles(self, mQ, mK, mV, mdO, mdK, mdV, mdQ, mLSE2, mDpsum, sQ, sK, sV, sdO, sdS, storage, sKV_layout,
                  sdQ_layout, tma_q, tma_k, tma_v, tma_do, tma_dk, tma_dv, tma_dq, tiled_mma_sdp, tiled_mma_dkv,
                  tiled_mma_dq, pipe_kv, pipe_qdo, warp_idx: Int32, n_block: Int32, head_kv: Int32, batch: Int32,
                  qhead_per_kvhead: Int32, num_m_blocks: Int32, sparse, softmax_scale: Float32, log2_scale: Float32,
                  aux_tensors, aux_scalars, aux_grads, mdQsem, mRank, stats, bits, tiles, tail):
        """The warp roles: the producer warp, the dQ warp, and the consumer warpgroups (each with its registers)."""
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.load(mQ, mK, mV, mdO, sQ, sK, sV, sdO, tma_q, tma_k, tma_v, tma_do, pipe_kv, pipe_qdo,
                          n_block, head_kv, batch, qhead_per_kvhead, num_m_blocks, sparse, stats, tiles,
                          tail[0] if cutlass.const_expr(tail is not None) else None)
            if cutlass.const_expr(self.dq_warp):
                if warp_idx == 1:
                    self.write_dq(mdQ, storage, sdQ_layout, tma_dq, n_block, head_kv, batch, qhead_per_kvhead,
                                  num_m_blocks, sparse, mdQsem, mRank, tiles,
                                  tail[0] if cutlass.const_expr(tail is not None) else None)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            tidx = cute.arch.thread_idx()[0] - 128
            self.consume(mQ, mK, mdK, mdV, mdQ, mLSE2, mDpsum, sQ, sK, sV, sdO, sdS, storage, sKV_layout, sdQ_layout,
                         tma_dk, tma_dv, tma_dq, tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq, pipe_kv, pipe_qdo,
                         tidx, warp_idx, n_block, head_kv, batch, qhead_per_kvhead, num_m_blocks, sparse,
                         softmax_scale, log2_scale, aux_tensors, aux_scalars, aux_grads, mdQsem, mRank, stats, bits,
                         tiles, tail)

    @cute.jit
    def consume(self, mQ, mK, mdK, mdV, mdQ, mLSE2, mDpsum, sQ, sK, sV, sdO, sdS, storage, sKV_layout, sdQ_layout,
                tma_dk, tma_dv, tma_dq, tiled_mma_sdp: cute.TiledMma, tiled_mma_dkv: cute.TiledMma,
                tiled_mma_dq: cute.TiledMma, pipe_kv, pipe_qdo, tidx: Int32, warp_idx: Int32, n_block: Int32,
                head_kv: Int32, batch: Int32, qhead_per_kvhead: Int32, num_m_blocks: Int32, sparse,
                softmax_scale: Float32, log2_scale: Float32, aux_tensors, aux_scalars, aux_grads, mdQsem, mRank,
                stats, bits, tiles, tail):
        wg = cute.arch.make_warp_uniform(tidx // 128)
        thr_sdp = tiled_mma_sdp.get_slice(tidx)
        wg_sdp = tiled_mma_sdp.get_slice(wg * 128)
        wg_dkv = tiled_mma_dkv.get_slice(wg * 128)
        wg_dq = tiled_mma_dq.get_slice(wg * 128)
        tSrK = wg_sdp.make_fragment_A(wg_sdp.partition_A(sK))
        tSrQ = wg_sdp.make_fragment_B(wg_sdp.partition_B(sQ))
        tPrV = wg_sdp.make_fragment_A(wg_sdp.partition_A(sV))
        tPrdO = wg_sdp.make_fragment_B(wg_sdp.partition_B(sdO))
        tVrdOt = wg_dkv.make_fragment_B(wg_dkv.partition_B(transpose_smem(sdO)))
        tKrQt = wg_dkv.make_fragment_B(wg_dkv.partition_B(transpose_smem(sQ)))
        tVrP = tKVsA = None
        if cutlass.const_expr(self.split):  # dS^T (stages 0-1) and P^T (2-3) from shared memory: (keys, queries, stage)
            tKVsA = wg_dkv.make_fragment_A(wg_dkv.partition_A(transpose_smem(sdS)))
        else:
            tVrP = wg_dkv.make_fragment_A(wg_dkv.partition_shape_A((self.tile_n, self.tile_m)))
        if cutlass.const_expr(self.dq_swap_ab):  # dQ^T = K^T dS^T
            tQrdS = wg_dq.make_fragment_B(wg_dq.partition_B(sdS))
            tQrKt = wg_dq.make_fragment_A(wg_dq.partition_A(transpose_smem(sK)))
        else:
            tQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(sdS))
            tQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(transpose_smem(sK)))
        acc_shape = wg_dkv.partition_shape_C((self.tile_n, self.head_dim))
        s_shape = wg_sdp.partition_shape_C((self.tile_n, self.tile_m))
        dq_shape = dq_fragment_shape(wg_dq, self.tile_m, self.head_dim, self.dq_swap_ab)
        # Element i of a transposed-score accumulator sits at (q, kv) = coords[i], as the forward's helpers expect.
        coords = thr_sdp.partition_C(transpose_smem(cute.make_identity_tensor((self.tile_m, self.tile_n))))
        # dS^T leaves the registers through transposing stmatrix, landing as dS (q rows, kv contiguous) in sdS.
        st_ds = cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype)
        thr_st_ds = cute.make_tiled_copy_C(st_ds, tiled_mma_sdp).get_slice(tidx)
        tdSsdS = thr_st_ds.partition_D(transpose_smem(sdS))
        sdQ = sdQ_mine = None
        if cutlass.const_expr(not self.dq_red):
            sdQ = storage.sdQ.get_tensor(sdQ_layout)
            sdQ_mine = sdQ[None, None, wg]

        def dq_store_view():
            """This thread's place in its slab, rebuilt at each step from the thread index (3 integer instructions)
            rather than kept live through the loop: of the 7 gallery backward kernels that spill, 5 spill 4 bytes
            less this way and 2 spill 4-8 bytes more. (None with `dq_red`: no slab.)"""
            if cutlass.const_expr(self.dq_red):
                return None
            t = opaque_i32(cute.arch.thread_idx()[0]) - 128
            return fragment_order(sdQ[None, None, t // 128], t % 128, dq_shape)
        sLSE2 = sDpsum = None
        if cutlass.const_expr(stats is not None):
            sLSE2, sDpsum = stats[2], stats[3]
        ops = StepOperands(tSrK=tSrK, tSrQ=tSrQ, tPrV=tPrV, tPrdO=tPrdO, tVrdOt=tVrdOt, tKrQt=tKrQt, tVrP=tVrP,
                           tKVsA=tKVsA, tQrdS=tQrdS, tQrKt=tQrKt, s_shape=s_shape, dq_shape=dq_shape,
                           coords=coords, st_ds=st_ds, thr_st_ds=thr_st_ds, tdSsdS=tdSsdS,
                           dq_store_view=dq_store_view, sLSE2=sLSE2, sDpsum=sDpsum, stored=None,
                           anchor_mbar=storage.mbar_anchor.data_ptr() if self.cfg.anchored_wait else None)
        tight = self.stats_in_smem and (sparse is not None or self.tile_m > 64)
        if cutlass.const_expr((self.rebuild_ds_store or tight) and not self.cfg.ds_store_live):
            ops.tdSsdS = None
            ops.ds_store_view = lambda: cute.make_tiled_copy_C(st_ds, tiled_mma_sdp).get_slice(
                opaque_i32(cute.arch.thread_idx()[0]) - 128).partition_D(transpose_smem(sdS))

        if cutlass.const_expr(self.grad_runs):  # this thread's open run per captured-tensor gradient buffer
            aux_grads = tuple(GradRun(t) for t in aux_grads)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        ds_index = Int32(0)
        args = (mQ, mK, mdK, mdV, mdQ, mLSE2, mDpsum, storage, sKV_layout, tma_dk, tma_dv, tma_dq, tiled_mma_sdp,
                tiled_mma_dkv, tiled_mma_dq, pipe_kv, pipe_qdo, tidx, warp_idx, wg, qhead_per_kvhead, num_m_blocks,
                sparse, softmax_scale, log2_scale, aux_tensors, aux_scalars, aux_grads, mdQsem, mRank, bits, ops,
                acc_shape, sdQ_mine)
        if cutlass.const_expr(tiles is not None):
            pipe_tile, slots = tiles[2], tiles[3]
            done = Int32(0)  # tiles taken so far: the K/V and tile-slot pipeline states follow from it
            valid, n_block, head_kv, batch, _ = take_tile(pipe_tile, slots, consumer_state_at(TILE_SLOTS, done))
            while valid > 0:
                state, ds_index = self.consume_tile(*args, n_block, head_kv, batch, consumer_state_at(1, done), state,
                                                    ds_index)
                done += 1
                valid, n_block, head_kv, batch, _ = take_tile(pipe_tile, slots, consumer_state_at(TILE_SLOTS, done))
            # the dQ warp's last "slab free" (it also arrived once up front)
            cute.arch.barrier(barrier_id=int(BwdBarrier.DQ_EMPTY_WG1) + wg, number_of_threads=DQ_HANDOFF_THREADS)
        else:
            self.consume_tile(*args, n_block, head_kv, batch, consumer_state_at(1, Int32(0)), state, ds_index, tail)
        if cutlass.const_expr(self.grad_runs):
            flush_aux_grads(aux_grads)

    @cute.jit
    def consume_tile(self, mQ, mK, mdK, mdV, mdQ, mLSE2, mDpsum, storage, sKV_layout, tma_dk, tma_dv, tma_dq,
                     tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq, pipe_kv, pipe_qdo, tidx: Int32, warp_idx: Int32,
                     wg: Int32, qhead_per_kvhead: Int32, num_m_blocks: Int32, sparse, softmax_scale: Float32,
                     log2_scale: Float32, aux_tensors, aux_scalars, aux_grads, mdQsem, mRank, bits, ops, acc_shape,
                     sdQ_mine, n_block: Int32, head_kv: Int32, batch: Int32, kv_state, state, ds_index: Int32,
                     tail=None):
        """One KV tile: dK and dV summed over every query tile (and query head) that attends to it, then stored.
        Returns the advanced Q/dO pipeline state and dS buffer index, which persistent CTAs carry to their next tile.
        `tail` = (tail shape, workspace, flag) with `split_tail` (`TailPiece.of_this_cta`): this CTA is a part of a
        cut tile; it walks its share of the steps, publishes its sums, and stores only if it came last, with the other
        parts' added."""
        acc_dK = cute.make_rmem_tensor(acc_shape, Float32)
        acc_dV = cute.make_rmem_tensor(acc_shape, Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)
        if cutlass.const_expr(bits is not None):  # (bits, KV tile, this thread's first key row, its word = lane % 4)
            ops.stored = (bits, n_block, ops.coords[0][1], ops.coords[0][0] // 2)
        seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]
        kv_start = n_block * self.tile_n
        pipe_kv.consumer_wait(kv_state)
        walk = (seqlen_q, seqlen_k, kv_start, mdQ, mLSE2, mDpsum, tma_dq, tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq,
                pipe_qdo, wg, qhead_per_kvhead, num_m_blocks, sparse, softmax_scale, log2_scale, aux_tensors,
                aux_scalars, aux_grads, mdQsem, mRank, ops, sdQ_mine, n_block, head_kv, batch, acc_dK, acc_dV)
        state, ds_index = self.walk_steps(*walk, state, ds_index,
                                          tail[0] if cutlass.const_expr(tail is not None) else None)
        if cutlass.const_expr(self.persistent):
            # K and V go back to the producer, which loads the next tile's while the epilogue stages dK and dV in the
            # dS buffers (the dQ warp's last slab hand-back is waited for by the next partial, or at the CTA's end).
            pipe_kv.consumer_release(kv_state)
        elif cutlass.const_expr(self.dq_warp):  # the dQ warp's last "slab free" (it also arrived once up front)
            cute.arch.barrier(barrier_id=int(BwdBarrier.DQ_EMPTY_WG1) + wg, number_of_threads=DQ_HANDOFF_THREADS)
        elif cutlass.const_expr(not self.dq_red):
            if dq_issuer():
                cute.arch.cp_async_bulk_wait_group(0, read=True)  # the last dQ reduce has read shared memory
        keep = Int32(1)
        if cutlass.const_expr(tail is not None):
            shape, workspace, flag = tail
            piece = TailPiece.of_this_cta(*shape)
            keep = publish_sums(piece, workspace, flag, (acc_dK, acc_dV), tidx, int(BwdBarrier.EPILOGUE),
                                self.num_consumer_threads)
            if keep != 0:
                add_parts(piece, workspace, (acc_dK, acc_dV), tidx, self.num_consumer_threads)
        if keep != 0:
            self.epilogue(acc_dK, acc_dV, softmax_scale, mdK, mdV, storage, sKV_layout, tma_dk, tma_dv,
                          tiled_mma_dkv, tidx, warp_idx, n_block, head_kv, batch)
        return state, ds_index

    @cute.jit
    def walk_steps(self, seqlen_q: Int32, seqlen_k: Int32, kv_start: Int32, mdQ, mLSE2, mDpsum, tma_dq,
                   tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq, pipe_qdo,
                   wg: Int32, qhead_per_kvhead: Int32, num_m_blocks: Int32, sparse, softmax_scale: Float32,
                   log2_scale: Float32, aux_tensors, aux_scalars, aux_grads, mdQsem, mRank, ops, sdQ_mine,
                   n_block: Int32, head_kv: Int32, batch: Int32, acc_dK, acc_dV, state, ds_index: Int32, piece):
        """The steps of one KV tile, for every query head of its GQA group, into acc_dK and acc_dV: all of them, or
        (`piece`, the cut tail's shape) this part's share. Returns the advanced Q/dO state and dS buffer index."""
        for g in cutlass.range(qhead_per_kvhead, unroll=1):
            head = head_kv * qhead_per_kvhead + g
            sched = self.head_schedule(sparse, batch, head, g, n_block, num_m_blocks, piece)
            if cutlass.const_expr(self.dq_red):
                tdQs, tdQg = None, self.dq_slabs(mdQ, head, batch)
            else:
                tdQs, tdQg = self.reduce_operands(tma_dq, sdQ_mine, self.dq_slabs(mdQ, head, batch))
            order = (mdQsem, mRank, sched.b, sched.h, n_block)
            mods = (batch, head, seqlen_q - 1, seqlen_k - 1, softmax_scale, aux_tensors, aux_scalars, aux_grads, order)
            step_args = (ops, acc_dK, acc_dV, tdQs, tdQg, tma_dq, tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq, pipe_qdo,
                         mLSE2, mDpsum, kv_start, seqlen_k, log2_scale, mods, wg)
            if cutlass.const_expr(self.cfg.kind_loops and sparse is not None and self.mask_mod is not None):
                # the partial tiles (listed first), then the full ones: each loop's step compiled for its kind
                state, ds_index = self.step_loop(sched, 0, sched.num_partial, True, state, ds_index, step_args)
                state, ds_index = self.step_loop(sched, sched.num_partial, sched.total, False, state, ds_index,
                                                 step_args)
            else:
                state, ds_index = self.step_loop(sched, 0, sched.total, None, state, ds_index, step_args)
        return state, ds_index

    @cute.jit
    def step_loop(self, sched, start: Int32, stop: Int32, partial: cutlass.Constexpr, state, ds_index: Int32,
                  step_args: tuple):
        """Steps `start` .. `stop` of a head's schedule, each on the next Q/dO stage and dS buffer. `partial`: the
        kind of every block in the range (True / False, a step compiled for it), or None: the step branches on
        each block's kind at run time."""
        for i in cutlass.range(start, stop, unroll=1):
            if cutlass.const_expr(partial is None):
                m_block = sched.partial_block(i) if cutlass.const_expr(self.partial_index_only) else sched.block(i)
                self.step(m_block, i < sched.num_partial, i, state, ds_index, *step_args)
            elif cutlass.const_expr(self.partial_index_only and not partial):
                self.step(Int32(0), partial, i, state, ds_index, *step_args)  # (the index is not read)
            else:
                self.step(sched.block_of_kind(i, partial), partial, i, state, ds_index, *step_args)
            state.advance()
            ds_index = 1 - ds_index
        return state, ds_index

    @cute.jit
    def epilogue(self, acc_dK, acc_dV, softmax_scale: Float32, mdK, mdV, storage, sKV_layout, tma_dk, tma_dv,
                 tiled_mma_dkv, tidx: Int32, warp_idx: Int32, n_block: Int32, head_kv: Int32, batch: Int32):
        """dK * scale and dV -> 16 bit -> shared memory over K and V -> TMA stores (rows past Skv are clipped).

        Persistent CTAs stage them in the dS buffers instead, so the next tile's K and V load meanwhile: both at once
        where they fit (head_dim <= tile_m), else dK, then dV once dK's store has read the buffers."""
        acc_dK.store(acc_dK.load() * softmax_scale)
        rdK = cute.make_rmem_tensor_like(acc_dK, self.dtype)
        rdV = cute.make_rmem_tensor_like(acc_dV, self.dtype)
        convert_to_16bit(acc_dK, rdK)
        convert_to_16bit(acc_dV, rdV)
        one_pass = not self.persistent or self.head_dim <= self.tile_m
        if cutlass.const_expr(self.persistent):  # (`BwdConfig.persistent_fits`)
            base = storage.sdS.data_ptr()
            sdK = cute.make_tensor(cute.recast_ptr(base, sKV_layout.inner, dtype=self.dtype), sKV_layout.outer)
            sdV = sdK
            if cutlass.const_expr(one_pass):
                sdV = cute.make_tensor(cute.recast_ptr(base + cute.cosize(sKV_layout.outer), sKV_layout.inner,
                                                       dtype=self.dtype), sKV_layout.outer)
        else:
            sdK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
            sdV = storage.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        where = (head_kv, batch, n_block)
        # Every warpgroup's dQ GEMM reads all of sK and sdS: wait for both before overwriting them.
        cute.arch.barrier(barrier_id=int(BwdBarrier.EPILOGUE), number_of_threads=self.num_consumer_threads)
        st_atom = cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        if cutlass.const_expr(self.persistent):
            # the thread's staging addresses built here, not hoisted above the tile's steps and kept (spilled) there
            tidx = opaque_i32(cute.arch.thread_idx()[0]) - 128
        thr_st = cute.make_tiled_copy_C(st_atom, tiled_mma_dkv).get_slice(tidx)
        cute.copy(st_atom, thr_st.retile(rdK), thr_st.partition_D(sdK))
        if cutlass.const_expr(one_pass):
            cute.copy(st_atom, thr_st.retile(rdV), thr_st.partition_D(sdV))
            self.store_tiles(((tma_dk, sdK, mdK), (tma_dv, sdV, mdV)), where, warp_idx)
        else:
            self.store_tiles(((tma_dk, sdK, mdK),), where, warp_idx)
            cute.arch.barrier(barrier_id=int(BwdBarrier.EPILOGUE), number_of_threads=self.num_consumer_threads)
            cute.copy(st_atom, thr_st.retile(rdV), thr_st.partition_D(sdV))
            self.store_tiles(((tma_dv, sdV, mdV),), where, warp_idx)
        if cutlass.const_expr(self.persistent):  # the stores have read the dS buffers: the next tile may write there
            cute.arch.barrier(barrier_id=int(BwdBarrier.EPILOGUE), number_of_threads=self.num_consumer_threads)

    @cute.jit
    def store_tiles(self, tiles: tuple, where: tuple, warp_idx: Int32):
        """Shared-memory tiles the consumers just wrote -> global memory with TMA: (atom, smem tile, dK or dV) each, at
        `where` = (KV head, batch, KV tile), issued by the first consumer warp, which returns once the copies have read
        shared memory."""
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=int(BwdBarrier.EPILOGUE), number_of_threads=self.num_consumer_threads)
        if warp_idx == 4:
            head_kv, batch, n_block = where
            pairs = [tma_tiles(atom, smem, cute.local_tile(m[None, None, head_kv, batch], (self.tile_n, self.head_dim),
                                                           (n_block, 0))) for atom, smem, m in tiles]
            with cute.arch.elect_one():
                for k in cutlass.range_constexpr(len(tiles)):
                    cute.copy(tiles[k][0], pairs[k][0], pairs[k][1])
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)


def fake_arguments(cfg: BwdConfig, dtype, block_sparse: bool = False, aux_tensor_specs=(), aux_scalar_kinds=(),
                   aux_grad_ranks=(), deterministic: bool = False, fixed_point_aux_grads: bool = False):
    """Symbolic-shape stand-ins for every runtime argument (compile without a GPU, or once for all shapes).

    `aux_grad_ranks`: rank of each gradient buffer (the rank of the captured tensor it belongs to); the buffers are
    fp32, or int64 fixed point (`bwd_aux_grad`) with `fixed_point_aux_grads`. The layouts are exactly those
    `bwd_launch.backward` builds, and TVM-FFI checks every call against them (a static stride the torch tensor does
    not have is an error at the call, not a silent misread); the stream is torch's current one."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

    hd = cfg.head_dim

    def bhsd():  # (B, H, S, D) with unit stride on D and 16-byte aligned other strides, as TMA needs
        shape = (cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), hd)
        stride = (cute.sym_int64(divisibility=8), cute.sym_int64(divisibility=8), cute.sym_int64(divisibility=8), 1)
        return make_fake_tensor(dtype, shape, stride, assumed_align=16)

    def compact(dt, shape, align=4):
        return make_fake_compact_tensor(dt, shape, stride_order=tuple(range(len(shape) - 1, -1, -1)),
                                        assumed_align=align)

    def sym():
        return cute.sym_int32()

    sparse = None
    if block_sparse:
        sparse = (compact(Int32, (sym(), sym(), sym())), compact(Int32, (sym(), sym(), sym(), sym())),
                  compact(Int32, (sym(), sym(), sym())), compact(Int32, (sym(), sym(), sym(), sym())))
        if cfg.mask_bits:  # (B, H, KV tiles, partial blocks, tile_n key rows, 4 words): `runtime.mask_bits`
            sparse += (compact(Int32, (sym(), sym(), sym(), sym(), cfg.tile_n, 4), align=16),)
    rows = compact(Float32, (sym(), sym(), cute.sym_int32(divisibility=cfg.tile_m)))
    accum = compact(Float32, (sym(), sym(), cute.sym_int32(divisibility=cfg.tile_m), hd), align=16)
    from ..runtime.compile import fake_captured_tensor
    aux_tensors = tuple(fake_captured_tensor(name, ndim) for name, ndim in aux_tensor_specs)
    aux_scalars = tuple(Int32(0) if kind == "int" else Float32(0.0) for kind in aux_scalar_kinds)
    grad_dtype, grad_align = (Int64, 8) if fixed_point_aux_grads else (Float32, 4)
    aux_grads = tuple(make_fake_compact_tensor(grad_dtype, tuple(sym() for _ in range(rank)),
                                               stride_order=tuple(range(rank - 1, -1, -1)), assumed_align=grad_align)
                      for rank in aux_grad_ranks)
    sem = compact(Int32, (sym(), sym(), sym(), cfg.num_consumer_wgs)) if deterministic else None
    rank = compact(Int32, (sym(), sym(), sym(), sym())) if deterministic and block_sparse else None
    tile_order = compact(Int32, (sym(), 3)) if cfg.lpt_order and (block_sparse or deterministic) else None
    counter = compact(Int32, (1,)) if cfg.persistent else None
    split_tail = None
    if cfg.split_tail:  # (whole tiles, parts per cut tile, arrival counters, partials)
        split_tail = (Int32(0), Int32(1), compact(Int32, (sym(),)), compact(Float32, (sym(),), align=16))
    elif cfg.whole_tiles_only:  # (whole tiles,)
        split_tail = (Int32(0),)
    return (bhsd(), bhsd(), bhsd(), bhsd(), rows, rows, accum, bhsd(), bhsd(), Float32(1.0), Int32(1), sparse,
            aux_tensors, aux_scalars, aux_grads, sem, rank, tile_order, counter, split_tail,
            make_fake_stream(use_tvm_ffi_env_stream=True))
