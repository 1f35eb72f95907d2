"""Static configuration of the Hopper backward kernel, and the one check that a configuration fits the chip.

The backward CTA owns `tile_n` rows of K/V (64 per consumer warpgroup; at D=256 two warpgroups share 64,
`split_head_dim`) and walks Q in `tile_m`-row steps, so a BlockMask drives it when its KV block size is a multiple of
`tile_n` and its Q block size a multiple of `tile_m`. With a block mask `tile_m` (64 or 128) divides torch's default
BLOCK_SIZE=128 and `tile_n` is 128 (64 at D=256), so one mask built at that size serves both passes for every
supported head dim (`shares_block_mask_with_forward`); without one, D=128 steps 80 rows (`DENSE_TILE_M`).

The boolean fields are speed options; each setting is a separate compiled kernel, and
`benchmarks/probes/bwd_perf_sweep.py` times and checks every candidate against the default on the H200. The default
turns on `stats_in_smem`, `dq_warp`, `dk_after_dq` (below) and (outside deterministic mode) `kv_tiles_first`. The
first and last together made the main kernel 1.16-1.66x faster on every swept row (D=64 and 128, dense, causal,
sliding window, soft-cap; benchmarks/results/bwd_sweep_h200_2026-11-30.json.gz). `default_bwd_config` picks `tile_m` per
call (128 at D=64 where it pays, see `D64_TILE_M`):

  stats_in_smem   the producer copies each step's LSE2 and D rows (tile_m fp32 each) into shared memory with the Q/dO
                  tiles, instead of every consumer thread loading its tile_m / 4 values of each from global memory
                  after the S^T and dP^T GEMMs (two exposed L2 latencies per step);
  dk_after_dq     the dQ GEMM is issued before the dK GEMM, so the dQ partial goes to shared memory and TMA while dK
                  is still on the tensor cores, instead of waiting for dV, dK and dQ together (FA3/FA4's order).
                  On by default since the dQ slab is written in fragment order (`bwd_dq`): main kernel 1.02-1.09x on
                  all 12 swept rows (D=64 and 128; dense, causal, sliding window, documents, soft-cap) and 1.07x
                  deterministic at D=128, 1.00x at D=64 (bwd_dk_after_dq_h200_2026-11-30.json.gz). With the row-major
                  slab it had been slower: that slab was left unswizzled here, as swizzled addresses beside dK's
                  register operand spilled, and its stores conflicted in shared memory;
  kv_tiles_first  grid x = KV tiles: the CTAs of one (batch, head) run side by side and share Q, dO and the dQ
                  accumulator in L2, instead of one or two KV tiles of every head at a time;
  mask_early      on partial blocks, mask_mod is evaluated into bit masks while the S^T GEMM runs, so the loads of
                  captured tensors it reads (document ids) wait behind the GEMM instead of in front of the softmax
                  (measured and not used: 0.93x at D=64 and 0.98x at D=128 on the document rows,
                  benchmarks/results/mask_early_h200_2026-11-30.json.gz; with 64-row steps at D=128 it spills);
                  with `band_mask`, the band's words are formed there instead (index arithmetic alone; the two
                  together against neither, backward on an H100: sliding window 1.000-1.005x, causal 1.010-1.016x
                  the default's speed, bwd_band_early_probe_h100_2026-12-06.json.gz: off);
  dq_split_rows   each consumer warpgroup computes 64 query rows of the dQ partial over the whole head dim (wgmma
                  N = head_dim) instead of all tile_m rows over head_dim / warpgroups columns (N = 32 at D=64, where
                  the shared-memory A operand limits the tensor cores); needs tile_m = 64 * warpgroups; the default
                  wherever D=64 runs 128-row steps (`default_bwd_config`);
  early_dv        dV += P^T dO is issued as soon as P is in 16 bits, before waiting for dP^T, so it runs on the tensor
                  cores while dS is formed, instead of after dS (FA3's order; the lean plan already issues it early)
                  (measured and not used: 0.96-0.98x on the D=128 dense and causal and D=64 dense rows, its dS from
                  16-bit P also adds rounding: 3.6e-3 rel-L2 against 2.4e-3; bwd_dq_warp_h200_2026-11-30.json.gz);
  dq_warp         a warp of the producer warpgroup issues the dQ reduces: a consumer warpgroup writes its partial
                  to its slab, arrives on a named barrier and goes on, instead of syncing its four warps, electing a
                  lane, issuing the TMA reduce and, a step later, waiting for the reduce to have read the slab (FA3's
                  dQ writer; the deterministic mode's ordered waits move to that warp too). On by default: main
                  kernel 1.01-1.20x faster on all 12 swept rows (D=64 and 128; dense, causal, sliding window,
                  documents, soft-cap) and 1.03-1.29x in deterministic mode (bwd_dq_warp_h200_2026-11-30.json.gz,
                  bwd_dq_warp_rows_h200_2026-11-30.json.gz); gallery backward spills 1148 -> 584 bytes;
  lpt_order       block-sparse, outside deterministic mode (in it: the turn order, see `default_bwd_config`): the
                  CTAs run KV tiles in an order the launcher hands over (`bwd_launch.QLists.tile_order`): the
                  (batch, KV head) pairs are cut into a few even groups
                  whose Q, dO and dQ sums fit in L2 together (`LPT_GROUP_L2_BYTES`), and inside a group the tiles
                  that visit the most Q tiles go first. Launched head by head, the longest tiles of the last heads
                  (a causal mask's first KV tile, a long document's) started last and ran alone at the end. H200,
                  forward + backward kernel time against the head-by-head order in the same process
                  (benchmarks/results/fwd_bwd_lpt_order_h200_2026-11-30.json.gz and ..._off_...): causal B4·S4k 1.09x,
                  documents B1·S16k 1.08x, sliding window B4·S4k 1.02x, causal B1·S16k 1.01x, documents B4·S4k
                  1.00x. Groups cut unevenly (a last group of one head) lose to the plain order, hence even groups.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .config import H200_SMS, REGISTERS_PER_SM, SMEM_BYTES_SM90, TILE_SLOT_WORDS, TILE_SLOTS, default_config

BWD_HEAD_DIMS = (64, 128, 256)
# Head dims above this split dK and dV by columns over two consumer warpgroups that share one 64-row KV tile
# (`BwdConfig.split_head_dim`): a 64 x 256 fp32 dK plus dV is 256 registers per thread of one warpgroup.
MAX_UNSPLIT_HEAD_DIM = 128
# Q rows per step at head_dim 64 without a score_mod derivative: 1.13-1.16x faster main kernel than 64 on the dense
# and causal S16k rows once the wgmma descriptors stayed in uniform registers (bwd_sweep_h200_2026-11-30b.json.gz);
# 0.78x with soft-capping, whose derivative keeps the raw scores live; captured-tensor gradients double the per-step
# work the same way (unmeasured there, so they keep 64).
D64_TILE_M = 128
# ... and not for masks of more than this many operations: with 64 scores per thread per step, the gallery's block
# diffusion, 2-D neighbourhood and sliding-tile masks (19-39 operations) spilled 240-500 bytes, none at 64 rows
# (benchmarks/results/gallery_backward_spills_2026-11-30.json.gz).
D64_MAX_MASK_OPS = 12
# Q rows per step at head_dim 128 without a block mask and without per-score gradient work, with dQ computed
# transposed (`dq_swap_ab`): each step reads K and V (the S^T and dP^T GEMMs' A operands) and K^T (dQ's) from shared
# memory whatever its row count, and shared-memory bandwidth is what bounds this kernel (Nsight: ~0.75 wavefronts per
# SM cycle, 76% of them wgmma operand reads), so 80 rows read 7.5% fewer bytes per row than 64 (FA3/FA4's dense
# tile). Main kernel, timed in turns: 1.00-1.03x at B4·S4k (two runs), 1.04x at B1·S16k, 1.07x deterministic
# (bwd_tile_m80_h200_2026-12-01.json.gz). Fills shared memory (231424 of 232448 bytes). 80 divides no mask block size,
# hence no block mask: steps merging the mask rows they cover measured 0.93-1.03x
# (bwd_tile_m80_masked_h200_2026-12-01.json.gz).
DENSE_TILE_M = 80
# Persistent CTAs (`BwdConfig.persistent_ctas`) where a KV tile walks at most this many query tiles on average
# (summed over its GQA group; `runs_persistent`). Main kernel against one CTA per tile, timed in turns (H200, three
# runs; benchmarks/results/bwd_persistent_h200_2026-12-02*.json.gz): ~9 steps (D=64 sliding window) 1.04-1.08x, ~16
# (D=64 documents, D=128 soft-cap B2·S2k) 1.02-1.06x, ~18 (D=128 sliding window) 1.03-1.07x; ~31-33 (D=128 causal
# and documents B4·S4k) 0.99-1.01x; 52-128 (dense B4·S4k, causal S16k) 0.96-1.00x. Each tile's start (K, V and the
# first Q/dO loads, ~5 µs of a one-tile CTA's life besides its steps) now overlaps the previous tile's epilogue.
PERSISTENT_MAX_MEAN_STEPS = 24
# The split tail (`BwdConfig.split_tail`, `split_parts`): what a KV tile costs besides its query steps, in steps, for
# a whole tile (K and V loaded before the first step, the epilogue after the last: ~5 µs, about two steps, measured
# in bwd_tile_overhead_h200_2026-12-02.json.gz) and for a part of a cut tile (the same, plus publishing or adding the
# other parts' fp32 dK and dV); at most this many parts per tile, of at least this many steps each.
WHOLE_TILE_COST_STEPS = 2
TAIL_PART_COST_STEPS = 3
MAX_TAIL_PARTS = 8
MIN_TAIL_PART_STEPS = 4
# head_dim 64 with 128-row steps: a loop per kind of query tile (`BwdConfig.kind_loops`; the launcher keeps it only
# under a block mask with a mask_mod). Timed in turns at B1·S16k (bwd_kind_loops_d64_probe_h200_2026-12-03.json.gz):
# backward 1.069x causal, 1.051x sliding window, 1.029x documents from stored bits. D=128 keeps the one branching
# loop: 0.988x and 1.002x backward on causal B4·S4k and B1·S16k in a run that charged the two-loop form host time
# (bwd_kind_loops_probe_h200_2026-12-03c.json.gz), and with the fixed probe 0.987x and 1.001x causal, 0.986x and
# 1.003x documents at B4·S4k and B1·S16k (bwd_kind_loops_d128_probe_h200_2026-12-03b.json.gz).
D64_KIND_LOOPS = True
# Block-sparse backward kernels run their KV tiles longest-first within L2-sized head groups (`lpt_order`). Timed in
# turns on an H100 against the mask's own order: backward 1.058x causal B4·S4k, 1.008x causal B1·S16k (paired;
# bwd_lpt_order_probe_h100_2026-12-06.json.gz).
LPT_ORDER = True
# `lpt_order`: bytes of Q, dO and the fp32 dQ sums one group of (batch, KV head) pairs may hold in L2 together. On an
# H100, 8, 16 and 24 MiB groups timed within 1% of 48 MiB (paired fwd+bwd) on causal B1·S16k, causal B4·S4k,
# documents B4·S4k and ALiBi-causal B1·S16k, but for 8 MiB at causal B4·S4k, 3% slower
# (bwd_lpt_group_{8,16,24}m_probe_h100_2026-12-06b.json.gz): the L2 group is not what holds causal S16k back.
LPT_GROUP_L2_BYTES = 48 << 20
# Deterministic kernels run their KV tiles in the launcher's turn order (`lpt_order` there,
# `bwd_launch.turn_tile_order`): the heads of an L2 group take turns, and under a block mask higher KV tiles add
# their dQ partials first.
TURN_ORDER = True


@dataclass(frozen=True)
class BwdConfig:
    head_dim: int
    tile_m: int = 64  # query rows per step: the N of the S^T = K Q^T GEMM
    tile_n: int = 128  # key rows per CTA, split over tile_n // 64 consumer warpgroups
    num_stages: int = 2  # depth of the Q/dO ring
    dtype_bytes: int = 2
    stats_in_smem: bool = True
    dk_after_dq: bool = True
    kv_tiles_first: bool = True
    dq_split_rows: bool = False
    mask_early: bool = False
    early_dv: bool = False
    dq_warp: bool = True
    lpt_order: bool = False  # block-sparse, or (as the turn order) deterministic mode: see the module docstring
    # The waits on each Q/dO stage (the consumers' for a full one, the producer's for an empty one) try once without
    # a suspend-time hint before the wait loop that lets warps sleep (`FwdConfig.try_wait_first`). Timed in turns:
    # 0.95-1.02x of the default's main kernel (bwd_step_candidates_h200_2026-12-01.json.gz); off.
    try_wait_first: bool = False
    # Each consumer warp arrives on an mbarrier that nobody waits on, with an arrive count computed from the step's
    # first probability (`stage_waits.arrive_after`), just before the wait for dP^T: ptxas keeps that wait behind the
    # arrive. Left free, it hoisted the wait above every exponential of P in the block-mask kernels (dense: after 6
    # of 40), so P was formed after dP^T instead of beside it (the forward's `FwdConfig.anchored_release`). Timed in
    # turns: 0.98-1.02x of the default's main kernel on seven masked rows
    # (bwd_anchored_wait_sweep_h200_2026-12-01.json.gz); off. On an H100, off was 1.008x and 1.019x paired backward
    # on causal B1·S16k and B4·S4k (bwd_anchored_wait_probe_h100_2026-12-06.json.gz).
    anchored_wait: bool = False
    # With `anchored_wait`: how many of the step's first probabilities (in program order, column by column) the
    # anchor's count is computed from, so ptxas forms at least that many before it waits for dP^T (1: the first).
    # FA4's causal step forms 16 of its 32 there, its dense step 11 of 40. Our dense step (6 of 40 by default) with
    # `stats_before_dp` and 16 here forms 19 (515 SASS instructions against 502; 491 with `ds_store_live` too; FA4's
    # 463): not timed on the dense rows yet (BENCHMARKS.md, "Waiting for a GPU").
    anchor_exps: int = 1
    # The step's LSE2 rows are read from shared memory between the issues of the S^T and dP^T GEMMs (needs
    # `stats_in_smem`), as FA4 reads them, instead of after the S^T wait, where dP^T's operand reads already fill
    # shared memory and the first exponentials' FFMAs wait on those loads (10% of the causal kernel's stall
    # samples on an H100, ncu_bwd_causal_b1s16k_source_h100_2026-12-06.csv.gz). Alone (a branch then): 0.98-1.02x
    # of the default's main kernel on the H200 (bwd_stats_before_dp_h200_2026-12-01.json.gz), as ptxas still waits
    # for dP^T before every exponential; with `anchored_wait` and `anchor_exps=16` (the sweep's `fa4_step_order`,
    # FA4's order) level too: the default's backward 1.001x and 1.002x paired against it on causal B1·S16k and
    # B4·S4k, 1.006x against anchor_exps=32 (bwd_fa4_step_order{,_anchor32}_probe_h200_2026-12-06.json.gz); off.
    # With a score_mod derivative and captured-tensor gradients the rows held across the dP^T issue raise spills
    # (learnable bias, tests/kernels/bwd_option_report.py: 72 -> 232 bytes at D=128).
    stats_before_dp: bool = False
    # `mask_bits`: a partial step's stored bits are loaded before the wait for its Q/dO stage instead of after the
    # S^T and dP^T issues; their wait was 8.8% of the documents B4·S4k kernel's stall samples on an H100
    # (ncu_bwd_document_b4s4k_source_h100_2026-12-06.csv.gz). Timed in turns on the H200, 31 rounds: backward
    # 1.036x paired at documents B4·S4k (forward + backward 1.027x), 1.007x at B1·S16k, 1.002x at D=64 B1·S16k
    # (bwd_bits_before_wait_probe_h200_2026-12-06b.json.gz); on.
    bits_before_wait: bool = True
    # The dS store's shared-memory address (this thread's stmatrix slots) stays live through the step loop instead
    # of being rebuilt from the thread index in every step where registers were tight (`FlexBwdSm90.consume`): ~26
    # integer instructions, an S2R among them, between the dP^T wait and the dV GEMM's issue. CPU compile, D=128
    # step loops: causal 558 -> 532 SASS instructions, dense 502 -> 478 (FA4's: 441 causal, masking every step,
    # 463 dense; it keeps the address in one register), both 0 spill bytes. Slower all the same: timed in turns on an
    # H100, 15 rounds, the default's backward 1.005x paired against it on causal B4·S4k, 1.003x sliding window
    # B1·S16k, 1.014x documents B4·S4k, 1.028x dense B4·S4k, 1.019x D=64 causal B1·S16k, 0.993x causal B1·S16k
    # (bwd_ds_store_live_probe_h100_2026-12-07.json.gz): the fewer instructions do not pay for the register; off.
    ds_store_live: bool = False
    # Block-sparse: the consumers read a step's query-tile index only where they use it, on partial steps (mask
    # coordinates, stored bits); full steps skip the list read and its address arithmetic (~30 instructions, uniform
    # datapath). The producer and the dQ warp still read every index. Needs `dq_warp`, rows in shared memory and a
    # non-deterministic kernel (where the consumers use the index on every step). Timed in turns on an H100 (three
    # runs, 21, 31 and 21 rounds; bwd_partial_index_only_probe_h100_2026-12-07{,b,c}.json.gz), backward paired:
    # causal B4·S4k 1.008x, 1.004x, 1.009x, causal B1·S16k 1.015x, 1.012x, 1.001x, sliding window B1·S16k 1.005x,
    # 1.009x, 1.015x, D=64 causal 1.004x; on. Not with stored mask bits (documents B4·S4k 0.993x and 0.996x, B1·S16k
    # 0.998x).
    partial_index_only: bool = True
    # Q (with the LSE2 rows) and dO (with the D rows) land on separate barriers of each Q/dO stage, and a step waits
    # for dO only before it issues dP^T = V dO^T, so S^T starts as soon as Q is there (FA4's sm90 backward waits
    # for the two apart; `stage_waits.QdoStages`), and dO's half of the stage is released once the dV GEMM, its last
    # reader, is done, before Q's, which dK still reads (FA4 releases them apart too). Not in the lean plan
    # (score_mod gradients at D=128), where it spilled. The producer's two waits ignore `try_wait_first`. CPU
    # compile: one more wait per step, no spills (tests/kernels/test_bwd_options.py). Timed in turns on an H100
    # (bwd_split_qdo_wait_probe_h100_2026-12-07.json.gz, 21 rounds, backward paired): 0.997x causal B4·S4k, 0.994x
    # causal B1·S16k, 0.990x sliding window B1·S16k, 0.995x documents B4·S4k, 1.003x dense B4·S4k; off.
    split_qdo_wait: bool = False
    # dQ is computed transposed, dQ^T = K^T dS^T: the head dim on wgmma's M axis (64 per consumer warpgroup) and
    # the query rows on N, so a step may take any multiple of 16 rows, not only 64 or 128 (`DENSE_TILE_M`).
    dq_swap_ab: bool = False
    # Each consumer thread adds its dQ partial straight into the fp32 accumulator with 16-byte vector reductions
    # (red.global.add.v4.f32, in the slab's fragment order), instead of through a shared-memory slab and a TMA
    # reduce-add: frees the slab (64 KiB at D=256, room for a second Q/dO stage) and needs no dQ warp. In
    # deterministic mode each consumer warp waits for its turn on the Q tile and releases it after its adds.
    dq_red: bool = False
    # The slab's reduce-add is a plain bulk copy (cp.reduce.async.bulk ... .add.f32 over its contiguous bytes) instead
    # of a TMA tensor reduce: the slab is one contiguous run of `dQaccum` either way, so no tensor map is needed to
    # address it (FA4's sm90 backward adds its dQ partials this way). Off: backward 0.994x causal and 0.996x dense at
    # B4·S4k D=128, timed in turns (bwd_dq_bulk_reduce_probe_h200_2026-12-03b.json.gz).
    dq_bulk_reduce: bool = False
    # Block-sparse with a mask_mod: a KV tile's partial and full query tiles are walked by two loops, each with its
    # step compiled for that kind (as the forward does), instead of one loop whose step branches on the kind at run
    # time: the full steps carry no mask code, no test and no pick between the two lists, at the price of a second
    # copy of the step in the binary (SASS per full step at D=128 under a causal mask: 462 instructions, against 558
    # for the branching loop). The default at head_dim 64 with 128-row steps (`D64_KIND_LOOPS`, measured there).
    kind_loops: bool = False
    # Block-sparse only: partial blocks read their mask from bits stored by the launcher (`runtime.mask_bits`, rows =
    # keys, 64 or 128 query columns) instead of evaluating mask_mod; chosen where the forward's are
    # (`kernels.config.STORE_MASK_BITS`: masks that read captured tensors).
    mask_bits: bool = False
    # >0: persistent CTAs, at most this many (the launcher sets the SM count), each running KV tiles one after
    # another as the producer warp claims them from a global counter (the forward's `claim_tile`) and hands them to
    # the consumers and the dQ warp through shared-memory slots. dK and dV leave through the dS buffers instead of
    # over K and V, so the next tile's K, V and first Q/dO stages load while this tile's epilogue runs, instead of
    # after the CTA has ended and the next one has started (`persistent_fits`).
    persistent_ctas: int = 0
    # The launcher runs persistent CTAs, one per SM, where the KV tiles walk few query tiles (`runs_persistent`):
    # there a CTA's start and end are a large share of its work. Off for the sweep's one-tile-per-CTA candidate.
    persistent_short_tiles: bool = True
    # Dense, one CTA per tile: the tiles of the last wave, which would leave SMs idle (2048 tiles on 132 SMs run 16
    # waves for 15.5 waves of work), are cut into `parts` CTAs each, each walking an even share of the tile's query
    # steps; the last part to finish adds all parts' dK and dV in part order and stores them
    # (`kernels.split_tail.TailPiece`). Two kernels on the stream: one of `whole_tiles_only` (today's kernel, whose
    # CTAs past the whole tiles do nothing), then one of `split_tail` (the parts). The whole tiles keep the code of a
    # kernel without a tail: one kernel that ran both decoded its tile from a 1-D index and bounded its steps at run
    # time, and its whole tiles were 2-4% slower (BENCHMARKS.md). The launcher cuts where `split_parts` says that pays.
    split_tail: bool = False
    whole_tiles_only: bool = False
    # The launcher may cut the last wave (`split_parts`); off for the sweep's candidate without it.
    split_last_wave: bool = True
    # The backward's kernels follow one another with programmatic dependent launch: each one's CTAs start (shared
    # memory, barriers, TMA descriptors) while the kernel before it drains its last wave, and wait
    # (`griddepcontrol.wait`) before touching what that kernel writes. The preprocess waits for whatever ran before
    # it; the main kernel for the preprocess's rows and zeroed dQ sums; the postprocess for every dQ partial. Each
    # lets the next one in once it has passed its own wait, so a kernel never starts before the ones two back have
    # ended. Off for the sweep's candidate without it.
    chained_launch: bool = True
    # Partial query tiles of a band mask (causal, sliding windows: `flexlab.codegen.band`) are masked per key row from
    # the generated `mask_band_by_key`: one word of bits per row, each score kept by its bit, instead of evaluating
    # mask_mod per score (`FwdConfig.band_mask` in the forward). CPU compile, SASS instructions per step loop with
    # mask_mod / with this, sliding window of 1024: D=64 partial-tile loop 942 / 791, D=128 (one loop) 622 / 563;
    # causal D=64 814 / 783. With `mask_early` the words are formed while the S^T GEMM runs; without it, at D=128
    # after the GEMM's wait, in front of the exponentials (the SASS showed them there; D=64's partial-tile loop has
    # them ahead of the GEMM's issue either way). Off: fewer instructions but slower on the H200 without mask_early,
    # backward timed in turns, the median of each round's ratio (bwd_band_mask_probe_h200_2026-12-03.json.gz): sliding
    # window D=128 0.98x at B1·S16k and 0.99x at B4·S4k, D=64 0.98x; causal D=64 0.96x, D=128 1.00x. Gradients equal
    # dK/dV bitwise.
    band_mask: bool = False
    # Dense, outside deterministic mode: KV tile n starts its walk of the query tiles n tiles (mod their count) below
    # the last and wraps around (`KvSchedule`, `rotate`), instead of every tile starting at the last. With
    # `kv_tiles_first` the tiles of one head run side by side and keep pace, so in the plain walk all of them (128
    # at B1·S16k, 32 at B4·S4k) load the same Q and dO tile and add into the same dQ rows at the same moment, from
    # the same few L2 lines; rotated, each reads and adds a different tile while the head's Q, dO and dQ sums
    # still share L2. The dense forward + backward is behind the best peer at B1·S16k and level at B4·S4k on both GPUs
    # (the paired intervals of the 2026-12-06 H200 and 2026-12-07 H100 runs), the row where the most tiles keep
    # pace. Off: timed in turns on an H100 it made that row's backward 1.6% slower (interval 1.001-1.056) and left the
    # B4·S4k rows level (BENCHMARKS.md, "The rotated dense backward walk timed"). Deterministic mode adds dQ in a
    # fixed tile order, which the plain walk keeps waitless.
    rotate_dense_walk: bool = False

    @property
    def persistent(self) -> bool:
        return self.persistent_ctas > 0

    @property
    def lets_next_in_early(self) -> bool:
        """Chained, whether the main kernel lets the next kernel launch once all its CTAs have passed their wait
        (the postprocess's CTAs then take the SMs of the last wave as they free up), not as its last CTAs end.
        Persistent CTAs (D=64 sliding window S16k: 5.6% faster backward than when it is not), the whole tiles of a
        cut last wave (whose parts must start early) and the parts themselves do; a grid of one CTA per tile does
        not (D=64 causal S16k: 1.6% slower with it; BENCHMARKS.md)."""
        return self.chained_launch and (self.persistent or self.whole_tiles_only or self.split_tail)

    @property
    def persistent_fits(self) -> bool:
        """A dK tile (16 bit) fits in the two dS buffers (dV follows it there once its store has read them, unless
        both fit: head_dim <= tile_m)."""
        return self.tile_n * self.head_dim <= 2 * self.tile_m * self.tile_n

    @property
    def split_head_dim(self) -> bool:
        """Two consumer warpgroups share the CTA's 64 key rows (head_dim 256): each computes S^T and dP^T for half
        the step's query columns, P^T and dS^T meet in shared memory, and each accumulates dK and dV for half the
        head dim from there (FA3's hdim-256 split). Below, each warpgroup owns 64 key rows outright."""
        return self.head_dim > MAX_UNSPLIT_HEAD_DIM

    @property
    def num_consumer_wgs(self) -> int:
        return 2 if self.split_head_dim else self.tile_n // 64

    @property
    def dq_layout(self) -> tuple:
        """How the dQ partials sit in the fp32 accumulator, which the postprocess must know to read them back:
        (query rows per tile, consumer warpgroups, dQ split by rows rather than columns, dQ computed transposed)."""
        return (self.tile_m, self.num_consumer_wgs, self.dq_split_rows, self.dq_swap_ab)

    @property
    def num_threads(self) -> int:
        return 128 * (self.num_consumer_wgs + 1)

    @property
    def register_split(self) -> tuple[int, int]:
        """(producer, consumer) registers per thread after `setmaxnreg`."""
        return {1: (56, 256), 2: (24, 240)}[self.num_consumer_wgs]

    def smem_bytes(self) -> int:
        """Bytes of the kernel's shared-storage struct: mbarriers (and the per-stage LSE2/D rows) first, then each
        tile buffer aligned to 1 KiB (the 128-byte swizzle repeats every 1 KiB)."""
        def up(n):
            return -(-n // 1024) * 1024
        # mbarriers: K/V, Q/dO per stage (a second set for dO with `split_qdo_wait`), the anchor
        head = 8 * (2 + 2 * self.num_stages * (1 + self.split_qdo_wait) + self.anchored_wait)
        if self.persistent:  # the tile slots: two mbarriers and TILE_SLOT_WORDS words each
            head += TILE_SLOTS * (16 + 4 * TILE_SLOT_WORDS)
        if self.split_tail:  # the flag that says which part of a cut tile came last
            head += 16
        if self.stats_in_smem:
            head += 2 * self.num_stages * self.tile_m * 4
        kv = 2 * self.tile_n * self.head_dim * self.dtype_bytes  # K and V (one-tile CTAs stage dK, dV over them)
        q_do = 2 * self.num_stages * self.tile_m * self.head_dim * self.dtype_bytes
        ds = 2 * self.tile_m * self.tile_n * self.dtype_bytes  # double-buffered dS
        if self.split_head_dim:
            ds *= 2  # ... and P, which the other warpgroup's dV GEMM reads too
        dq = 0 if self.dq_red else self.tile_m * self.head_dim * 4  # fp32 dQ partial, reduced into global by TMA
        return up(head) + kv + q_do + ds + dq

    def feasibility_error(self) -> str | None:
        """Why this configuration cannot run on sm90, or None when it can."""
        if self.head_dim not in BWD_HEAD_DIMS:
            return f"head_dim={self.head_dim} is not one of {BWD_HEAD_DIMS} for the backward kernel"
        if self.tile_n not in (64, 128):
            return f"tile_n={self.tile_n} must be 64 or 128 (one or two 64-row consumer warpgroups)"
        if self.split_head_dim and (self.tile_n != 64 or self.tile_m % 32 or self.dq_swap_ab or self.dq_split_rows
                                    or self.mask_early or self.early_dv or self.mask_bits or not self.dk_after_dq):
            return (f"head_dim={self.head_dim} splits 64 key rows over two warpgroups: it needs tile_n=64, tile_m a "
                    "multiple of 32, dk_after_dq, and none of dq_swap_ab, dq_split_rows, mask_early, early_dv, "
                    "mask_bits")
        if self.tile_m % 16 or not 16 <= self.tile_m <= 128:
            return f"tile_m={self.tile_m} must be a multiple of 16 in [16, 128] (wgmma N and K granularity)"
        if self.num_stages < 1:
            return "num_stages must be at least 1"
        if self.head_dim % (8 * self.num_consumer_wgs):
            return "head_dim must split evenly over the consumer warpgroups for the dQ GEMM"
        if self.dq_swap_ab and (self.dq_split_rows or self.head_dim != 64 * self.num_consumer_wgs):
            return (f"dq_swap_ab puts 64 head-dim columns of dQ^T on each of the {self.num_consumer_wgs} consumer "
                    f"warpgroups: head_dim must be {64 * self.num_consumer_wgs} and dq_split_rows off")
        if not self.dq_swap_ab and self.tile_m % 64:
            return f"tile_m={self.tile_m}: the dQ GEMM (wgmma M = query rows) needs a multiple of 64, or dq_swap_ab"
        if self.dq_split_rows and self.tile_m != 64 * self.num_consumer_wgs:
            return (f"dq_split_rows gives each of the {self.num_consumer_wgs} consumer warpgroups 64 query rows of "
                    f"dQ: tile_m must be {64 * self.num_consumer_wgs}, got {self.tile_m}")
        if self.persistent and (self.split_head_dim or not self.dq_warp or not self.persistent_fits
                                or not (self.kv_tiles_first or self.lpt_order)):
            return ("persistent_ctas > 0 stages dK and dV in the dS buffers and hands tiles to the dQ warp: it needs "
                    "dq_warp, no split head dim, head_dim <= 2 * tile_m, and kv_tiles_first or lpt_order")
        if (self.split_tail or self.whole_tiles_only) and (self.persistent or self.lpt_order or not self.kv_tiles_first
                                                            or (self.split_tail and self.whole_tiles_only)):
            return ("split_tail / whole_tiles_only cut the last wave of a grid of one CTA per KV tile in launch order: "
                    "one of them, with kv_tiles_first and neither persistent_ctas nor lpt_order")
        if self.persistent_ctas < 0:
            return f"persistent_ctas={self.persistent_ctas} must be 0 (off) or a CTA count"
        if self.dq_red and self.dq_bulk_reduce:
            return "dq_bulk_reduce adds the shared-memory slab, which dq_red does without: one of them"
        if self.dq_red and self.dq_warp:
            return "dq_red adds the dQ partials from the consumer threads: there is no reduce for a dQ warp to issue"
        if self.smem_bytes() > SMEM_BYTES_SM90:
            return f"needs {self.smem_bytes()} bytes of shared memory, sm90 has {SMEM_BYTES_SM90}"
        if self.stats_before_dp and not self.stats_in_smem:
            return "stats_before_dp reads the LSE2 rows from their shared-memory copy: it needs stats_in_smem"
        if self.anchor_exps < 1:
            return f"anchor_exps={self.anchor_exps} must be at least 1"
        if self.mask_bits and (self.tile_n != 128 or self.tile_m not in (64, 128) or self.mask_early):
            return "mask_bits=True stores 128 key rows of 64 or 128 query columns per block and replaces " \
                   "mask_early: it needs tile_n=128, tile_m 64 or 128 and mask_early=False"
        producer, consumer = self.register_split
        if 128 * producer + 128 * self.num_consumer_wgs * consumer > REGISTERS_PER_SM:
            return "register split exceeds 64K registers per CTA"
        # Per consumer thread: dK + dV accumulators (head_dim/2 each), S^T and dP^T (tile_m/2 each), each halved
        # where two warpgroups share the key rows. A score_mod adds the pre-mod scores (tile_m/2) while dS is formed;
        # the compile report (ptxas) has the last word.
        live = (self.head_dim + self.tile_m) // (2 if self.split_head_dim else 1)
        if live + 32 > consumer:
            return f"about {live + 32} live registers per consumer thread, only {consumer} after setmaxnreg"
        return None

    def validate(self) -> BwdConfig:
        err = self.feasibility_error()
        if err:
            raise ValueError(f"infeasible BwdConfig {self}: {err}")
        return self

    def block_mask_error(self, q_block: int, kv_block: int) -> str | None:
        if q_block % self.tile_m or kv_block % self.tile_n:
            return (f"block_mask BLOCK_SIZE={(q_block, kv_block)} is not a multiple of the backward tile "
                    f"{(self.tile_m, self.tile_n)}")
        return None


def drop_gathering_kind_loops(cfg: BwdConfig, mask_gathers: bool) -> BwdConfig:
    """`cfg` without `kind_loops` where the partial steps would evaluate a mask_mod that reads captured tensors
    (`mask_gathers`) inline: compiled twice, the gathering step spilled (the gallery's bigbird and tree masks, 8 and 112
    bytes at D=64). With stored bits (`mask_bits`, the launcher's choice for such masks) the loops stay: documents
    D=64 B1·S16k, timed in turns, backward 1.029x, forward + backward 1.016x
    (bwd_kind_loops_d64_probe_h200_2026-12-03.json.gz)."""
    if cfg.kind_loops and mask_gathers and not cfg.mask_bits:
        return replace(cfg, kind_loops=False)
    return cfg


def default_bwd_config(head_dim: int, deterministic: bool = False, mod_grads: bool = False,
                       q_block: int | None = None, mask_ops: int = 0) -> BwdConfig:
    """The configuration the launcher runs: the dataclass defaults (see the module docstring for why), except

    - deterministic mode runs the launcher's turn order (`lpt_order` with `TURN_ORDER`, `bwd_launch.turn_tile_order`).
      There each KV tile waits for the tiles before it in turn to add their dQ partials to a Q tile first. Run side
      by side, a head's tiles formed a chain (4-12x flexlab's default time on the sliding-window and document rows,
      benchmarks/results/bwd_all_h200_2026-11-30b.json.gz); one or two tiles of every head at a time sent the dQ sums
      of all heads through DRAM (D=256 dense: 2.3x the default). The turn order lets the heads of an L2 group take
      turns and, under a block mask, gives higher KV tiles the earlier turns, walked in Q order: main kernel
      1.17-1.32x the default's time at D=128 and D=64 against 1.20-1.78x before
      (bwd_det_pipelined_h200_2026-12-01.json.gz, bwd_det_turns_q_order_h200_2026-12-01.json.gz);
    - at head_dim 64, 128-row Q steps (`D64_TILE_M`) unless the kernel works on every score for a score_mod
      derivative or captured-tensor gradients (`mod_grads`) or evaluates a mask_mod of more than
      `D64_MAX_MASK_OPS` operations (`mask_ops`), and when the block mask's Q block (`q_block`, None without a mask)
      is a multiple of 128;
    - with a block mask outside deterministic mode, `lpt_order` (`LPT_ORDER`), and in deterministic mode its turn
      order (`TURN_ORDER`);
    - at head_dim 128 without a block mask and without `mod_grads`, 80-row Q steps with dQ computed transposed
      (`DENSE_TILE_M`, `dq_swap_ab`);
    - with those 128-row steps, `dq_split_rows`: each consumer warpgroup forms 64 rows of dQ over all 64 columns
      (wgmma N = 64, not 32). Main kernel 1.01x dense, 1.05-1.07x causal, sliding window and documents at B1·S16k,
      1.02x deterministic causal (benchmarks/results/bwd_d64_rows_h200_2026-11-30.json.gz); at 64-row steps it does
      not apply, and 128 rows with a soft-cap derivative were 0.93x;
    - with those 128-row steps outside deterministic mode, `kind_loops` (`D64_KIND_LOOPS`; the launcher drops it
      for a mask_mod that reads captured tensors inline, `drop_gathering_kind_loops`).
    """
    if head_dim > MAX_UNSPLIT_HEAD_DIM:
        # 64 x 64 steps. K, V and a Q/dO stage take 32 KiB each at 256 columns and dS, P 32 KiB together, so the
        # fp32 dQ slab (64 KiB) leaves room for one stage; adding the partials from registers (`dq_red`) leaves room
        # for two: main kernel 1.35-1.47x faster at B4·S4k dense and causal
        # (benchmarks/results/bwd_d256_dq_red_sweep_h200_2026-12-01.json.gz). Deterministic mode keeps the slab and
        # one stage: its dQ warp waits for the turns, where consumer warps waiting themselves (`dq_red` in turn, two
        # stages) measured 0.82-0.83x (bwd_det_d256_h200_2026-12-01.json.gz).
        return BwdConfig(head_dim=head_dim, tile_m=64, tile_n=64, num_stages=1 if deterministic else 2,
                         dq_red=not deterministic, dq_warp=deterministic, kv_tiles_first=not deterministic,
                         lpt_order=_tile_order(deterministic, q_block))
    tile_m = 64
    if (head_dim == 64 and not mod_grads and mask_ops <= D64_MAX_MASK_OPS
            and (q_block is None or q_block % D64_TILE_M == 0)):
        tile_m = D64_TILE_M
    swap = head_dim == 128 and q_block is None and not mod_grads
    if swap:
        tile_m = DENSE_TILE_M
    wide64 = head_dim == 64 and tile_m == 64 * 2
    return BwdConfig(head_dim=head_dim, tile_m=tile_m, kv_tiles_first=not deterministic, dq_split_rows=wide64,
                     dq_swap_ab=swap, lpt_order=_tile_order(deterministic, q_block),
                     kind_loops=wide64 and D64_KIND_LOOPS and not deterministic)


def split_parts(num_tiles: int, workers: int, steps: int) -> int:
    """How many CTAs each tile of the last wave gets (`BwdConfig.split_tail`; 1: none cut) for `num_tiles` tiles of
    `steps` query steps each on `workers` CTAs at a time.

    After the whole waves, the `num_tiles % workers` tiles left run as parts: `parts` per tile, ceil(parts * tail /
    workers) waves of them, each wave as long as a part (its share of the steps plus `TAIL_PART_COST_STEPS`). A cut is
    taken only where it is shorter than the whole tiles' one wave (`steps` + `WHOLE_TILE_COST_STEPS`): 2048 tiles of
    52 steps on 132 SMs leave 68, whose wave of 54 steps 3 parts each finish in 2 x (18 + 3) = 42."""
    tail = num_tiles % workers
    best, best_cost = 1, steps + WHOLE_TILE_COST_STEPS
    if tail == 0:
        return 1
    for parts in range(2, MAX_TAIL_PARTS + 1):
        share = -(-steps // parts)
        if share < MIN_TAIL_PART_STEPS:
            break
        cost = -(-parts * tail // workers) * (share + TAIL_PART_COST_STEPS)
        if cost < best_cost:
            best, best_cost = parts, cost
    return best


def runs_persistent(cfg: BwdConfig, mean_steps, deterministic: bool, captured_grads: bool = False) -> bool:
    """Whether the launcher runs `cfg` as persistent CTAs for KV tiles of `mean_steps` query tiles on average (a
    number, or a function giving it, called last: it may read the block mask on the device). Not in deterministic
    mode (its dQ turns follow the launch order), nor with gradients of captured tensors (their open runs take the
    registers the tile loop needs: a learnable relative bias at D=128 then spilled 8 bytes)."""
    if not cfg.persistent_short_tiles or cfg.persistent or deterministic or captured_grads:
        return False
    if replace(cfg, persistent_ctas=H200_SMS).feasibility_error() is not None:
        return False
    return (mean_steps() if callable(mean_steps) else mean_steps) <= PERSISTENT_MAX_MEAN_STEPS


def _tile_order(deterministic: bool, q_block: int | None) -> bool:
    """Whether the CTAs follow a launcher-built order: longest first under a block mask (`LPT_ORDER`), turn order in
    deterministic mode (`TURN_ORDER`)."""
    return TURN_ORDER if deterministic else LPT_ORDER and q_block is not None


def shares_block_mask_with_forward(head_dim: int, block_size: int = 128) -> bool:
    """True when one BlockMask at `block_size` drives both the forward and the backward kernel."""
    from ..runtime.sparsity import block_size_incompatibility  # the forward's own rule (192-row tiles merge rows)
    fwd = default_config(head_dim, block_sparse=True)
    bwd = default_bwd_config(head_dim, q_block=block_size)
    return (block_size_incompatibility((block_size, block_size), fwd.tile_m, fwd.tile_n) is None
            and bwd.block_mask_error(block_size, block_size) is None)


def candidate_bwd_configs(head_dim: int, deterministic: bool = False, mod_grads: bool = False,
                          q_block: int | None = None, num_sms: int = H200_SMS) -> dict[str, BwdConfig]:
    """Named configurations the GPU sweep (`benchmarks/probes/bwd_perf_sweep.py`) compares with the default of that
    mode: the other CTA order, LSE2/D from global memory, each other option flipped, and at D=64 the other Q step and dQ
    split. (The former `combined` candidate, dK after dQ with a third stage or 128-row steps, became the default or
    `stages3` once dK after dQ was the default.) `q_block`: the block mask's Q block size, None without one (the
    default differs: `default_bwd_config`). Options that do not fit
    beside that default (a third Q/dO stage with 128-row tiles at D=64 overflows shared memory) are left out; the
    launcher runs `default`."""
    base = default_bwd_config(head_dim, deterministic, mod_grads, q_block)
    other_order = "heads_first" if base.kv_tiles_first else "kv_tiles_first"
    cands = {
        "default": base,
        # (the grid's order: a launcher-built order, `lpt_order`, would override it)
        other_order: replace(base, kv_tiles_first=not base.kv_tiles_first, lpt_order=False),
        "stats_from_global": replace(base, stats_in_smem=False),
        # the default before 2026-11-30
        "neither": replace(base, stats_in_smem=False, kv_tiles_first=False, lpt_order=False),
        # dQ before or after dK, whichever the default does not do
        "dk_before_dq" if base.dk_after_dq else "dk_after_dq": replace(base, dk_after_dq=not base.dk_after_dq),
        "stages3": replace(base, num_stages=3),
        "early_dv": replace(base, early_dv=True),
        # the dQ reduce issued by the consumer warpgroups or by a producer warp, whichever the default does not do
        "dq_in_consumers" if base.dq_warp else "dq_warp": replace(base, dq_warp=not base.dq_warp),
        # mask_mod before or after the S^T wait, whichever the default does not do
        "mask_late" if base.mask_early else "mask_early": replace(base, mask_early=not base.mask_early),
        "try_wait_first": replace(base, try_wait_first=True),
        "anchored_wait" if not base.anchored_wait else "free_wait": replace(base, anchored_wait=not base.anchored_wait),
        # FA4's order where the two GEMMs of a step meet: LSE2 rows read between their issues, 16 of the step's
        # probabilities formed before the dP^T wait
        "fa4_step_order": replace(base, stats_before_dp=base.stats_in_smem, anchored_wait=True, anchor_exps=16),
    }
    if base.stats_in_smem and not base.stats_before_dp:
        cands["stats_before_dp"] = replace(base, stats_before_dp=True)
    if base.dq_swap_ab:  # (no block mask: 80 divides no mask block size, so no other Q-step question either)
        cands["tile_m64"] = replace(base, tile_m=64, dq_swap_ab=False)
        cands["tile_m64_swap"] = replace(base, tile_m=64)
    if base.dq_red:  # the dQ partials through a shared-memory slab (one Q/dO stage less at D=256)
        cands["dq_slab"] = replace(base, dq_red=False, dq_warp=True, num_stages=base.num_stages - 1)
    else:  # straight from registers, and with the slab's shared memory spent on one more stage
        cands["dq_red"] = replace(base, dq_red=True, dq_warp=False, dq_bulk_reduce=False)
        # the slab added by a plain bulk reduce or by a TMA tensor reduce, whichever the default does not do
        cands["dq_tensor_reduce" if base.dq_bulk_reduce else "dq_bulk_reduce"] = replace(
            base, dq_bulk_reduce=not base.dq_bulk_reduce)
        more = base.num_stages + 1
        cands[f"dq_red_stages{more}"] = replace(base, dq_red=True, dq_warp=False, dq_bulk_reduce=False,
                                                num_stages=more)
    if not deterministic and replace(base, persistent_ctas=num_sms).feasibility_error() is None:
        # persistent CTAs, and one CTA per tile whatever the tiles' length (`runs_persistent`)
        cands["persistent"] = replace(base, persistent_ctas=num_sms)
        cands["one_tile_per_cta"] = replace(base, persistent_short_tiles=False)
    if not deterministic and q_block is None:  # every tile of the last wave whole (`split_parts`)
        cands["whole_last_wave"] = replace(base, split_last_wave=False)
        # each KV tile starts its walk at a query tile of its own
        cands["rotate_dense_walk" if not base.rotate_dense_walk else "plain_dense_walk"] = replace(
            base, rotate_dense_walk=not base.rotate_dense_walk)
    cands["unchained"] = replace(base, chained_launch=False)  # each kernel launched after the one before has ended
    if deterministic:  # `neither` is then the other order with global stats: not a new question
        del cands["neither"]
    # (outside deterministic mode for block-sparse rows only: the launcher drops it without a block mask)
    cands["natural_order" if base.lpt_order else "lpt_order"] = replace(base, lpt_order=not base.lpt_order)
    if q_block is not None:  # (the launcher drops it without a block mask and a mask_mod: one kind of step there)
        cands["kind_branch" if base.kind_loops else "kind_loops"] = replace(base, kind_loops=not base.kind_loops)
    if head_dim == 64:
        rows128 = replace(base, tile_m=128, dq_split_rows=True)
        if base.tile_m == 128:
            cands["tile_m64"] = replace(base, tile_m=64, dq_split_rows=False)
            cands["dq_cols"] = replace(base, dq_split_rows=False)  # 128-row steps, dQ split by columns
        else:
            cands["tile_m128"] = replace(base, tile_m=128)
            cands["tile_m128_dq_rows"] = rows128
    assert base.feasibility_error() is None, base.feasibility_error()
    return {name: cfg for name, cfg in cands.items() if cfg.feasibility_error() is None}
