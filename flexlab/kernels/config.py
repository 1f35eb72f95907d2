"""Static configuration of the Hopper forward kernel, and the one check that a configuration fits the chip.

Everything in `FwdConfig` is baked into the compiled kernel, so it is part of the compile-cache key. The tile shapes
per head dim (`default_config`) were measured on an H200 (bf16, H=16, dense; TFLOP/s; benchmarks/results/fwd_probe_*):

    D=128  128x128, 2 stages     B4·S4k 593-609   B1·S16k 633-645   B8·S1k 492-500   (default)
           128x128, 3 stages     B4·S4k 676 (one run)  B1·S16k 642   B8·S1k 473       (not adopted: re-measure)
           128x176, 2 stages     B1·S16k 635;  ping-pong off: B4·S4k 597, B1·S16k 645
    D=64   192x128, 3 stages     B4·S4k 463-496   B1·S16k 485-512                      (default, dense)
           192x128, 2 / 4 stg    B4·S4k 465 / 471-496;  128x128: 430;  ping-pong off: 444-449

Candidate options (`FwdConfig` fields, off by default) and selection knobs (module constants, at the measured
defaults) exist so one H200 run can decide on them: `benchmarks/probes/fwd_perf_sweep.py` times each against the default
on the benchmark rows, float64-checked, next to debug builds with one stage removed (`FwdConfig.ablate`). Adopting an
option means changing `default_config` or a knob here, with the sweep's numbers in this table.
"""
from __future__ import annotations

from dataclasses import dataclass

SMEM_BYTES_SM90 = 227 * 1024  # dynamic shared memory one CTA may use on H100/H200
REGISTERS_PER_SM = 64 * 1024
# SMs of an H200 (and H100 SXM): grid sizes planned without a GPU to ask (precompilation, sweeps, the inspector)
H200_SMS = 132
SUPPORTED_HEAD_DIMS = (64, 128, 256)

# Dynamic tile scheduling (`FwdConfig.dynamic_tiles`): the producer warp hands each tile to the consumer warpgroups in
# a ring of shared-memory slots, each (valid, m_block, head, batch, partial blocks, full blocks).
TILE_SLOTS = 2
TILE_SLOT_WORDS = 6
# The split tail (`FwdConfig.split_tail`): partial results one CTA publishes per launch at most, its run's first and
# last unit (`kernels.split_tail`).
SPLIT_TAIL_SLOTS = 2

# Debug-only stage removal (`FwdConfig.ablate`): each name compiles a kernel with one stage of the forward taken out,
# so that timing it against the full kernel says what that stage costs. Outputs of ablated kernels are wrong.
ABLATIONS = {
    "softmax": "no online softmax: P = S converted to 16 bit, O never rescaled",
    "exp2": "softmax without exponentials: P = (S - max) * scale, the FFMA kept, ex2 dropped",
    "pv": "no P.V GEMM (V is still loaded and waited for)",
    "overlap": "no intra-warpgroup overlap: QK GEMM, then PV GEMM, each waited for before the softmax",
    "store": "no O epilogue store (no stmatrix, no TMA store; LSE still written)",
    "kv_loads": "only the first K and V block of a tile are loaded by TMA; later stages are signalled without a copy",
    "mask_mod": "mask_mod not evaluated on partial blocks",
    "score_mod": "score_mod not applied",
}

# Selection policy knobs, kept at the measured defaults; `default_config` reads them at call time so a benchmark can
# flip them. D=128: ((min seqlen_k, K/V stages), ...) tried longest first; empty = 2 stages everywhere.
D128_STAGES_FROM_SEQLEN: tuple[tuple[int, int], ...] = ()
# D=64 with a block mask (no score_mod): 192-row tiles (a BlockMask at 128 is then merged per tile, see
# `flexlab.runtime.sparsity`), or 128. H200 causal, kernel time: 1.06x at B4 S4k, 1.13x at B1 S16k over 128 rows;
# H100, forward timed in turns: 1.049x and 1.145x (fwd_d64_tile128_probe_h100_2026-12-07.json.gz).
D64_SPARSE_TILE_M = 192
# D=256 with a block mask: 64-key tiles (a divisor of torch's 128-key mask blocks), or 80 as the dense kernel takes
# (a mask at 128 is then merged per tile, `MERGED_TILE_N` in `flexlab.runtime.sparsity`: a tile straddling two mask
# columns is full only where both are). 80 compiles without spills (CPU test) and is slower: forward timed in turns,
# 80 against 64, H200 causal B4·S4k 0.984x, sliding window 0.952x, causal B1·S16k 0.999x (BENCHMARKS.md,
# 2026-12-04); H100 0.986x, 0.958x, 1.006x (fwd_d256_sparse_tile_n80_probe_h100_2026-12-07.json.gz). 64 stays.
D256_SPARSE_TILE_N = 64
# Dense kernels (no mask, no score_mod): CTAs per K/V multicast cluster (`FwdConfig.cluster_m`), 1 or 2. H200, kernel
# time: D=64 1.03-1.07x at B4 S4k and B1 S16k over three sweeps
# (benchmarks/results/fwd_cluster2_h200_2026-11-30.json.gz);
# D=128 1.044x at B4 S4k and 1.033x at B1 S16k, timed in 7 interleaved rounds beside the baseline, the baseline again
# (1.005x, 1.002x) and FA4 (benchmarks/results/fwd_interleaved_h200_2026-12-01.json.gz). Sweeps that timed each kernel
# once had put D=128 within their run-to-run noise (0.99-1.02x). Short keys still go dynamic at D=128
# (`runtime.launch.runs_dynamic`): one CTA per SM has no cluster partner.
D64_DENSE_CLUSTER_M = 2
D128_DENSE_CLUSTER_M = 2
# Persistent CTAs with dynamic tiles (`FwdConfig.dynamic_tiles`, one CTA per SM) wherever a Q tile visits at most this
# many KV blocks on average (dense: Skv / tile_n; under a block mask: its lists), so that per-tile prologue and
# epilogue (Q load, first K, O store) overlap the previous tile's work. Their steps are ~7% longer (481 against 449
# SASS instructions per dense D=128 step, then), so long tiles stay one CTA per tile (but see the next knob). H200
# kernel time against one CTA per tile (benchmarks/results/fwd_dynamic_tiles_h200_2026-11-30.json.gz): documents B4
# S4k 1.17x (4 blocks per tile), causal B8 S1k 1.09x, sliding window 1.05x at S4k and S16k (9), causal B4 S4k 1.03x
# (16.5) and D=64 1.06x; alibi and soft-cap B4 S4k 0.98-1.00x (16.5), documents B1 S16k 0.98x (17.3, within the
# baseline's own spread); causal B1 S16k 0.98x (64.5), alibi B1 S16k 0.94x. Dense D=64 keeps its K/V multicast
# clusters instead. 0 turns it off.
DYNAMIC_MAX_MEAN_KV_BLOCKS = 20
# Head dims up to which block-sparse kernels without a score_mod run dynamic tiles at every tile length (0: only
# where tiles are short, as above). Their persistent steps are now as long as one-CTA steps (CPU SASS, D=64 causal:
# 424 / 592 full / partial against 428 / 595), so the overlapped prologue and epilogue win on long tiles too. H200,
# forward timed in turns, the median of each round's ratio (dynamic_long_tiles_probe_h200_2026-12-03.json.gz), causal
# B1·S16k: D=64 1.024x and 1.035x, D=128 1.026x and 1.033x in two runs; forward + backward 1.00x and 1.01x. Not at
# D=256 (0.98x) nor with a score_mod (ALiBi 1.00x, soft-cap 0.99x at B1·S16k).
DYNAMIC_ANY_LENGTH_MAX_HEAD_DIM = 128
# Dense kernels with K/V multicast clusters whose tiles visit more than DYNAMIC_MAX_MEAN_KV_BLOCKS and at most this
# many KV blocks run as static persistent clusters, one per SM pair, each walking pairs of Q tiles
# (`FwdConfig.persistent_ctas` with `cluster_m`), so the next pair's first loads overlap this pair's epilogue.
# H200, kernel time in interleaved rounds against one cluster per pair (two runs,
# benchmarks/results/fwd_persistent_cluster2_h200_2026-12-01{,b}.json.gz): B4 S4k (32 blocks) 1.016x / 1.032x at D=128
# and 1.038x / 1.040x at D=64; B1 S16k (128 blocks) 1.000-1.007x, where they run with the split tail instead
# (`SPLIT_TAIL_MIN_MEAN_KV_BLOCKS`).
PERSISTENT_CLUSTER_MAX_MEAN_KV_BLOCKS = 64
# Dense kernels with K/V multicast clusters whose tiles visit at least this many KV blocks run as static persistent
# clusters with the split tail (`FwdConfig.split_tail`): the pairs after the last whole round are cut into one even
# run of KV blocks per cluster. H200, kernel time in interleaved rounds against one cluster per pair, B1 S16k (128
# blocks): 1.013x at D=128 and 1.024x at D=64 in 7 rounds (persistent clusters alone 0.994x, 1.009x;
# benchmarks/results/fwd_split_tail_sweep_h200_2026-12-02.json.gz), 1.048x and 1.047x in 9 (persistent clusters with
# the tail whole 1.010x, 1.016x; ..._2026-12-02c.json.gz). At B4 S4k (32 blocks, persistent clusters) 0.996-1.001x and
# 0.998-1.002x over two runs, so mid-length tiles keep the last round whole. 0 turns it off.
SPLIT_TAIL_MIN_MEAN_KV_BLOCKS = 65
# Block-sparse masks whose mask_mod reads captured tensors (document ids, spans): partial blocks test bits the
# launcher stored once per mask (`FwdConfig.mask_bits`, `runtime.mask_bits`) instead of evaluating mask_mod, whose
# gathers made a document mask's partial-block step 778 SASS instructions against 549 with bits (454 for a full one).
STORE_MASK_BITS = True
# D=64 kernels that read stored mask bits (no score_mod; the mask then needs no registers of its own): 192-row tiles
# where a 128-row tile visits at least this many KV blocks on average under the mask (0: never). H200 kernel time of
# 192 rows (with dynamic tiles below DYNAMIC_MAX_MEAN_KV_BLOCKS) against 128, documents
# (benchmarks/results/fwd_d64_bits_tiles_sweep_h200_2026-11-30.json.gz): 0.92x at 4.0 blocks per tile (B4 S4k), 1.07x
# at ~8.5 (B2 S8k), 1.08x at 17.3 (B1 S16k). Short tiles lose to the longer prologue of three 192-row slabs.
D64_BITS_TILE192_MIN_MEAN_KV_BLOCKS = 6.0
# Block-mask, score_mod and persistent kernels at D <= 128 tie each step's K release to its first probability
# (`FwdConfig.anchored_release`) and mark the stage warp-uniform (`FwdConfig.uniform_stage`). H200, kernel time
# against the earlier default, interleaved rounds, with the anchor in inline-mask partial loops too
# (benchmarks/results/fwd_anchored_release_h200_2026-12-01.json.gz):
# causal 1.05x at B1 S16k and 1.11x at B4 S4k, sliding window 1.05x, ALiBi 1.14x, dense B8 S1k (persistent) 1.03x,
# D=64 causal 1.02x, soft-cap 1.00x, documents 0.99x. The plain dense kernels, which ptxas already schedules that
# way, stay as they are (0.98-0.99x with it).
ANCHORED_RELEASE = True
# Head dims from which the forward rescales O lazily (`FwdConfig.lazy_rescale`; 0: never): a warp leaves its softmax
# reference max, and O, alone until some row's max outgrows it by 2^8. H200, forward timed in turns, the median of
# each round's ratio (benchmarks/results/fwd_lazy_rescale_probe_h200_2026-12-03.json.gz): D=256 1.07x dense and 1.10x
# causal at B4·S4k; D=128 1.02x dense and causal at B4·S4k, 1.01x at B1·S16k (dense, causal, sliding window);
# D=64 causal B1·S16k 0.99x, where the rescale is 32 multiplies per thread and step.
LAZY_RESCALE_MIN_HEAD_DIM = 128
# Head dims up to which the forward masks the partial blocks of a sliding-window band per row (`FwdConfig.band_mask`;
# 0: never). H200, forward timed in turns, the median of each round's ratio
# (benchmarks/results/fwd_band_mask_probe_h200_2026-12-03.json.gz): sliding window D=64 B1·S16k 1.029x, D=128 1.009x
# at B1·S16k and 1.008x at B4·S4k, D=256 0.997x. Causal bands, bounded above only, lose with it (D=128 0.99x at B4·S4k
# and B1·S16k, D=64 1.00x), as the mask_mod is one compare per score there, so they keep it.
BAND_MASK_MAX_HEAD_DIM = 128
# Block-sparse kernels whose Q tiles straddle mask rows (192 rows, `runtime.sparsity.MERGED_TILE_M`) and do not
# divide seqlen_q put the padded rows in the first tile (`FwdConfig.ragged_first_tile`) where the mask's lists then
# visit at least this fraction fewer KV blocks than with the padded rows last (1.0: never). H100, D=64 forward timed
# in turns, the median of 21 rounds' ratios (fwd_ragged_first_probe_h100_2026-12-07.json.gz): causal B4·S4k 1.048x
# (363 visits per head against 384, 5.5% fewer), causal B1·S16k 1.015x (1.5% fewer), sliding window B1·S16k 0.995x
# (0.4% fewer).
RAGGED_FIRST_MIN_SAVING = 0.01


@dataclass(frozen=True)
class FwdConfig:
    """One forward-kernel shape: tiles, pipeline depth, and whether consumer warpgroups take turns (ping-pong).

    The softmax of block j always overlaps the PV GEMM of block j-1 inside a warpgroup (see fwd_sm90).

    `tile_m` rows of Q per CTA are split over `tile_m // 64` consumer warpgroups (one wgmma M=64 slab each); one more
    warpgroup is the TMA producer.
    """

    head_dim: int
    tile_m: int = 128
    tile_n: int = 128
    num_stages: int = 2
    # consumer warpgroups take turns on the tensor cores. Also at D=256, where turns of 80-key steps are short: off
    # there timed 1.002x dense, 0.999x causal, 1.000x sliding window at B4·S4k, 0.994x causal at B1·S16k
    # (fwd_d256_pingpong_probe_h200_2026-12-03b.json.gz). Off together with `try_wait_first`, as FA4's D=256 forward
    # waits, on an H100: 1.003x dense and 1.001x causal at B4·S4k, 1.001x causal at B1·S16k, paired over 21 rounds
    # (fwd_d256_fa4_waits_probe_h100_2026-12-07.json.gz): level, kept on.
    pingpong: bool = True
    dtype_bytes: int = 2
    # Candidate optimizations, all off by default (the measured kernel):
    persistent_ctas: int = 0  # >0: launch min(tiles, this) CTAs that loop over tiles (set it to the SM count)
    # Persistent only: a CTA takes its next tile from a global counter when it starts one (launch order, so heavy
    # tiles first and the L2 grouping kept), instead of every G-th tile: no CTA is left with more work than the
    # others when tiles differ in length (documents, causal). The launcher passes the counter
    # (`runtime.launch.tile_counter`); the kernel leaves it at 0 for the next launch on that stream.
    dynamic_tiles: bool = False
    exp2_poly: int = 0  # of every 8 scores of a row fragment, how many take exp2 as an FMA polynomial, not MUFU
    rescale_before_pv: bool = False  # rescale O by the previous row scale while QK runs (FA4 does it for D>128)
    # A warp moves its rows' softmax reference max only when some row's max outgrew it by 2^8, and skips the O rescale
    # (head_dim / 2 multiplies per thread) in every other step (`softmax.OnlineSoftmax`, lazy rescaling). The
    # rescale stays unconditional with `rescale_before_pv`.
    lazy_rescale: bool = False
    early_block_index: bool = False  # read the next KV block index before waiting on its K (block-sparse)
    # Partial blocks: mask_mod into bit masks while the QK GEMM runs (reads the block index early too). H200,
    # 2026-11-30: 0.98x on the document rows, 1.01-1.02x on sliding windows
    # (benchmarks/results/mask_early_h200_2026-11-30.json.gz); with 192-row tiles (160 registers per thread) it spills.
    # With `band_mask` the band's words are formed there instead (index arithmetic alone; without it, after the
    # GEMM's wait). Timed in that form on an H100 (fwd_mask_early_sliding_probe_h100_2026-12-06.json.gz and
    # fwd_band_early_causal_probe_h100_2026-12-06.json.gz): sliding windows 0.997-1.001x, causal with band_mask
    # 1.002-1.007x the default's speed: level, so off.
    mask_early: bool = False
    # Block-sparse only: partial blocks read their mask from bits stored by the launcher (`runtime.mask_bits`, passed
    # after the four block lists) instead of evaluating mask_mod; the launcher's choice for masks that read captured
    # tensors (`runtime.launch.stores_mask_bits`).
    mask_bits: bool = False
    # The K/V stage index of each overlapped step marked warp-uniform where the wgmma descriptors are formed (as the
    # backward does): ptxas then keeps more of the descriptor arithmetic in 64-bit uniform adds. CPU compile, dense
    # D=128 step: 481 -> 467 SASS instructions with dynamic tiles, 449 -> 452 one CTA per tile. H200 sweep
    # (benchmarks/results/fwd_uniform_stage_sweep_h200_2026-11-30.json.gz): 0.94-1.00x of the baseline on the D=128
    # dense, causal, ALiBi and soft-cap rows, with dynamic tiles 0.89-1.01x; no row faster beyond the baseline's own
    # spread (its repeat read 0.86-1.01x in that run). Off alone; on with `anchored_release`, whose rearranged step
    # it trims (causal full-block step 486 -> 472 instructions).
    uniform_stage: bool = False
    # Dense grids only: two CTAs with neighbouring Q tiles of one head form a cluster, and each loads half of every
    # K/V block and multicasts it to both, halving K/V requests to L2. Nsight, dense B4 S4k: our kernel moved 4.1 GB
    # through the L2 slices against FA4's 2.2 GB (FA4's sm90 forward does not multicast: its loads are merged before
    # the slices more often, BENCHMARKS.md 2026-12-01). 1.03-1.07x at D=64, 1.03-1.04x at D=128: the dense default
    # at both (`D64_DENSE_CLUSTER_M`, `D128_DENSE_CLUSTER_M`). With static persistent CTAs each cluster walks pairs
    # of tiles (`tile_scheduler.pair_coords`): timed in turns against one cluster per pair, 1.000-1.016x at D=128
    # and 1.000-1.038x at D=64 (benchmarks/results/fwd_persistent_cluster2_h200_2026-12-01.json.gz), not the default.
    cluster_m: int = 1
    # Waits on the Q/K/V stages (the consumers' for a full stage, the producer's for an empty one) try once without a
    # suspend-time hint before the wait loop whose hint lets the warps sleep, as FA4's do in effect; ours enter that
    # loop (NANOSLEEP.SYNCS in the SASS) at the first miss. CPU compile: the one difference found between the two
    # dense D=128 main loops (449 and 455 SASS instructions, the same 16 HGMMA) and producer loops. H200, 9 core
    # rows: 0.97-1.02x, 0.997x geometric mean (fwd_try_wait_first_h200_2026-12-01.json.gz); off.
    try_wait_first: bool = False
    # The K stage's release in each overlapped step is tied to the step's first probability
    # (`stage_waits.release_after`), and ptxas keeps the step's wait for the P.V GEMM behind that release. Left free,
    # ptxas hoisted both above the exponentials in every kernel but the plain dense one (CPU compile, SASS: the wait
    # before the first of 66 MUFU.EX2 under a block mask, after 8 in the dense kernel, after 9-14 with this), so the
    # softmax waited for the P.V GEMM it was meant to overlap. Nsight on causal B1·S16k: 10.3 k of 172 k stall samples
    # on that wait, none in FA4's kernel. Partial blocks that evaluate mask_mod inline keep ptxas's schedule (there it
    # raised heavy masks' spills). On by default with a mask or score_mod and in persistent kernels at D <= 128
    # (`ANCHORED_RELEASE`), with `uniform_stage`.
    anchored_release: bool = False
    # Static persistent dense kernels (not dynamic_tiles, no block mask): the tiles after the last whole round of
    # workers are cut into one even run of KV blocks per worker, each cut tile's parts merged by whichever arrives
    # last (`kernels.split_tail`), so the last round does not leave SMs idle (2048 tiles on 132 SMs: 16 rounds of
    # work 15.5). The launcher passes the workspace (`runtime.launch.scheduler_workspace`).
    split_tail: bool = False
    # Launched with programmatic dependent launch: the CTAs may start (shared memory, barriers, TMA descriptors) while
    # the kernel before on the stream drains its last wave, and wait (`griddepcontrol.wait`) before their first
    # global access. Persistent kernels, whose CTAs are all resident from the start, then let the next kernel (the
    # backward's preprocess, itself chained: `BwdConfig.chained_launch`) launch at once. Off: forward + backward at
    # D=128, timed in turns (fwd_chained_launch_probe_h200_2026-12-03b.json.gz), 1.003x dense and 0.990x causal at
    # B4·S4k, 1.000x dense at B1·S16k, where the forward alone was 0.972x.
    chained_launch: bool = False
    # Partial blocks of a mask the code generator recognises as a band of keys per query (causal, sliding windows:
    # `flexlab.codegen.band`) are masked per row: the row's key range becomes one word of bits and each score is kept
    # by its bit (`mask.apply_band_mask`), instead of evaluating mask_mod per score. CPU compile, SASS instructions
    # per partial-block step with mask_mod / with this: sliding window (persistent, as launched) D=64 720 / 572,
    # D=128 767 / 619, D=256 609 / 553; causal D=64 595 / 568, D=128 638 / 607 (full-block steps unchanged). The
    # default for sliding windows up to `BAND_MASK_MAX_HEAD_DIM` (`band_options`).
    band_mask: bool = False
    # Block-sparse only: the Q tile that holds the rows left over when seqlen_q is not a multiple of tile_m is the
    # first tile instead of the last; tile t starts at row t * tile_m - pad (pad = -seqlen_q % tile_m), its rows
    # before 0 zero-filled by TMA and never stored. A 192-row tile over 4096 queries leaves 128 padded rows, and
    # under a causal mask the last tile is the longest (every KV block), the first the shortest (one): moved there,
    # the padded rows cost one step instead of 32. The launcher takes it where the mask's lists then visit fewer KV
    # blocks (`RAGGED_FIRST_MIN_SAVING`, `runtime.launch`).
    ragged_first_tile: bool = False
    # Debug only, never set by the public API: stages removed for timing (names in ABLATIONS; results are wrong).
    ablate: tuple[str, ...] = ()

    def __post_init__(self):
        # One canonical spelling (sorted tuple), so the compile key and its on-disk digest do not depend on how the
        # caller wrote the set.
        object.__setattr__(self, "ablate", tuple(sorted(set(self.ablate))))

    @property
    def num_consumer_wgs(self) -> int:
        return self.tile_m // 64

    @property
    def num_threads(self) -> int:
        return 128 * (self.num_consumer_wgs + 1)

    @property
    def register_split(self) -> tuple[int, int]:
        """(producer, consumer) registers per thread after `setmaxnreg`; must sum to at most 64K per CTA."""
        return {1: (56, 256), 2: (24, 240), 3: (32, 160)}[self.num_consumer_wgs]

    @property
    def persistent(self) -> bool:
        return self.persistent_ctas > 0

    @property
    def separate_o(self) -> bool:
        """Persistent kernels stage O in its own buffer when it fits, so the next tile's Q can land while this tile's
        O is stored; otherwise O reuses Q's buffer and the next Q waits for the store."""
        return self.persistent and self._smem_bytes(True) <= SMEM_BYTES_SM90

    def _smem_bytes(self, separate_o: bool) -> int:
        def up(n):
            return -(-n // 1024) * 1024
        barriers = 8 * (2 + 4 * self.num_stages) + (TILE_SLOTS * (16 + 4 * TILE_SLOT_WORDS) if self.dynamic_tiles else 0)
        barriers += 16 if self.split_tail else 0  # the "merged here" flag the consumers share
        q = self.tile_m * self.head_dim * self.dtype_bytes
        kv = self.num_stages * self.tile_n * self.head_dim * self.dtype_bytes
        return up(barriers) + up(q) * (2 if separate_o else 1) + 2 * up(kv)

    def split_tail_workspace(self) -> tuple[int, int]:
        """(int32 arrival counters, fp32 partial words) the split tail needs: at most two rounds of tiles are in the
        tail, and each CTA publishes at most `SPLIT_TAIL_SLOTS` parts, each every consumer thread's O fragment
        (head_dim / 2 values) and its two LSE rows (`kernels.split_tail.publish_and_arrive`)."""
        threads = 128 * self.num_consumer_wgs
        return 2 * self.persistent_ctas, self.persistent_ctas * SPLIT_TAIL_SLOTS * threads * (self.head_dim // 2 + 2)

    def smem_bytes(self) -> int:
        """Bytes of the kernel's shared-storage struct: mbarriers first, then Q (reused for O unless `separate_o`),
        K and V rings, each buffer aligned to 1 KiB (the 128-byte swizzle repeats every 1 KiB)."""
        return self._smem_bytes(self.separate_o)

    def feasibility_error(self) -> str | None:
        """Why this configuration cannot run on sm90, or None when it can."""
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            return f"head_dim={self.head_dim} is not one of {SUPPORTED_HEAD_DIMS}"
        if self.tile_m not in (64, 128, 192):
            return f"tile_m={self.tile_m} must be 64, 128 or 192 (one to three 64-row consumer warpgroups)"
        if self.tile_n % 16 or not 16 <= self.tile_n <= 256:
            return f"tile_n={self.tile_n} must be a multiple of 16 in [16, 256] (wgmma N and K granularity)"
        if self.num_stages < 2:
            return f"num_stages={self.num_stages}: K/V need at least 2 stages to overlap loads with math"
        if self.pingpong and self.num_consumer_wgs < 2:
            return "pingpong scheduling needs at least two consumer warpgroups to alternate"
        unknown = [a for a in self.ablate if a not in ABLATIONS]
        if unknown:
            return f"unknown ablation(s) {unknown}; known: {sorted(ABLATIONS)}"
        if self.cluster_m not in (1, 2):
            return f"cluster_m={self.cluster_m} must be 1 or 2 (CTAs sharing each K/V load)"
        if self.mask_bits and (self.tile_n != 128 or self.mask_early):
            return "mask_bits=True stores 128 columns per block row and replaces mask_early: it needs tile_n=128 " \
                   "and mask_early=False"
        if self.dynamic_tiles and not self.persistent_ctas:
            return "dynamic_tiles=True hands tiles to persistent CTAs: it needs persistent_ctas > 0"
        if self.persistent_ctas < 0:
            return f"persistent_ctas={self.persistent_ctas} must be 0 (off) or a CTA count"
        if self.cluster_m > 1 and (self.dynamic_tiles or self.persistent_ctas % self.cluster_m
                                   or "kv_loads" in self.ablate):
            return "cluster_m=2 pairs Q tiles of one head, and both CTAs of a pair walk the same tiles: it combines " \
                   "with an even number of static persistent CTAs, not with dynamic_tiles or the kv_loads ablation"
        if self.split_tail and (not self.persistent_ctas or self.dynamic_tiles or self.mask_bits):
            return "split_tail=True cuts the tail tiles of a static persistent grid by KV blocks: it needs " \
                   "persistent_ctas > 0 and neither dynamic_tiles nor mask_bits (dense grids only)"
        if self.ragged_first_tile and (self.cluster_m > 1 or self.split_tail):
            return "ragged_first_tile=True moves a block-sparse kernel's padded Q rows to its first tile: not with " \
                   "cluster_m=2 or split_tail (dense grids only)"
        if not 0 <= self.exp2_poly <= 8:
            return f"exp2_poly={self.exp2_poly} must be in [0, 8] (scores per 8 computed on the FMA pipe)"
        if self.smem_bytes() > SMEM_BYTES_SM90:
            return f"needs {self.smem_bytes()} bytes of shared memory, sm90 has {SMEM_BYTES_SM90}"
        producer, consumer = self.register_split
        if 128 * producer + 128 * self.num_consumer_wgs * consumer > REGISTERS_PER_SM:
            return "register split exceeds 64K registers per CTA"
        # Per consumer thread: S accumulator (tile_n/2 fp32) + O accumulator (head_dim/2 fp32) + P (tile_n/4).
        live = self.tile_n // 2 + self.head_dim // 2 + self.tile_n // 4 + 24  # + indices, row stats, addresses
        if live > consumer:
            return f"about {live} live registers per consumer thread, only {consumer} after setmaxnreg"
        return None

    def validate(self) -> FwdConfig:
        err = self.feasibility_error()
        if err:
            raise ValueError(f"infeasible FwdConfig {self}: {err}")
        return self


def default_config(head_dim: int, block_sparse: bool = False, has_score_mod: bool = False,
                   seqlen_k: int | None = None, captured_tensors: bool = False) -> FwdConfig:
    """Tile shape per head dim (and, through `D128_STAGES_FROM_SEQLEN`, per key length).

    D=64 without a score_mod uses 192-row tiles (three consumer warpgroups), also under a block mask at torch's
    default 128 block size unless `D64_SPARSE_TILE_M` says 128; a score_mod's extra registers spill at 160 per
    thread, so it gets 128-row tiles, and so do mods that read captured tensors (`captured_tensors`: a document mask
    at 192 rows spills 56 bytes, the clamped gathers' addresses). Dense D=64 and D=128 also pair CTAs into K/V
    multicast clusters (`D64_DENSE_CLUSTER_M`, `D128_DENSE_CLUSTER_M`). D=128 and D=256 rescale O lazily
    (`LAZY_RESCALE_MIN_HEAD_DIM`).
    """
    opts = anchored_options(head_dim, block_sparse or has_score_mod) | lazy_options(head_dim)
    if head_dim <= 64:
        if not block_sparse and not has_score_mod:  # H200, B4 S4k: 496 TFLOP/s vs 465 with 2 stages, 430 at 128 rows
            return FwdConfig(head_dim=64, tile_m=192, tile_n=128, num_stages=3, cluster_m=D64_DENSE_CLUSTER_M)
        if block_sparse and not has_score_mod and not captured_tensors and D64_SPARSE_TILE_M == 192:
            return FwdConfig(head_dim=64, tile_m=192, tile_n=128, num_stages=3, **opts)
        return FwdConfig(head_dim=64, tile_m=128, tile_n=128, num_stages=2, **opts)
    if head_dim <= 128:  # H200, B1 S16k: 633 TFLOP/s; tile_n=176 gave 635 (noise)
        dense = {} if block_sparse or has_score_mod else {"cluster_m": D128_DENSE_CLUSTER_M}
        return FwdConfig(head_dim=128, tile_m=128, tile_n=128, num_stages=d128_stages(seqlen_k), **opts, **dense)
    # D=256: 80-key tiles fill shared memory with two stages; dense 1.01-1.03x of 64 at B4·S4k and B1·S16k, equal at
    # B8·S1k (benchmarks/results/fwd_d256_tile_n{64,80}_h200_2026-12-01.json.gz). Block masks: `D256_SPARSE_TILE_N`.
    return FwdConfig(head_dim=256, tile_m=128, tile_n=D256_SPARSE_TILE_N if block_sparse else 80, num_stages=2, **opts)


def band_options(head_dim: int, band_is_window: bool) -> dict:
    """`FwdConfig` fields of per-row band masking (`BAND_MASK_MAX_HEAD_DIM`) for a mask_mod whose generated band is
    a window (`mask_mod.band_is_window`), else none."""
    bound = BAND_MASK_MAX_HEAD_DIM
    return {"band_mask": True} if band_is_window and bound and head_dim <= bound else {}


def lazy_options(head_dim: int) -> dict:
    """`FwdConfig` fields of lazy softmax rescaling (`LAZY_RESCALE_MIN_HEAD_DIM`) where it applies, else none."""
    bound = LAZY_RESCALE_MIN_HEAD_DIM
    return {"lazy_rescale": True} if bound and head_dim >= bound else {}


def anchored_options(head_dim: int, wanted: bool) -> dict:
    """`FwdConfig` fields of the anchored K release (`ANCHORED_RELEASE`) where it applies, else none."""
    if wanted and ANCHORED_RELEASE and head_dim <= 128:
        return {"anchored_release": True, "uniform_stage": True}
    return {}


def d128_stages(seqlen_k: int | None) -> int:
    """K/V stages at D=128 for this key length: the first `D128_STAGES_FROM_SEQLEN` entry it reaches, else 2."""
    if seqlen_k is not None:
        for min_len, stages in D128_STAGES_FROM_SEQLEN:
            if seqlen_k >= min_len:
                return stages
    return 2
