"""Where a training step leaves the GPU idle: flexlab's forward + backward against FA4's on the same inputs (not a
test; GPU machine only).

    python tests/kernels/step_gaps_probe.py OUT.json [variant B S D]     (default: dense 4 4096 128)

Each backend runs warm-up steps, then `STEPS` steps back to back under torch.profiler. Per step it reports the GPU
time (the kernels' durations summed), the span from the first kernel's start to the last one's end, and every gap
between consecutive kernels longer than `GAP_US`, with the kernels on either side and the host ops that were running
during it. A step whose span exceeds its GPU time by much is waiting for the host (or for a sync), which the benchmark
sees as wall-clock time above kernel time.
"""
from __future__ import annotations

import json
import statistics
import sys

import torch

STEPS = 5
WARMUP = 3
GAP_US = 5.0


def _steps(variant: str, B: int, S: int, D: int, H: int = 16):
    """{backend: zero-argument training step} on shared inputs."""
    import flexlab
    from flexlab.bench.cases import build_case
    from flexlab.bench.peers import Unavailable, prepare_fa4

    case = build_case(variant, B, H, S, "cuda")
    bm = flexlab.create_block_mask(case.mask_mod, None, None, S, S, device="cuda") if case.mask_mod else None
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)

    def flexlab_step():
        flexlab.flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm, backend="cute").backward(dout)

    steps = {"flexlab": flexlab_step}
    try:
        prep = prepare_fa4(case, q, k, v, bm, True)
        fa4_dout = prep.from_bhsd(dout)
        steps["fa4"] = lambda: prep.call().backward(fa4_dout)
    except Unavailable as e:
        print("fa4:", e)
    return steps


def _gpu_events(prof) -> tuple[list, list]:
    """(kernels and memsets as (start_us, end_us, name), host ops as (start_us, end_us, name)), by start time."""
    gpu, host = [], []
    for e in prof.events():
        kind = str(getattr(e, "device_type", ""))
        start, end = e.time_range.start, e.time_range.end
        if "CUDA" in kind:
            gpu.append((start, end, e.name))
        elif e.name.startswith(("aten::", "flexlab", "cuda", "cudaLaunch", "cuLaunch")) or "::" in e.name:
            host.append((start, end, e.name))
    return sorted(gpu), sorted(host)


def _analyse(gpu: list, host: list, steps: int) -> dict:
    per_step = len(gpu) // steps
    out = {"kernels_per_step": per_step, "steps": []}
    for s in range(steps):
        ks = gpu[s * per_step:(s + 1) * per_step]
        busy = sum(e - b for b, e, _ in ks)
        span = ks[-1][1] - ks[0][0]
        gaps = []
        for (b0, e0, n0), (b1, e1, n1) in zip(ks, ks[1:]):
            if b1 - e0 > GAP_US:
                during = sorted({n for hb, he, n in host if hb < b1 and he > e0})[:12]
                gaps.append({"us": round(b1 - e0, 1), "after": n0[:80], "before": n1[:80], "host_ops": during})
        out["steps"].append({"gpu_us": round(busy, 1), "span_us": round(span, 1), "idle_us": round(span - busy, 1),
                             "gaps": gaps})
    idle = [st["idle_us"] for st in out["steps"]]
    out["median_idle_us"] = statistics.median(idle)
    out["median_gpu_us"] = statistics.median(st["gpu_us"] for st in out["steps"])
    return out


def main(path: str, variant: str = "dense", B: int = 4, S: int = 4096, D: int = 128) -> None:
    from torch.profiler import ProfilerActivity, profile
    result = {"shape": {"variant": variant, "B": B, "S": S, "D": D}, "backends": {}}
    for name, step in _steps(variant, B, S, D).items():
        for _ in range(WARMUP):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(STEPS):
                step()
            torch.cuda.synchronize()
        gpu, host = _gpu_events(prof)
        result["backends"][name] = _analyse(gpu, host, STEPS)
        r = result["backends"][name]
        print(f"{name}: {r['kernels_per_step']} GPU ops per step, GPU {r['median_gpu_us']:.0f} us, "
              f"idle inside the step {r['median_idle_us']:.0f} us", flush=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], *(a[1:2] or ["dense"]), *(int(x) for x in a[2:5]))
