"""One step of the backward main loop: a query tile against the CTA's keys, in one consumer warpgroup.

S^T = K Q^T and dP^T = V dO^T on the tensor cores; P^T = exp2(score_mod(s) * c - LSE2[q]) with mask_mod on partial
blocks and the key tail masked; dS^T = P^T * (dP^T - D[q]) (then the generated derivative of the score_mod, and the
captured-tensor gradients); dV += P^T dO and dK += dS^T Q with P^T/dS^T as register operands; dS to shared memory,
where both warpgroups' halves meet for this tile's dQ partial = dS K, handed to `bwd_dq`. At head dim 256 (`split`)
each warpgroup has half the step's query columns of S^T and dP^T, and P^T goes to shared memory beside dS^T: the dV
and dK GEMMs, each warpgroup's half of the head dim, read both from there after the barrier that the dQ GEMM needs.

Methods of `FlexBwdSm90` (a mixin): they read the kernel's static configuration from `self`.
"""
from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op

from .fwd_sm90 import wgmma
from .layout import as_operand_a, convert_to_16bit, row_major_order, rows_view
from .mask import (FRAGMENT_ROWS, apply_band_mask, apply_band_words, apply_fragment_bits, apply_mask_bits,
                   apply_mask_mod, band_for, band_words, element_indices, load_fragment_bits, mask_kv_tail,
                   mask_mod_bits)
from .named_barrier import BwdBarrier
from .score_mod import apply_score_mod
from .stage_waits import arrive_after, wait_full


@dsl_user_op
def opaque_i32(x: Int32, *, loc=None, ip=None) -> Int32:
    """x, hidden from the optimizer: index math derived from it is recomputed rather than kept live from earlier."""
    return Int32(llvm.inline_asm(T.i32(), [Int32(x).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=r,r",
                                 has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


class StepOperands(SimpleNamespace):
    """The per-thread views one step works on, built once per CTA by `consume` and only read inside the loop:
    smem-descriptor fragments (tSrK, tSrQ, tPrV, tPrdO, tVrdOt, tKrQt, tQrdS, tQrKt), the register A fragment of P
    (tVrP) or, with head dims split over the warpgroups, the staged shared-memory A fragment of the dK and dV GEMMs
    (tKVsA: dS^T at stages 0-1, P^T at 2-3; None otherwise), the dS store (st_ds, thr_st_ds, and tdSsdS, or None and a
    `ds_store_view()` that rebuilds it), the builder of the dQ slab view (dq_store_view), the accumulator shapes
    (s_shape, dq_shape), the (q, kv) coordinates of the transposed score accumulator (coords), with stats_in_smem the
    per-stage LSE2/D rows in shared memory (sLSE2, sDpsum; None otherwise), with mask_bits, where this thread's
    stored mask bits are (stored: bits, KV tile, first key row, word; None otherwise), and with `anchored_wait` the
    mbarrier the step arrives on before its dP^T wait (anchor_mbar; None otherwise)."""


class BwdStep:
    """The per-step math of the backward kernel (mixed into `FlexBwdSm90`)."""

    @cute.jit
    def step(self, m_block: Int32, partial, position: Int32, state, ds_index: Int32, ops: StepOperands, acc_dK,
             acc_dV, tdQs, tdQg,
             tma_dq, tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq, pipe_qdo, mLSE2, mDpsum, kv_start: Int32,
             seqlen_k: Int32, log2_scale: Float32, mods, wg: Int32):
        """One query tile against this CTA's keys: S^T, dP^T, P, dS, then dV, dK, and this tile's dQ partial.

        `partial`: the block mask lists this tile as partial, so mask_mod applies: a runtime Boolean (a branch,
        which keeps one copy of the step in the binary instead of one per block kind), or with `kind_loops` a
        Python bool, which the DSL resolves at trace time; `position`: its place in the partial list (where its
        stored mask bits are, with `mask_bits`)."""
        batch, head, q_last, kv_last, softmax_scale, aux_tensors, aux_scalars, aux_grads, order = mods
        q_start = m_block * self.tile_m
        coords = ops.coords
        words = None  # a partial block's stored mask bits
        if cutlass.const_expr(ops.stored is not None and self.mask_mod is not None):
            words = cute.make_rmem_tensor(FRAGMENT_ROWS, cutlass.Uint32)
            if cutlass.const_expr(self.cfg.bits_before_wait):  # before the wait for this step's Q/dO stage
                self.load_stored_bits(words, ops.stored, partial, batch, head, position)
        wait_full(pipe_qdo, state, self.try_wait_first)
        # The stage picks the shared-memory descriptors of every GEMM below. Marked warp-uniform, ptxas keeps the
        # descriptors in uniform registers (one UIADD3.64 per K slice); without the hint it built each one in
        # ordinary registers (move, 64-bit add with carry) and copied it over with R2UR: ~130 of the loop's ~650
        # instructions at D=128. The same for the dS buffer the dQ GEMM reads, below.
        stage = cute.arch.make_warp_uniform(state.index)
        acc_S = cute.make_rmem_tensor(ops.s_shape, Float32)
        acc_dP = cute.make_rmem_tensor(ops.s_shape, Float32)
        wgmma(tiled_mma_sdp, acc_S, ops.tSrK, ops.tSrQ[None, None, None, stage], True, -1)
        c_cols = rows_view(coords)
        early_lse2 = None
        if cutlass.const_expr(self.cfg.stats_before_dp):
            # this step's LSE2 rows, read before dP^T's operand reads fill shared memory (`stats_before_dp`)
            early_lse2 = []
            for j in cutlass.range_constexpr(cute.size(c_cols, mode=[1])):
                early_lse2.append(self.row_stat(mLSE2, ops.sLSE2, batch, head, q_start, c_cols[0, j][0], stage))
        if cutlass.const_expr(not self.lean):
            self.wait_do(pipe_qdo, state)
            wgmma(tiled_mma_sdp, acc_dP, ops.tPrV, ops.tPrdO[None, None, None, stage], True, -1)
        early_mask = cutlass.const_expr(self.mask_early and self.mask_mod is not None)
        if cutlass.const_expr(words is not None and not self.cfg.bits_before_wait):  # while S^T is on the tensor cores
            self.load_stored_bits(words, ops.stored, partial, batch, head, position)
        band = None if self.mask_mod is None else band_for(self.mask_mod, acc_S, self.cfg.band_mask, by_key=True)
        early_band = cutlass.const_expr(early_mask and band is not None and words is None)
        band_bits = None
        if cutlass.const_expr(early_band):
            # mask_early with a band mask: each key row's word of kept queries is index arithmetic alone, formed
            # while S^T is on the tensor cores, so the softmax finds it ready
            band_bits = cute.make_rmem_tensor(FRAGMENT_ROWS, cutlass.Uint32)
            if partial:
                band_words(band_bits, cute.size(acc_S), coords, band, batch, head, q_start, kv_start, aux_tensors,
                           aux_scalars, by_key=True)
        keep_bits = None
        if cutlass.const_expr(early_mask and not early_band):
            # mask_mod into bit masks while S^T is on the tensor cores: the loads of captured tensors it reads then
            # wait behind the GEMM, not in front of the softmax (FwdConfig.mask_early, the same in the forward).
            keep_bits = cute.make_rmem_tensor(-(-cute.size(acc_S) // 32), cutlass.Uint32)
            if partial:
                mask_mod_bits(keep_bits, coords, self.mask_mod, batch, head, q_start, kv_start, q_last, kv_last,
                              self.clamp_indices, aux_tensors, aux_scalars)
        if cutlass.const_expr(not self.lean):
            warpgroup.wait_group(1)  # S^T is ready; dP^T is still on the tensor cores
        else:
            warpgroup.wait_group(0)

        raw = None
        if cutlass.const_expr(self.score_mod is not None):
            if cutlass.const_expr(self.needs_raw_scores):
                raw = cute.make_rmem_tensor(ops.s_shape, Float32)  # the score the mod saw: its derivative needs it
                raw.store(acc_S.load() * softmax_scale)
            apply_score_mod(acc_S, coords, self.score_mod, softmax_scale, batch, head, q_start, kv_start, q_last,
                            kv_last, self.clamp_indices, aux_tensors, aux_scalars)
        if cutlass.const_expr(self.mask_mod is not None):
            if partial:
                if cutlass.const_expr(words is not None):
                    apply_fragment_bits(acc_S, words)
                elif cutlass.const_expr(early_band):
                    apply_band_words(acc_S, band_bits)
                elif cutlass.const_expr(early_mask):
                    apply_mask_bits(acc_S, keep_bits)
                elif cutlass.const_expr(band is not None):
                    apply_band_mask(acc_S, coords, band, batch, head, q_start, kv_start, aux_tensors, aux_scalars,
                                    by_key=True)
                else:
                    apply_mask_mod(acc_S, coords, self.mask_mod, batch, head, q_start, kv_start, q_last, kv_last,
                                   self.clamp_indices, aux_tensors, aux_scalars)
        if kv_start + self.tile_n > seqlen_k:
            mask_kv_tail(acc_S, coords, kv_start, seqlen_k)

        # P^T = exp2(x * c - LSE2[q]); each accumulator column is one query row.
        s_cols = rows_view(acc_S)
        for j in cutlass.range_constexpr(cute.size(s_cols, mode=[1])):
            if cutlass.const_expr(early_lse2 is not None):
                lse2 = early_lse2[j]
            else:
                lse2 = self.row_stat(mLSE2, ops.sLSE2, batch, head, q_start, c_cols[0, j][0], stage)
            for r in cutlass.range_constexpr(cute.size(s_cols, mode=[0])):
                s_cols[r, j] = cute.math.exp2(s_cols[r, j] * log2_scale - lse2, fastmath=True)
        if cutlass.const_expr(self.early_dv):
            # P to 16 bits (its fp32 registers die: keeping them beside the 16-bit copy spilled) and dV += P^T dO
            # issued now, so it runs while dS is formed; wait for dP^T only, leaving dV on the tensor cores.
            rP = cute.make_rmem_tensor_like(acc_S, self.dtype)
            convert_to_16bit(acc_S, rP)
            wgmma(tiled_mma_dkv, acc_dV, as_operand_a(rP), ops.tVrdOt[None, None, None, stage], False, -1)
            warpgroup.wait_group(1)
            s_cols = rows_view(rP)
        elif cutlass.const_expr(self.lean):
            # P goes to 16 bits now (its fp32 registers die), and dV += P^T dO runs beside dP^T = V dO^T.
            rP = cute.make_rmem_tensor_like(acc_S, self.dtype)  # accumulator order; as_operand_a re-views it
            convert_to_16bit(acc_S, rP)
            wgmma(tiled_mma_dkv, acc_dV, as_operand_a(rP), ops.tVrdOt[None, None, None, stage], False, -1)
            wgmma(tiled_mma_sdp, acc_dP, ops.tPrV, ops.tPrdO[None, None, None, stage], True, -1)
            warpgroup.wait_group(0)
            s_cols = rows_view(rP)
        else:
            if cutlass.const_expr(self.split):
                # P^T (16 bit) to shared memory, where the other warpgroup's dV GEMM reads it too
                rP = cute.make_rmem_tensor_like(acc_S, self.dtype)
                convert_to_16bit(acc_S, rP)
                tdSsdS = ops.tdSsdS if ops.tdSsdS is not None else ops.ds_store_view()
                cute.copy(ops.st_ds, ops.thr_st_ds.retile(rP), tdSsdS[None, None, None, 2 + ds_index])
            if cutlass.const_expr(ops.anchor_mbar is not None):
                # dP^T's wait, once the first `anchor_exps` probabilities are known
                rows, n = cute.size(s_cols, mode=[0]), min(self.cfg.anchor_exps, cute.size(s_cols))
                arrive_after(ops.anchor_mbar, [s_cols[i % rows, i // rows] for i in range(n)])
            warpgroup.wait_group(0)
        # dS^T = P^T * (dP^T - D[q])
        dp_cols = rows_view(acc_dP)
        for j in cutlass.range_constexpr(cute.size(dp_cols, mode=[1])):
            d = self.row_stat(mDpsum, ops.sDpsum, batch, head, q_start, c_cols[0, j][0], stage)
            for r in cutlass.range_constexpr(cute.size(dp_cols, mode=[0])):
                dp_cols[r, j] = Float32(s_cols[r, j]) * (dp_cols[r, j] - d)
        if cutlass.const_expr(self.needs_raw_scores or self.aux_grad is not None):
            self.mod_backward(acc_dP, raw, coords, batch, head, q_start, kv_start, q_last, kv_last, aux_tensors,
                              aux_scalars, aux_grads)

        if cutlass.const_expr(not self.lean and not self.early_dv and not self.split):
            convert_to_16bit(as_operand_a(acc_S), ops.tVrP)
        rdS = cute.make_rmem_tensor_like(acc_dP, self.dtype)
        convert_to_16bit(acc_dP, rdS)
        tdSsdS = ops.tdSsdS if ops.tdSsdS is not None else ops.ds_store_view()
        cute.copy(ops.st_ds, ops.thr_st_ds.retile(rdS), tdSsdS[None, None, None, ds_index])
        cute.arch.fence_view_async_shared()  # dS^T in shared memory must be visible to the wgmma async proxy

        if cutlass.const_expr(not self.lean and not self.early_dv and not self.split):
            wgmma(tiled_mma_dkv, acc_dV, ops.tVrP, ops.tVrdOt[None, None, None, stage], False, -1)
        if cutlass.const_expr(not self.dk_after_dq):
            wgmma(tiled_mma_dkv, acc_dK, as_operand_a(rdS), ops.tKrQt[None, None, None, stage], False, -1)
        self.wait_dq_slab_free()
        cute.arch.barrier(barrier_id=int(BwdBarrier.DS_READY), number_of_threads=self.num_consumer_threads)
        acc_dQ = cute.make_rmem_tensor(ops.dq_shape, Float32)
        ds_stage = cute.arch.make_warp_uniform(ds_index)
        if cutlass.const_expr(self.split):
            # dQ, then dV and dK for this warpgroup's head-dim columns from both warpgroups' P^T and dS^T; the dQ
            # partial leaves while those two are on the tensor cores
            wgmma(tiled_mma_dq, acc_dQ, *self.dq_operands(ops, ds_stage), True, -1)
            wgmma(tiled_mma_dkv, acc_dV, ops.tKVsA[None, None, None, 2 + ds_stage], ops.tVrdOt[None, None, None, stage],
                  False, -1)
            wgmma(tiled_mma_dkv, acc_dK, ops.tKVsA[None, None, None, ds_stage], ops.tKrQt[None, None, None, stage],
                  False, 2)
            self.reduce_dq(acc_dQ, ops.dq_store_view(), tdQs, tdQg, tma_dq, m_block, order, batch, head, wg)
            warpgroup.wait_group(0)
            pipe_qdo.consumer_release(state)
        elif cutlass.const_expr(self.dk_after_dq):
            # dQ first, then dK; waiting for all but the newest group leaves dK on the tensor cores while the dQ
            # partial goes to shared memory and TMA. The stage (Q is dK's B operand) is released once dK is done.
            wgmma(tiled_mma_dq, acc_dQ, *self.dq_operands(ops, ds_stage), True, -1)
            wgmma(tiled_mma_dkv, acc_dK, as_operand_a(rdS), ops.tKrQt[None, None, None, stage], False, 1)
            if cutlass.const_expr(self.split_qdo):
                pipe_qdo.release_do(state)  # dV, dO's last reader, is done: the next dO may land now, as in FA4
            self.reduce_dq(acc_dQ, ops.dq_store_view(), tdQs, tdQg, tma_dq, m_block, order, batch, head, wg)
            warpgroup.wait_group(0)
            if cutlass.const_expr(self.split_qdo):
                pipe_qdo.release_q(state)
            else:
                pipe_qdo.consumer_release(state)
        else:
            wgmma(tiled_mma_dq, acc_dQ, *self.dq_operands(ops, ds_stage), True, 0)
            pipe_qdo.consumer_release(state)
            self.reduce_dq(acc_dQ, ops.dq_store_view(), tdQs, tdQg, tma_dq, m_block, order, batch, head, wg)

    def wait_do(self, pipe_qdo, state):
        """With `split_qdo_wait` (outside the lean plan), the wait for this stage's dO and D rows before dP^T, the first
        GEMM that reads dO; the stage wait at the top of the step covered both otherwise."""
        if cutlass.const_expr(self.split_qdo):
            pipe_qdo.wait_do(state)

    @cute.jit
    def load_stored_bits(self, words, stored, partial, batch: Int32, head: Int32, position: Int32):
        """This thread's words of the stored mask bits (`mask_bits`) of partial block `position`; none on full ones."""
        if partial:
            bits, n_block, row, word = stored
            load_fragment_bits(words, bits, batch, head, n_block, position, row, word)

    def dq_operands(self, ops: StepOperands, ds_stage: Int32) -> tuple:
        """(A, B) of the dQ GEMM: dS and K^T, or K^T and dS for the transposed dQ^T = K^T dS^T (`dq_swap_ab`)."""
        if cutlass.const_expr(self.dq_swap_ab):
            return ops.tQrKt, ops.tQrdS[None, None, None, ds_stage]
        return ops.tQrdS[None, None, None, ds_stage], ops.tQrKt

    def row_stat(self, mRows, sRows, batch: Int32, head: Int32, q_start: Int32, q: Int32, stage: Int32) -> Float32:
        """LSE2 or D of query row q of this tile: from this stage's shared-memory copy (stats_in_smem) or from the
        padded global buffer (a plain trace-time helper: the choice is static)."""
        if sRows is not None:
            return Float32(sRows[q, stage])
        return Float32(mRows[batch, head, q_start + q])

    @cute.jit
    def mod_backward(self, acc_ds, raw, coords, batch: Int32, head: Int32, q_start: Int32, kv_start: Int32,
                     q_last: Int32, kv_last: Int32, aux_tensors, aux_scalars, aux_grads):
        """Captured-tensor gradients from dS, then dS -> gradient of the raw score (the generated derivative).

        The indices go through `opaque_i32` so the compiler recomputes the mods' address math here instead of keeping
        every element's address live since the forward mod ran (at D=64 that alone spilled 88 bytes). Elements go
        row by row (one key, then every query of the step), the order in which `bwd_aux_grad.GradRun` finds the
        longest runs of adds to one table entry."""
        batch, head, q_start, kv_start = (opaque_i32(x) for x in (batch, head, q_start, kv_start))
        order = row_major_order(acc_ds.layout.shape)
        for k in cutlass.range_constexpr(len(order)):
            i = order[k]
            q_idx, kv_idx = element_indices(coords, i, q_start, kv_start, q_last, kv_last, self.clamp_indices)
            if cutlass.const_expr(self.aux_grad is not None):
                score = raw[i] if cutlass.const_expr(raw is not None) else Float32(0.0)  # (not read: see __init__)
                self.aux_grad(acc_ds[i], score, batch, head, q_idx, kv_idx, aux_tensors, aux_scalars, aux_grads)
            if cutlass.const_expr(self.score_mod_bwd is not None):
                acc_ds[i] = Float32(self.score_mod_bwd(acc_ds[i], raw[i], batch, head, q_idx, kv_idx, aux_tensors,
                                                       aux_scalars))
