"""Quick H200 probe of the forward kernel: TFLOP/s on a few shapes and host overhead per call.

Usage: python tests/kernels/perf_probe.py OUT.json   (not a test; run on the GPU machine)
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))


def tflops(ms, B, H, S, D, density=1.0):
    return 4 * B * H * S * S * D * density / (ms * 1e-3) / 1e12


def main(path):
    from triton.testing import do_bench

    from flexlab import create_block_mask
    from flexlab.runtime.compile import KernelMods, kernel_cache
    from flexlab.runtime.launch import forward
    from handwritten_mods import causal_mask, causal_mask_torch

    rows = []
    shapes = [(8, 16, 1024, 128), (4, 16, 4096, 128), (1, 16, 16384, 128), (4, 16, 4096, 64), (1, 16, 16384, 64)]
    only = os.environ.get("PROBE_ONLY")
    for B, H, S, D in shapes:
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for kind in ("dense", "causal"):
            if only and only not in kind:
                continue
            if kind == "dense":
                fn = lambda: forward(q, k, v)  # noqa: E731
                density = 1.0
            else:
                bm = create_block_mask(causal_mask_torch, 1, 1, S, S, device="cuda")
                mods = KernelMods(None, causal_mask, "causal")
                fn = lambda: forward(q, k, v, mods, (), (), bm)  # noqa: E731
                density = (S + 1) / (2 * S)
            fn()
            ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
            row = dict(kind=kind, B=B, H=H, S=S, D=D, ms=ms, tflops=tflops(ms, B, H, S, D, density))
            rows.append(row)
            print(f"{kind:7s} B{B} H{H} S{S} D{D}: {ms:.3f} ms  {row['tflops']:.0f} TFLOP/s", flush=True)
    if os.environ.get("PROBE_SWEEP"):
        from flexlab.kernels.config import FwdConfig
        sweep = [((4, 16, 4096, 128), FwdConfig(head_dim=128, num_stages=3)),
                 ((1, 16, 16384, 128), FwdConfig(head_dim=128, num_stages=3)),
                 ((8, 16, 1024, 128), FwdConfig(head_dim=128, num_stages=3)),
                 ((4, 16, 4096, 64), FwdConfig(head_dim=64, tile_m=192, num_stages=3, pingpong=False)),
                 ((4, 16, 4096, 64), FwdConfig(head_dim=64, tile_m=192, num_stages=4))]
        for (B, H, S, D), cfg in sweep:
            q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            try:
                fn = lambda: forward(q, k, v, config=cfg)  # noqa: E731
                fn()
                ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
            except Exception as e:  # noqa: BLE001  (a config that fails to build is a sweep result too)
                print("sweep failed", cfg, repr(e)[:200])
                continue
            row = dict(kind="dense-sweep", B=B, H=H, S=S, D=D, ms=ms, tflops=tflops(ms, B, H, S, D),
                       config=repr(cfg))
            rows.append(row)
            print(f"sweep B{B} S{S} D{D} {cfg.tile_m}x{cfg.tile_n} st{cfg.num_stages} pp{int(cfg.pingpong)}: "
                  f"{row['tflops']:.0f} TFLOP/s")
    # Host overhead: Python time per call on a tiny problem (the launch is asynchronous).
    q, k, v = (torch.randn(1, 1, 128, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for _ in range(50):
        forward(q, k, v)
    torch.cuda.synchronize()
    samples = []
    for _ in range(2000):
        t0 = time.perf_counter()
        forward(q, k, v)
        samples.append(time.perf_counter() - t0)
        if len(samples) % 200 == 0:
            torch.cuda.synchronize()
    host_us = statistics.median(samples) * 1e6
    from flexlab.runtime import launch
    fn, _ = next(iter(launch._FAST.values()))
    out = torch.empty_like(q)
    lse = torch.empty(1, 1, 128, device="cuda")
    raw = []
    for _ in range(2000):
        t0 = time.perf_counter()
        fn(q, k, v, out, lse, 0.1, 1, 1, None, None, (), ())
        raw.append(time.perf_counter() - t0)
    print(f"bare compiled-call overhead: {statistics.median(raw) * 1e6:.1f} us")
    print(f"host overhead per call: {host_us:.1f} us (median of {len(samples)})")
    print("cache", kernel_cache().stats)
    json.dump(dict(rows=rows, host_overhead_us=host_us, cache=vars(kernel_cache().stats)), open(path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
