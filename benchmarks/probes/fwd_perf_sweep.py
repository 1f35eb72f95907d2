"""One H200 run that says where the forward kernel's time goes and which candidate option wins. One command:

    . .deps/activate.sh && python3 benchmarks/probes/fwd_perf_sweep.py OUT.json --budget 480

For the forward benchmark rows (`flexlab.bench.rows`, "fwd-default"; the short and masked rows first, so a budget cut
keeps the rows the issue asks about; `--rows D64` adds the D=64 document rows of `extra_rows`) it times, kernel by
kernel:
  baseline      the configuration flexlab runs today (`launch.config_for`), also through the public API and the
                runtime wrapper, with the profiler's kernel time and the host time per call;
  -<stage>      debug builds with one stage removed (`FwdConfig.ablate`, `config.ABLATIONS`): the time saved is
                what that stage costs on that row. Their outputs are wrong by design and are not checked;
  <candidate>   the candidate options of `FwdConfig` (persistent tiles, 3 K/V stages at D=128, 192-row tiles for D=64
                with a block mask, exponentials on the FMA pipe, O rescaled before the PV GEMM, early block index,
                lazy or eager O rescaling, and a combination). Each is checked against float64 attention on two
                (batch, head) pairs, all queries (rel-L2 < 1e-2, no NaN) before its time counts: a wrong candidate
                is reported as WRONG.
Kernel times call the compiled kernel directly (arguments prepared once), median of `triton.testing.do_bench` with
the L2 flushed between calls. TFLOP/s use the mask's exact density (`flexlab.bench.density`). After a row's variants,
its baseline and passing candidates (with `--fa4`, FA4's forward too) are timed again in `--rounds` rotated rounds
(`bench.timing.measure_interleaved`); decide on those times, not on the one-by-one ones, which drift with the clock.

Robustness: every kernel is compiled first by parallel worker processes into the disk cache (no GPU needed). Timing
runs in a child process watched by this one: a variant that prints nothing for `--case-timeout` seconds (a hang) is
killed and reported as `timeout`, a crash or CUDA error (illegal address) as `crashed`/`error`, and a fresh child
carries on with the remaining variants. The JSON is rewritten after every finished row, and nothing new starts after
`--budget` seconds. Not collected by pytest (no test_ prefix).

Reading the output: the first table lists, per row, the baseline's TFLOP/s and each candidate's speedup over it
(x1.00 = same; WRONG/timeout/... where it failed); the second lists, per row, how much of the baseline's time each
removed stage accounts for (baseline minus ablated time, in % of baseline; negative = noise). Full records, errors and
compile times are in OUT.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

TAG = "SWEEP "
STARTUP_TIMEOUT_S = 120.0
REL_L2_MAX = 1e-2
# The rows the issue asks about first; then every other forward row in rows.py order.
CORE = ["fwd causal B8 S1k H16 D128 bf16", "fwd dense B8 S1k H16 D128 bf16", "fwd causal B4 S4k H16 D128 bf16",
        "fwd dense B4 S4k H16 D128 bf16", "fwd causal B1 S16k H16 D128 bf16", "fwd dense B1 S16k H16 D128 bf16",
        "fwd sliding_window B4 S4k H16 D128 bf16", "fwd document B4 S4k H16 D128 bf16",
        "fwd causal B1 S16k H16 D64 bf16"]
ABLATION_ORDER = ("softmax", "exp2", "pv", "overlap", "store", "kv_loads", "mask_mod", "score_mod")


# ------------------------------------------------------------------------------------------------ rows and variants
def extra_rows():
    """Rows outside the benchmark's forward set, picked by name only (`--rows "D64"`): the D=64 document forward at
    three lengths, where the wide-tile bound for stored mask bits is to be placed (`D64_BITS_TILE192_MIN_MEAN_KV_BLOCKS`);
    the D=256 dense and causal rows of the `d256` benchmark set (`--rows "D256"`)."""
    from flexlab.bench.rows import Row
    return [Row("document", 4, 4096, D=64), Row("document", 2, 8192, D=64), Row("document", 1, 16384, D=64),
            Row("dense", 4, 4096, D=256), Row("causal", 4, 4096, D=256)]


def sweep_rows(which: str):
    from flexlab.bench.rows import ROW_SETS
    rows = list(ROW_SETS["fwd-default"])
    by_name = {r.name: r for r in rows}
    ordered = [by_name[n] for n in CORE if n in by_name] + [r for r in rows if r.name not in CORE]
    if which == "core":
        return ordered[:len(CORE)]
    if which == "all":
        return ordered
    wanted = [w.strip() for w in which.split(",") if w.strip()]
    return [r for r in ordered + extra_rows() if any(w in r.name for w in wanted)]


def row_mods_kind(variant: str) -> tuple[bool, bool]:
    """(has score_mod, has mask_mod) of a benchmark variant, without building it."""
    return variant in ("alibi_causal", "softcap_causal"), variant != "dense"


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    kind: str  # "baseline" | "ablation" | "candidate"
    config: object  # FwdConfig
    what: str
    heads_group: int = 0  # (batch, head) pairs per L2 group of the CTA order; 0: the launcher's rule


def variants_for(row, base, num_sms: int) -> list[Variant]:
    """Baseline, one ablation per stage the row has, and the candidate options that apply to it."""
    from flexlab.kernels.config import ABLATIONS, FwdConfig
    has_score, has_mask = row_mods_kind(row.variant)
    rep = dataclasses.replace
    out = [Variant("baseline", "baseline", base, "the configuration flexlab runs today")]
    for stage in ABLATION_ORDER:
        if (stage == "mask_mod" and not has_mask) or (stage == "score_mod" and not has_score):
            continue
        out.append(Variant(f"-{stage}", "ablation", rep(base, ablate=(stage,)), ABLATIONS[stage]))
    # (a persistent CTA has no cluster partner: those candidates run without K/V multicast)
    if base.persistent_ctas:  # the default at short keys: the candidate is one CTA per tile
        cand = [Variant("not_persistent", "candidate", rep(base, persistent_ctas=0, dynamic_tiles=False),
                        "one CTA per tile")]
    else:
        cand = [Variant("persistent", "candidate", rep(base, persistent_ctas=num_sms, cluster_m=1),
                        f"{num_sms} CTAs loop over tiles; O in its own buffer when it fits")]
    if not base.dynamic_tiles:
        from flexlab.runtime.launch import _dynamic
        cand.append(Variant("dynamic", "candidate", _dynamic(base, base.persistent_ctas or num_sms),
                            "persistent CTAs claim tiles from a global counter, in launch order (as the launcher "
                            "builds them)"))
    else:
        cand.append(Variant("static_persistent", "candidate", rep(base, dynamic_tiles=False),
                            "persistent CTAs take every G-th tile"))
    if row.D == 128:
        cand.append(Variant("stages3", "candidate", rep(base, num_stages=3), "3 K/V stages"))
        cand.append(Variant("persistent+stages3", "candidate", rep(base, num_stages=3, persistent_ctas=num_sms),
                            "persistent with 3 K/V stages (O over Q)"))
    if base.mask_bits:
        cand.append(Variant("mask_mod_inline", "candidate", rep(base, mask_bits=False),
                            "partial blocks evaluate mask_mod instead of reading stored bits"))
        if row.D == 64:
            t192 = FwdConfig(head_dim=64, tile_m=192, tile_n=128, num_stages=3, mask_bits=True)
            cand.append(Variant("tile192+bits", "candidate", t192, "192-row tiles reading stored bits"))
            cand.append(Variant("tile192+bits+dynamic", "candidate",
                                rep(t192, persistent_ctas=num_sms, dynamic_tiles=True),
                                "192-row tiles reading stored bits, dynamic tiles"))
    if row.D == 64 and has_mask and not has_score:
        t192 = FwdConfig(head_dim=64, tile_m=192, tile_n=128, num_stages=3)
        cand.append(Variant("tile192", "candidate", t192, "192-row tiles over the 128-block mask (merged rows)"))
        cand.append(Variant("tile192+persistent", "candidate", rep(t192, persistent_ctas=num_sms),
                            "192-row tiles, persistent"))
    # The CTA order alone (same kernel): all Q tiles of one head back to back, or four heads interleaved, instead of
    # the launcher's L2 budget (`runtime.schedule.heads_per_group`).
    cand += [Variant(f"group{g}", "candidate", base, f"{g} (batch, head) pairs per L2 group", heads_group=g)
             for g in (1, 4)]
    # The same rule as the launcher's with a different L2 budget (MiB of K/V per group), and the baseline timed a
    # second time, so a schedule's gain can be told from run-to-run noise.
    from flexlab.runtime.schedule import heads_per_group
    cand += [Variant(f"l2_{mb}mb", "candidate", base, f"L2 groups of at most {mb} MiB of K/V",
                     heads_group=heads_per_group(row.S, row.D, 2, 1, row.B * row.H, l2_budget_bytes=mb << 20))
             for mb in (8, 16)]
    cand.append(Variant("baseline_again", "candidate", base, "the baseline timed again (noise)"))
    if not has_mask and not has_score and base.cluster_m == 1:
        cand.append(Variant("cluster2", "candidate", rep(base, cluster_m=2),
                            "2-CTA clusters share each K/V load (TMA multicast)"))
    elif base.cluster_m > 1:
        from flexlab.kernels.config import anchored_options
        cand.append(Variant("no_cluster", "candidate", rep(base, cluster_m=1), "every CTA loads its own K/V"))
        if not base.persistent_ctas:
            cand.append(Variant("persistent_cluster2", "candidate",
                                rep(base, persistent_ctas=num_sms, **anchored_options(base.head_dim, True)),
                                "persistent 2-CTA clusters walking pairs of Q tiles (anchored K release)"))
            cand.append(Variant("persistent_cluster2_free", "candidate", rep(base, persistent_ctas=num_sms),
                                "persistent 2-CTA clusters walking pairs of Q tiles"))
    if base.split_tail:  # the launcher's default for long dense tiles: what it replaced, and the tail kept whole
        cand.append(Variant("cluster_per_pair", "candidate", rep(base, persistent_ctas=0, split_tail=False),
                            "one 2-CTA cluster per pair of Q tiles"))
        cand.append(Variant("whole_tail", "candidate", rep(base, split_tail=False),
                            "static persistent clusters, the last round's pairs whole"))
    elif not has_mask:  # the split tail (`FwdConfig.split_tail`): static persistent dense grids only
        from flexlab.kernels.config import anchored_options
        persistent = dict(persistent_ctas=base.persistent_ctas or num_sms, dynamic_tiles=False,
                          **anchored_options(base.head_dim, True))
        cand.append(Variant("split_tail", "candidate", rep(base, split_tail=True, **persistent),
                            "static persistent CTAs (clusters where the baseline has them), the tail cut into even "
                            "runs of KV blocks"))
        if base.cluster_m == 1 and not has_score:
            cand.append(Variant("split_tail_cluster2", "candidate",
                                rep(base, split_tail=True, cluster_m=2, **persistent),
                                "static persistent 2-CTA clusters, the tail cut into even runs of KV blocks"))
    if base.anchored_release:
        cand.append(Variant("free_release", "candidate", rep(base, anchored_release=False, uniform_stage=False),
                            "K release and P.V wait where ptxas puts them"))
    else:
        cand.append(Variant("anchored_release", "candidate", rep(base, anchored_release=True, uniform_stage=True),
                            "K release tied to the first probability, stage index warp-uniform"))
        cand.append(Variant("uniform_stage", "candidate", rep(base, uniform_stage=True),
                            "the stage index marked warp-uniform at the GEMM descriptors"))

    cand += [Variant("exp2_poly2", "candidate", rep(base, exp2_poly=2), "2 of 8 exponentials on the FMA pipe"),
             Variant("exp2_poly4", "candidate", rep(base, exp2_poly=4), "4 of 8 exponentials on the FMA pipe"),
             Variant("rescale_before_pv", "candidate", rep(base, rescale_before_pv=True),
                     "O rescaled while the QK GEMM runs"),
             Variant("try_wait_first", "candidate", rep(base, try_wait_first=True),
                     "stage waits try once before the sleeping wait loop"),
             Variant("eager_rescale" if base.lazy_rescale else "lazy_rescale", "candidate",
                     rep(base, lazy_rescale=not base.lazy_rescale),
                     "O rescaled every step" if base.lazy_rescale else "O rescaled only when a row's max outgrows "
                     "its reference by 2^8")]
    if has_mask:
        cand.append(Variant("early_block_index", "candidate", rep(base, early_block_index=True),
                            "KV block index read before the K wait"))
    if has_mask:
        cand.append(Variant("mask_early", "candidate", rep(base, mask_early=True, mask_bits=False),
                            "partial blocks: mask_mod into bit masks while the QK GEMM runs"))
    combo = dict(persistent_ctas=num_sms, cluster_m=1, rescale_before_pv=True, early_block_index=has_mask,
                 exp2_poly=2 if row.D == 64 else 0)
    cand.append(Variant("combo", "candidate", rep(base, **combo), "persistent + rescale_before_pv"
                        + (" + early_block_index" if has_mask else "") + (" + exp2_poly2" if row.D == 64 else "")))
    return out + [c for c in cand if c.config.feasibility_error() is None]


# ------------------------------------------------------------------------------------------------ shared helpers
def _emit(kind: str, **fields):
    print(TAG + json.dumps({"kind": kind, **fields}, default=str), flush=True)


def _quiet():
    import warnings
    warnings.filterwarnings("ignore", category=UserWarning)
    try:
        from cutlass.base_dsl.common import DSLOptimizationWarning  # noqa: F401
        warnings.filterwarnings("ignore", category=DSLOptimizationWarning)
    except Exception:  # noqa: BLE001 - only a warning filter
        pass


def _case_and_mods(row, device):
    """The benchmark case and the kernel mods flexlab's cute backend would run for it."""
    from flexlab.backends.cute import _lowered
    from flexlab.bench.cases import build_case
    from flexlab.runtime.compile import KernelMods
    case = build_case(row.variant, row.B, row.H, row.S, device)
    if case.score_mod is None and case.mask_mod is None:
        return case, KernelMods(), None
    return case, _lowered(case.score_mod, case.mask_mod).mods, _lowered(case.score_mod, case.mask_mod)


_MEANS: dict = {}


def _mean_kv_blocks(row, mods) -> float | None:
    """KV blocks per Q tile under the row's block mask (built on the CPU), as the launcher measures it to pick the
    tile scheduler; None without a mask."""
    if mods.mask_mod is None:
        return None
    if row.name not in _MEANS:
        from flexlab.bench.cases import build_case
        from flexlab.mask import create_block_mask
        from flexlab.runtime import launch
        from flexlab.runtime.sparsity import kernel_block_mask
        base = launch.config_for(row.D, True, mods, row.S)
        bm = create_block_mask(build_case(row.variant, 1, 1, row.S, "cpu").mask_mod, None, None, row.S, row.S,
                               device="cpu")
        _MEANS[row.name] = kernel_block_mask(bm, row.S, base.tile_m, base.tile_n, row.S).mean_kv_blocks
    return _MEANS[row.name]


def _launcher_config(row, mods, lowered, num_sms: int):
    """The configuration flexlab runs for the row: `launch.config_for`, reading stored partial-block bits where the
    launcher stores them (`launch._stored_bits`)."""
    from flexlab.runtime import launch
    return launch.config_for(row.D, mods.mask_mod is not None, mods, row.S, num_sms, _mean_kv_blocks(row, mods),
                             mask_bits=lowered is not None and lowered.stored_masks is not None)


def _variant(row, name: str, mods, num_sms: int, lowered) -> Variant:
    base = _launcher_config(row, mods, lowered, num_sms)  # what flexlab runs
    for v in variants_for(row, base, num_sms):
        if v.name == name:
            return v
    raise KeyError(name)


# ------------------------------------------------------------------------------------------------ compile workers
def compile_worker(job_file: str, index: int, count: int):
    """Build this worker's share of the kernels into the disk cache (CPU only)."""
    _quiet()
    import torch
    from flexlab.bench.rows import Row
    from flexlab.runtime import launch
    from flexlab.runtime.compile import forward_kernel, kernel_cache
    jobs = json.load(open(job_file))["compile"][index::count]
    for row_fields, name, num_sms in jobs:
        row = Row(**row_fields)
        label = f"{row.variant} D{row.D} {name}"
        _emit("start", name=label)
        t0 = time.perf_counter()
        try:
            _, mods, lowered = _case_and_mods(row, "cpu")
            v = _variant(row, name, mods, num_sms, lowered)
            key = launch.compile_key(mods, torch.bfloat16, v.config, "sm_90a", mods.mask_mod is not None)
            forward_kernel(key, mods)
            _emit("done", name=label, status="ok", seconds=round(time.perf_counter() - t0, 2),
                  disk_hits=kernel_cache().stats.disk_hits)
        except Exception as e:  # noqa: BLE001 - a variant that does not build is a result, not a stop
            _emit("done", name=label, status="compile_error", seconds=round(time.perf_counter() - t0, 2),
                  message=f"{type(e).__name__}: {e}"[:1500])


# ------------------------------------------------------------------------------------------------ timing child
class RowState:
    """Inputs, mask, density and (lazily) the float64 reference of one row, built once per child."""

    def __init__(self, row, device):
        import torch
        from flexlab.bench.density import mask_density
        from flexlab.mask import create_block_mask
        self.row = row
        self.case, self.mods, self.lowered = _case_and_mods(row, device)
        self.block_mask = (create_block_mask(self.case.mask_mod, None, None, row.S, row.S, device=device)
                           if self.case.mask_mod is not None else None)
        self.density = mask_density(self.block_mask)
        self.flops = row.flops(self.density)
        g = torch.Generator(device=device).manual_seed(0)
        shape = (row.B, row.H, row.S, row.D)
        self.q, self.k, self.v = (torch.randn(shape, generator=g, device=device, dtype=row.torch_dtype)
                                  for _ in range(3))
        self.aux_t = self.lowered.tensors_on(self.q.device) if self.lowered else ()
        self.aux_s = self.lowered.aux_scalars if self.lowered else ()
        self._ref = None
        self.calls: dict = {}  # variant -> prepared kernel call, for the baseline and candidates that passed

    def reference(self):
        if self._ref is None:
            from flexlab.bench import check
            self._ref = check.reference(self.q, self.k, self.v, self.case.score_mod, self.case.mask_mod)
        return self._ref


def direct_call(state: RowState, fn, key, heads_group: int = 0):
    """A no-argument call of the compiled kernel with everything prepared once (kernel time + a bare launch)."""
    import torch
    from flexlab.runtime import launch
    from flexlab.runtime.launch import _to_cute, _workspace_to_cute, scheduler_workspace
    from flexlab.runtime.schedule import heads_per_group
    from flexlab.runtime.sparsity import kernel_block_mask
    q, k, v = state.q, state.k, state.v
    B, H, S, D = q.shape
    cfg = key.config
    sparse = order = None
    if state.block_mask is not None:
        kbm = kernel_block_mask(state.block_mask, S, cfg.tile_m, cfg.tile_n, S)
        sparse, order = kbm.as_args(), kbm.order
        if cfg.mask_bits:  # stored once per mask, as the launcher does (`launch._stored_bits`, `_sparse_args`)
            bits = state.lowered.stored_masks.bits(kbm, kbm.kv_num, kbm.kv_idx, B, H, True, cfg.tile_m, S, S)
            sparse = launch._sparse_args(kbm, bits)
    out = torch.empty_like(q)
    lse = torch.empty((B, H, S), dtype=torch.float32, device=q.device)
    group = heads_group or heads_per_group(S, D, 2, 1, B * H, state.block_mask is not None)
    space = scheduler_workspace(cfg, q.device)
    args = (q, k, v, out, lse, D ** -0.5, 1, group, sparse, order, space, state.aux_t, state.aux_s)
    if key.tvm_ffi:
        return (lambda: fn(*args)), out
    import cuda.bindings.driver as cuda
    conv = (*(_to_cute(t) for t in args[:5]), *args[5:8],
            tuple(_to_cute(t) for t in sparse) if sparse is not None else None,
            _to_cute(order) if order is not None else None, _workspace_to_cute(space),
            tuple(_to_cute(t) for t in state.aux_t), state.aux_s,
            cuda.CUstream(torch.cuda.current_stream().cuda_stream))
    return (lambda: fn(*conv)), out


def _bench(fn, warmup_ms: float, rep_ms: float) -> float:
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def _tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def _is_cuda_fatal(err) -> bool:
    text = (err if isinstance(err, str) else f"{type(err).__name__}: {err}").lower()
    return any(s in text for s in ("illegal", "cuda error", "cudaerror", "launch failure", "misaligned",
                                   "unspecified launch", "device-side"))


def run_variant(state: RowState, v: Variant, args) -> dict:
    import torch
    from flexlab.bench import check
    from flexlab.runtime import launch
    from flexlab.runtime.compile import kernel_cache
    rec: dict = {"role": v.kind, "config": repr(v.config), "heads_group": v.heads_group}
    sparse = state.block_mask is not None
    hits = kernel_cache().stats.disk_hits
    t0 = time.perf_counter()
    fn, key = launch._compiled(state.mods, state.q.dtype, v.config, "sm_90a", sparse, True)  # writes the LSE
    rec["load_s"] = round(time.perf_counter() - t0, 2)
    _emit("loaded", name=f"{state.row.name} | {v.name}")  # from here on the watchdog allows --run-timeout
    rec["compiled_here"] = kernel_cache().stats.disk_hits == hits and rec["load_s"] > 1.0
    call, out = direct_call(state, fn, key, v.heads_group)
    call()
    torch.cuda.synchronize()
    if v.kind != "ablation":
        verdict = check.compare(state.reference(), out, None, state.q.dtype)
        err = verdict["rel_l2"]["out"]
        finite = bool(torch.isfinite(out).all())
        rec["rel_l2"] = err
        if not finite or not err < REL_L2_MAX:
            rec.update(status="wrong", why="non-finite output" if not finite else f"rel-L2 {err:.2e} >= {REL_L2_MAX}")
            return rec
    ms = _bench(call, args.warmup_ms, args.rep_ms)
    rec.update(status="ok", ms=ms, tflops=_tflops(state.flops, ms))
    if v.kind != "ablation":
        state.calls[v.name] = call
    if v.kind == "baseline":
        rec.update(baseline_extras(state, call, args))
    return rec


def baseline_extras(state: RowState, call, args) -> dict:
    """Where the baseline's wall time goes: public API and runtime wrapper vs the bare kernel, and host time."""
    import torch
    import flexlab
    from flexlab.bench.timing import kernel_profile_cuda
    from flexlab.runtime import launch
    s = state

    def api():
        with torch.no_grad():
            return flexlab.flex_attention(s.q, s.k, s.v, s.case.score_mod, s.block_mask, backend="cute")

    def runtime():
        return launch.forward(s.q, s.k, s.v, s.mods, s.aux_t, s.aux_s, s.block_mask)

    extras = {}
    api()
    runtime()
    torch.cuda.synchronize()
    extras["api_ms"] = _bench(api, args.warmup_ms, args.rep_ms)
    extras["runtime_ms"] = _bench(runtime, args.warmup_ms, args.rep_ms)
    extras["api_tflops"] = _tflops(s.flops, extras["api_ms"])
    kernel_ms, kernels = kernel_profile_cuda(call, 10)
    extras["profiler_kernel_ms"] = kernel_ms
    extras["kernels"] = [[n[:80], round(ms, 4)] for n, ms in kernels]
    samples = []
    for i in range(200):
        t0 = time.perf_counter()
        api()
        samples.append(time.perf_counter() - t0)
        if i % 20 == 19:
            torch.cuda.synchronize()
    extras["api_host_us"] = statistics.median(samples) * 1e6
    return extras


def interleaved_times(state: RowState, rounds: int, with_fa4: bool) -> dict:
    """The row's baseline and passing candidates (and, `with_fa4`, FA4's own forward on the same inputs) timed again
    in turns (`bench.timing.measure_interleaved`: `rounds` rounds in a rotated order, median of the rounds). Timed one
    after another, the same kernel read 0.97-1.08x of itself within a row (the clock drifts at the power cap), which
    is more than most candidates change. Returns {name: {kernel_ms, wall_ms, kernel_rounds}}."""
    import torch
    from flexlab.bench.timing import measure_interleaved
    fns = dict(state.calls)
    if with_fa4:
        from flexlab.bench.peers import Unavailable, prepare_fa4
        try:
            fns["fa4"] = prepare_fa4(state.case, state.q, state.k, state.v, state.block_mask, grad=False).call
        except Unavailable:
            pass
    times = measure_interleaved(fns, torch.device("cuda"), warmup_ms=25, rep_ms=60 * rounds, rounds=rounds,
                                profile_calls=3 * rounds)
    return {n: {"kernel_ms": t.kernel_ms, "wall_ms": t.wall_ms, "kernel_rounds": t.kernel_rounds}
            for n, t in times.items()}


def _flush_row(state, args):
    """After a row's last variant: its interleaved times, when there is more than one thing to compare."""
    if state is None or args.rounds <= 1 or len(state.calls) + bool(args.fa4) < 2 or "baseline" not in state.calls:
        return
    try:
        _emit("interleaved", row=state.row.name, times=interleaved_times(state, args.rounds, args.fa4))
    except Exception as e:  # noqa: BLE001 - the one-by-one times stand
        _emit("interleaved", row=state.row.name, error=f"{type(e).__name__}: {e}"[:500])
        if _is_cuda_fatal(e):
            sys.exit(3)


def fake_child(jobs: list):
    """--selftest: the parent's bookkeeping without a GPU. One variant hangs, one crashes the process, one reports a
    fatal CUDA error; every other one "runs" in a millisecond."""
    from flexlab.bench.rows import Row
    rows_seen = set()
    for row_fields, name, _ in jobs:
        row = Row(**row_fields)
        job = f"{row.name} | {name}"
        _emit("start", name=job)
        if row.name not in rows_seen:
            rows_seen.add(row.name)
            _emit("row", row=row.name, density=0.5, flops=row.flops(0.5), setup_s=0.0)
        _emit("loaded", name=job)
        if name == "-overlap":
            time.sleep(3600)
        if name == "persistent":
            os._exit(7)
        if name == "stages3":
            _emit("done", name=job, row=row.name, variant=name, status="error",
                  message="RuntimeError: CUDA error: an illegal memory access was encountered")
            sys.exit(3)
        ms = 1.0 + (sum(map(ord, name)) % 7) / 10
        _emit("done", name=job, row=row.name, variant=name, role="ablation" if name.startswith("-") else
              "baseline" if name == "baseline" else "candidate", status="ok", ms=ms,
              tflops=row.flops(0.5) / (ms * 1e-3) / 1e12, **({"api_tflops": 1.0, "api_host_us": 20.0}
                                                             if name == "baseline" else {}))
        if name == "combo":  # the last variant of a row: its interleaved times, FA4's among them
            _emit("interleaved", row=row.name, times={n: {"kernel_ms": k, "wall_ms": k, "kernel_rounds": [k]}
                                                      for n, k in (("baseline", 1.0), ("combo", 0.8), ("fa4", 0.9))})


def child(job_file: str, args):
    _quiet()
    jobs = json.load(open(job_file))["timing"]
    if args.selftest:
        fake_child(jobs)
        return
    import torch
    from flexlab.bench.rows import Row
    _emit("info", device=torch.cuda.get_device_name(), torch=torch.__version__)
    state = None
    for row_fields, name, num_sms in jobs:
        row = Row(**row_fields)
        job = f"{row.name} | {name}"
        _emit("start", name=job)
        try:
            if state is None or state.row != row:
                _flush_row(state, args)
                state = None
                torch.cuda.empty_cache()
                t0 = time.perf_counter()
                state = RowState(row, torch.device("cuda"))
                state.reference()  # float64, before any kernel of the row runs (and outside the run timeout)
                _emit("row", row=row.name, density=state.density, flops=state.flops,
                      setup_s=round(time.perf_counter() - t0, 2))
            rec = run_variant(state, _variant(row, name, state.mods, num_sms, state.lowered), args)
        except Exception as e:  # noqa: BLE001 - report, and leave if the CUDA context is gone
            fatal = _is_cuda_fatal(e)
            _emit("done", name=job, row=row.name, variant=name, status="error",
                  message=f"{type(e).__name__}: {e}"[:1500], traceback=traceback.format_exc()[-2500:])
            if fatal:
                sys.exit(3)
            continue
        _emit("done", name=job, row=row.name, variant=name, **rec)
    _flush_row(state, args)


# ------------------------------------------------------------------------------------------------ parent side
def _reader(stream, q):
    for line in iter(stream.readline, ""):
        q.put(line)
    q.put(None)


_CHILDREN: list[subprocess.Popen] = []


def _spawn(argv: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    _CHILDREN.append(proc)
    return proc


def _kill_all():
    """Every child this run started that is still alive (they run in their own sessions)."""
    for proc in _CHILDREN:
        if proc.poll() is None:
            _kill(proc)


def _kill(proc: subprocess.Popen):
    try:
        os.killpg(proc.pid, 9)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def precompile(jobs: list, workers: int, deadline: float, job_file: str) -> list[dict]:
    """Compile every distinct kernel in parallel worker processes; returns one record per kernel."""
    count = max(1, min(workers, len(jobs)))
    procs = [_spawn(["--compile-worker", job_file, str(i), str(count)]) for i in range(count)]
    lines: queue.Queue = queue.Queue()
    for p in procs:
        threading.Thread(target=_reader, args=(p.stdout, lines), daemon=True).start()
    records, open_ = [], count
    while open_ and time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        except queue.Empty:
            continue
        if line is None:
            open_ -= 1
            continue
        if line.startswith(TAG):
            msg = json.loads(line[len(TAG):])
            if msg.pop("kind") == "done":
                records.append(msg)
                if msg["status"] != "ok":
                    print(f"  compile {msg['name']}: {msg['status']} {msg.get('message', '')[:300]}", flush=True)
    for p in procs:
        if p.poll() is None:
            _kill(p)
    return records


def run_timing(jobs: list, args, deadline: float, job_file: str, on_record) -> None:
    """Run timing jobs in a watched child; after a hang, crash or fatal CUDA error, a fresh child takes the rest."""
    pending = list(jobs)
    while pending and time.monotonic() < deadline:
        with open(job_file, "w") as f:
            json.dump({"timing": pending}, f)
        proc = _spawn(["--child", job_file, "--warmup-ms", str(args.warmup_ms), "--rep-ms", str(args.rep_ms),
                       "--rounds", str(args.rounds)] + (["--selftest"] if args.selftest else [])
                      + (["--fa4"] if args.fa4 else []))
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
        current, tail, finished = None, [], 0

        def drop_variant(variant: str, row: str, status: str):
            """A variant that hung, crashed or broke the CUDA context is not tried again on later rows."""
            nonlocal pending
            for j in [j for j in pending if j[1] == variant]:
                name = _job_name(j)
                r, _, v = name.partition(" | ")
                on_record({"kind": "done", "name": name, "row": r, "variant": v, "status": "dropped",
                           "message": f"not run: this variant {status} on {row}"})
            pending = [j for j in pending if j[1] != variant]

        def fail(status: str, message: str):
            nonlocal pending
            pending = [j for j in pending if _job_name(j) != current["name"]]
            on_record({"kind": "done", **current, "status": status, "message": message,
                       "output_tail": "".join(tail[-30:])})
            drop_variant(current["variant"], current["row"], status)

        started = False  # before its first message the child is importing torch and the DSL: allow more time
        loaded = False  # once a variant's kernel is loaded, running it (first call, check, timing) must be quick
        while True:
            budget_left = deadline - time.monotonic()
            phase = args.run_timeout if loaded else args.case_timeout if started else \
                max(args.case_timeout, STARTUP_TIMEOUT_S)
            limit = min(phase, budget_left)
            try:
                line = lines.get(timeout=max(limit, 0.1))
            except queue.Empty:
                _kill(proc)
                if current is not None and budget_left > limit:
                    where = "after its kernel was loaded: a hang" if loaded else "while building/loading its kernel"
                    fail("timeout", f"no progress for {limit:.0f} s {where}")
                    finished += 1
                break
            if line is None:
                proc.wait()
                if current is not None:
                    fail("crashed", f"child exited with {proc.returncode} during this variant")
                    finished += 1
                break
            if not line.startswith(TAG):
                tail.append(line)
                continue
            started = True
            msg = json.loads(line[len(TAG):])
            if msg["kind"] == "start":
                row, _, variant = msg["name"].partition(" | ")
                current, tail, loaded = {"name": msg["name"], "row": row, "variant": variant}, [], False
            elif msg["kind"] == "loaded":
                loaded = True
            elif msg["kind"] == "done":
                done_name, fatal = msg["name"], msg.get("status") == "error" and _is_cuda_fatal(msg.get("message", ""))
                on_record(msg)
                pending = [j for j in pending if _job_name(j) != done_name]
                if fatal:
                    drop_variant(current["variant"], current["row"], "hit a CUDA error")
                current = None
                finished += 1
            else:
                on_record(msg)
        if not finished and pending and time.monotonic() < deadline:
            print("timing child made no progress:\n" + "".join(tail[-40:]), flush=True)
            return


def _job_name(job) -> str:
    from flexlab.bench.rows import Row
    return f"{Row(**job[0]).name} | {job[1]}"


def _fmt_cell(r: dict | None, base: dict | None, ablation: bool) -> str:
    if r is None:
        return "-"
    st = r.get("status")
    if st != "ok":
        return {"wrong": "WRONG", "timeout": "timeout", "crashed": "crash", "error": "error",
                "skipped": "skip", "dropped": "dropped"}.get(st, st or "?")
    if base is None or base.get("status") != "ok":
        return f"{r['tflops']:.0f}"
    if ablation:
        return f"{100.0 * (base['ms'] - r['ms']) / base['ms']:+.0f}%"
    return f"x{base['ms'] / r['ms']:.2f}"


def _role(variant: str) -> str:
    return "baseline" if variant == "baseline" else "ablation" if variant.startswith("-") else "candidate"


def tables(doc: dict) -> str:
    rows = doc["rows"]
    cands, abls = [], []
    for r in rows:
        for name, rec in r["results"].items():
            role = _role(name)
            lst = cands if role == "candidate" else abls if role == "ablation" else None
            if lst is not None and name not in lst:
                lst.append(name)
    out = []
    for title, names, abl in (("Candidates: speedup of kernel time over the baseline (WRONG = failed the float64 "
                               "check)", cands, False),
                              ("Ablations: share of the baseline's kernel time each stage costs "
                               "(baseline - ablated) / baseline", abls, True)):
        out.append(f"\n{title}")
        head = ["row", "density", "base TF/s", "API TF/s", "host us"] + names
        out.append(" | ".join(head))
        for r in rows:
            base = r["results"].get("baseline")
            cells = [r["name"].replace("fwd ", "").replace(" H16", "").replace(" bf16", ""),
                     f"{r['density']:.3f}" if r.get("density") is not None else "-",
                     f"{base['tflops']:.0f}" if base and base.get("status") == "ok" else
                     (base or {}).get("status", "-"),
                     f"{base['api_tflops']:.0f}" if base and "api_tflops" in base else "-",
                     f"{base['api_host_us']:.0f}" if base and "api_host_us" in base else "-"]
            cells += [_fmt_cell(r["results"].get(n), base, abl) for n in names]
            out.append(" | ".join(cells))
    out.append("\nCandidates over all rows (geometric mean of the speedup where both ran and passed):")
    for name, (geo, n, bad) in summary(doc).items():
        speed = f"x{geo:.3f}" if geo is not None else "n/a"
        out.append(f"  {name:22s} {speed} over {n} rows" + (f"; failed on {bad}" if bad else ""))
    inter = [r for r in rows if r.get("interleaved") and "baseline" in r["interleaved"]]
    if inter:
        names = []
        for r in inter:
            names += [n for n in r["interleaved"] if n != "baseline" and n not in names]
        out.append("\nInterleaved rounds (median kernel time): speedup over the baseline; for fa4, FA4's time over "
                   "the baseline's (above 1: flexlab faster)")
        out.append(" | ".join(["row", "baseline ms"] + names))
        for r in inter:
            t = r["interleaved"]
            base = t["baseline"]["kernel_ms"]
            cells = [r["name"].replace("fwd ", "").replace(" H16", "").replace(" bf16", ""), f"{base:.4f}"]
            cells += [("-" if n not in t else f"{t[n]['kernel_ms'] / base:.3f}" if n == "fa4"
                       else f"x{base / t[n]['kernel_ms']:.3f}") for n in names]
            out.append(" | ".join(cells))
        out.append("Interleaved, over all rows (geometric mean; fa4: its time over the baseline's):")
        for name, (geo, n) in interleaved_summary(doc).items():
            out.append(f"  {name:22s} x{geo:.3f} over {n} rows")
    return "\n".join(out)


def interleaved_summary(doc: dict) -> dict:
    """name -> (geometric mean over rows of baseline time / its time, rows), from the interleaved rounds; for FA4
    the other way round, its time / the baseline's, as in the table (above 1: flexlab faster)."""
    acc: dict = {}
    for r in doc["rows"]:
        t = r.get("interleaved") or {}
        if "baseline" not in t:
            continue
        for name, rec in t.items():
            if name != "baseline":
                logs, n = acc.get(name, (0.0, 0))
                ratio = t["baseline"]["kernel_ms"] / rec["kernel_ms"]
                acc[name] = (logs + math.log(1 / ratio if name == "fa4" else ratio), n + 1)
    return {k: (math.exp(logs / n), n) for k, (logs, n) in acc.items()}


def summary(doc: dict) -> dict:
    """candidate -> (geometric-mean speedup over the baseline, rows counted, rows where it failed)."""
    acc: dict = {}
    for r in doc["rows"]:
        base = r["results"].get("baseline")
        for name, rec in r["results"].items():
            if _role(name) != "candidate":
                continue
            logs, n, bad = acc.get(name, (0.0, 0, 0))
            if rec.get("status") == "ok" and base and base.get("status") == "ok":
                logs, n = logs + math.log(base["ms"] / rec["ms"]), n + 1
            elif rec.get("status") not in ("skipped", "dropped"):
                bad += 1
            acc[name] = (logs, n, bad)
    return {k: (math.exp(logs / n) if n else None, n, bad) for k, (logs, n, bad) in acc.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", nargs="?", default="fwd_perf_sweep.json", help="where to write the JSON")
    ap.add_argument("--budget", type=float, default=480.0, help="overall seconds, compiles included (default 480)")
    ap.add_argument("--rows", default="all", help="'all' (default, core rows first), 'core', or name substrings")
    ap.add_argument("--variants", default="all",
                    help="'all', or comma-separated variant names, e.g. --variants=-pv,persistent (the '=' lets a "
                         "name start with '-'); baseline is always kept")
    ap.add_argument("--case-timeout", type=float, default=90.0,
                    help="seconds to set up a row and build/load one variant's kernel (default 90)")
    ap.add_argument("--run-timeout", type=float, default=20.0,
                    help="seconds one loaded variant may take to run, check and time; past it, a hang (default 20)")
    ap.add_argument("--compile-share", type=float, default=0.4,
                    help="at most this fraction of the budget for the parallel compile phase (default 0.4)")
    ap.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1))
    ap.add_argument("--num-sms", type=int, default=0, help="persistent CTA count (default: the GPU's SM count)")
    ap.add_argument("--warmup-ms", type=float, default=25.0)
    ap.add_argument("--rep-ms", type=float, default=100.0)
    ap.add_argument("--rounds", type=int, default=5,
                    help="after a row's variants, time its baseline and passing candidates again in this many rotated "
                         "rounds (1: off); the candidate table then reads these times")
    ap.add_argument("--fa4", action="store_true", help="time FA4's forward in the same rounds, as a reference")
    ap.add_argument("--selftest", action="store_true",
                    help="exercise the watchdog and the report on the CPU with a fake timing child")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--compile-worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.compile_worker:
        compile_worker(args.compile_worker[0], int(args.compile_worker[1]), int(args.compile_worker[2]))
        return 0
    if args.child:
        child(args.child, args)
        return 0

    start = time.monotonic()
    deadline = start + args.budget
    import torch
    from flexlab.bench.report import environment
    from flexlab.bench.rows import Row
    from flexlab.kernels.config import ABLATIONS
    from flexlab.runtime.compile import tvm_ffi_available
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type != "cuda" and not args.selftest:
        print("needs a CUDA GPU (Hopper); --selftest checks the harness without one", flush=True)
        return 2
    num_sms = args.num_sms or (torch.cuda.get_device_properties(0).multi_processor_count
                               if torch.cuda.is_available() else 132)
    rows = sweep_rows("fwd causal B4 S4k H16 D128,fwd dense B4 S4k H16 D128" if args.selftest else args.rows)
    timing_jobs, compile_jobs, families = [], [], set()
    chosen = None if args.variants == "all" else {"baseline", *(v.strip() for v in args.variants.split(","))}
    for row in rows:
        row_fields = dataclasses.asdict(row)
        for v in _variant_names(row, num_sms, args.selftest):
            if chosen is not None and v not in chosen:
                continue
            timing_jobs.append((row_fields, v, num_sms))
            fam = (row.variant, row.D, v)  # the compile key does not depend on B or S
            if fam not in families:
                families.add(fam)
                compile_jobs.append((row_fields, v, num_sms))
    # (the output's file name only: the JSON is committed, the directory it was written to is the machine's)
    doc = {"environment": environment(device),
           "settings": {**vars(args), "out": os.path.basename(args.out), "num_sms": num_sms},
           "tvm_ffi": tvm_ffi_available(), "ablations": ABLATIONS, "compile": [], "rows": []}
    if not tvm_ffi_available():
        print("warning: apache-tvm-ffi missing: kernels cannot be shared through the disk cache, so every variant "
              "compiles inside the timing child (slow); source .deps/activate.sh first", flush=True)
    print(f"{len(rows)} rows, {len(timing_jobs)} timed variants, {len(compile_jobs)} kernels to build, "
          f"{num_sms} SMs, budget {args.budget:.0f} s", flush=True)

    tmp = tempfile.mkdtemp(prefix="fwd_sweep_")
    job_file = os.path.join(tmp, "jobs.json")
    _usable_cache_dir(tmp)
    with open(job_file, "w") as f:
        json.dump({"compile": compile_jobs}, f)
    t0 = time.monotonic()
    if tvm_ffi_available() and not args.selftest:
        doc["compile"] = precompile(compile_jobs, args.workers, min(deadline, start + args.compile_share * args.budget),
                                    job_file)
    ok = sum(r["status"] == "ok" for r in doc["compile"])
    print(f"compile phase: {ok}/{len(compile_jobs)} kernels built in {time.monotonic() - t0:.0f} s", flush=True)

    by_row = {r.name: {"name": r.name, **dataclasses.asdict(r), "density": None, "flops": None, "results": {}}
              for r in rows}
    doc["rows"] = list(by_row.values())
    jobs_of_row = {r.name: [v for fields, v, _ in timing_jobs if Row(**fields).name == r.name] for r in rows}
    remaining = {name: len(v) for name, v in jobs_of_row.items()}

    def on_record(msg: dict):
        kind = msg.pop("kind", None)
        if kind == "row":
            by_row[msg["row"]].update(density=msg["density"], flops=msg["flops"], setup_s=msg["setup_s"])
        elif kind == "info":
            doc["environment"].update({f"child_{k}": v for k, v in msg.items()})
        elif kind == "interleaved":
            by_row[msg["row"]]["interleaved"] = msg.get("times") or {"error": msg.get("error")}
            print(f"  {msg['row']} | interleaved: " + (", ".join(
                f"{n} {t['kernel_ms']:.4f} ms" for n, t in msg["times"].items()) if msg.get("times")
                else msg.get("error", "")), flush=True)
            _write(doc, args.out)
        elif kind == "done":
            row, variant = msg.pop("row"), msg.pop("variant")
            msg.pop("name", None)
            by_row[row]["results"][variant] = msg
            speed = f"{msg['tflops']:.0f} TFLOP/s {msg['ms']:.4f} ms" if msg.get("status") == "ok" else \
                (msg.get("why") or msg.get("message") or "")[:200]
            print(f"  {row} | {variant}: {msg.get('status', '?').upper()} {speed}", flush=True)
            remaining[row] -= 1
            if remaining[row] == 0:
                _write(doc, args.out)

    try:
        run_timing(timing_jobs, args, deadline, job_file, on_record)
    finally:
        _kill_all()
    for r in doc["rows"]:
        for v in jobs_of_row[r["name"]]:
            r["results"].setdefault(v, {"status": "skipped", "message": "not run: overall budget spent"})
    doc["wall_s"] = round(time.monotonic() - start, 1)
    doc["candidate_summary"] = {k: {"geomean_speedup": g, "rows": n, "failed_rows": b}
                                for k, (g, n, b) in summary(doc).items()}
    doc["interleaved_summary"] = {k: {"geomean_speedup": g, "rows": n} for k, (g, n) in interleaved_summary(doc).items()}
    _write(doc, args.out)
    print(tables(doc), flush=True)
    counts: dict = {}
    for r in doc["rows"]:
        for rec in r["results"].values():
            counts[rec.get("status")] = counts.get(rec.get("status"), 0) + 1
    print(f"\nwrote {args.out}: {counts}, {doc['wall_s']} s", flush=True)
    return 0


def _variant_names(row, num_sms: int, selftest: bool = False) -> list[str]:
    """Variant names of a row, from the configuration the launcher picks for it (mods built on the CPU; with
    `selftest`, from the row's kind alone)."""
    if selftest:
        from flexlab.kernels.config import default_config
        has_score, has_mask = row_mods_kind(row.variant)
        return [v.name for v in variants_for(row, default_config(row.D, has_mask, has_score), num_sms)]
    _, mods, lowered = _case_and_mods(row, "cpu")
    return [v.name for v in variants_for(row, _launcher_config(row, mods, lowered, num_sms), num_sms)]


def _usable_cache_dir(fallback_root: str):
    """Workers hand kernels to the timing child through the disk cache: make sure children get a writable one."""
    from flexlab.runtime.compile import cache_dir
    try:
        d = cache_dir()
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=d):
            pass
    except OSError:
        os.environ["FLEXLAB_CACHE_DIR"] = os.path.join(fallback_root, "cache")
        print(f"kernel cache not writable; using {os.environ['FLEXLAB_CACHE_DIR']}", flush=True)


def _write(doc: dict, path: str):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
