"""Where a training step leaves the GPU idle: flexlab's forward + backward against its peers' on the same inputs
(not a test; GPU machine only).

    python benchmarks/probes/step_gaps_probe.py OUT.json [variant B S D]     (default: dense 4 4096 128)

Each backend is prepared and called exactly as the benchmark times it (`flexlab.bench.peers`, `runner._timed_call`:
fresh gradients, L2 flushed before every call). After warm-up, `STEPS` calls run back to back under torch.profiler.
Per call it reports the GPU time (kernels summed, the flush excluded), the span from the end of the flush to the end
of the call's last kernel, and every gap between consecutive kernels longer than `GAP_US`, with the kernels on either
side and the host ops that were running during it, and each kernel's own time (median over the calls). The benchmark's wall-clock time minus kernel time is this idle
time. Host calls that block the CPU on the GPU (synchronisations, cudaMalloc/cudaFree, copies to the host) are
counted per call, and torch's sync debug mode names any torch op that synchronises.
"""
from __future__ import annotations

import json
import statistics
import sys
import warnings

import torch

STEPS = 6
WARMUP = 3
GAP_US = 4.0
BLOCKING = ("ynchronize", "Malloc", "Free", "Memcpy", "EventQuery", "StreamWait")
BACKENDS = ("flexlab", "fa4", "flex-flash")


def _calls(variant: str, B: int, S: int, D: int, H: int = 16):
    """{backend: zero-argument forward+backward call} on shared inputs, as the benchmark times them."""
    import flexlab
    from flexlab.bench import peers, runner
    from flexlab.bench.cases import build_case

    case = build_case(variant, B, H, S, "cuda")
    bm = flexlab.create_block_mask(case.mask_mod, None, None, S, S, device="cuda") if case.mask_mod else None
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    dout = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    calls = {}
    for name in BACKENDS:
        prepare, _ = peers.PEERS[name]
        try:
            prepared = prepare(case, q, k, v, bm, True)
        except Exception as e:  # noqa: BLE001 - a missing peer is reported, not fatal
            print(f"{name}: {e}")
            continue
        calls[name] = runner._timed_call(prepared, True, prepared.from_bhsd(dout))
    return calls


def _events(prof) -> tuple[list, list]:
    """(GPU ops as (start_us, end_us, name), host ops as (start_us, end_us, name)), by start time."""
    gpu, host = [], []
    for e in prof.events():
        kind = str(getattr(e, "device_type", ""))
        item = (e.time_range.start, e.time_range.end, e.name)
        (gpu if "CUDA" in kind else host).append(item)
    return sorted(gpu), sorted(host)


def _analyse(gpu: list, host: list, flush_name: str) -> dict:
    """Split the GPU timeline at the flush kernels (one per call) and measure each call's idle time."""
    starts = [i for i, (_, _, n) in enumerate(gpu) if n == flush_name]
    out = {"calls": []}
    for j, i0 in enumerate(starts):
        i1 = starts[j + 1] if j + 1 < len(starts) else len(gpu)
        flush, ks = gpu[i0], gpu[i0 + 1:i1]
        if not ks:
            continue
        busy = sum(e - b for b, e, _ in ks)
        span = ks[-1][1] - flush[1]
        gaps, prev_end, prev_name = [], flush[1], "L2 flush"
        for b, e, n in ks:
            if b - prev_end > GAP_US:
                during = sorted({hn for hb, he, hn in host if hb < b and he > prev_end})[:14]
                gaps.append({"us": round(b - prev_end, 1), "after": prev_name[:70], "before": n[:70],
                             "host_ops": during})
            prev_end, prev_name = max(prev_end, e), n
        t0 = flush[0]
        t1 = gpu[i1][0] if i1 < len(gpu) else ks[-1][1]
        blocking = [hn for hb, he, hn in host if t0 <= hb < t1 and any(s in hn for s in BLOCKING)]
        out["calls"].append({"gpu_us": round(busy, 1), "span_us": round(span, 1), "idle_us": round(span - busy, 1),
                             "kernels": len(ks), "gaps": gaps, "blocking_host_calls": sorted(set(blocking)),
                             "per_kernel": [(n[:90], round(e - b, 1)) for b, e, n in ks]})
    idle = [c["idle_us"] for c in out["calls"]]
    # each kernel of a step (in launch order) with its median time over the calls that launched the same sequence
    calls = [c["per_kernel"] for c in out["calls"]]
    same = [c for c in calls if calls and [n for n, _ in c] == [n for n, _ in calls[0]]]
    out["kernel_breakdown"] = [(name, statistics.median(c[i][1] for c in same))
                               for i, (name, _) in enumerate(same[0])] if same else []
    out["median_idle_us"] = statistics.median(idle) if idle else None
    out["median_gpu_us"] = statistics.median(c["gpu_us"] for c in out["calls"]) if idle else None
    return out


def main(path: str, variant: str = "dense", B: int = 4, S: int = 4096, D: int = 128) -> None:
    from torch.profiler import ProfilerActivity, profile
    from triton.runtime import driver

    flush_buf = driver.active.get_empty_cache_for_benchmark()
    flush = lambda: driver.active.clear_cache(flush_buf)  # noqa: E731 - what do_bench runs before every call
    result = {"shape": {"variant": variant, "B": B, "S": S, "D": D}, "backends": {}}
    for name, call in _calls(variant, B, S, D).items():
        for _ in range(WARMUP):
            flush()
            call()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                call()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(STEPS):
                flush()
                call()
            torch.cuda.synchronize()
        gpu, host = _events(prof)
        flush_name = gpu[0][2] if gpu else ""  # the flush is the first GPU op of every call
        r = _analyse(gpu, host, flush_name)
        r["sync_warnings"] = sorted({str(w.message)[:200] for w in caught})
        result["backends"][name] = r
        print(f"{name}: GPU {r['median_gpu_us']:.0f} us, idle inside the call {r['median_idle_us']:.0f} us, "
              f"{len(r['sync_warnings'])} sync warnings, blocking host calls "
              f"{r['calls'][0]['blocking_host_calls'] if r['calls'] else []}", flush=True)
        for kernel, us in r["kernel_breakdown"]:
            print(f"    {us:8.1f} us  {kernel[:80]}", flush=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], *(a[1:2] or ["dense"]), *(int(x) for x in a[2:5]))
