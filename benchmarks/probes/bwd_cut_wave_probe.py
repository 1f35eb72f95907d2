"""H200 probe of the backward's cut last wave (`bwd_config.split_parts`; not a test): the backward per call with the
last wave whole, as the launcher cuts it, and cut into a fixed number of parts, in turns.

    python benchmarks/probes/bwd_cut_wave_probe.py OUT.json [--rounds 15]

Each sample times 8 backward calls with CUDA events (pre- and postprocess included, so the whole tiles' kernel, the
parts' kernel and the launches between them are all counted); the variants take turns in a rotated order, and the
median over rounds is reported with its speed-up over the whole last wave. Plans are rebuilt at each switch (they
are cached per call signature, not per cut).
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

ROWS = [("d128-B4-S4k", 4, 4096, 128), ("d128-B1-S16k", 1, 16384, 128), ("d64-B1-S16k", 1, 16384, 64),
        ("d128-B8-S2k", 8, 2048, 128), ("d128-B2-S4k", 2, 4096, 128)]
CALLS = 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    from flexlab.autograd import differentiable_attention
    from flexlab.kernels import bwd_config, bwd_launch
    from flexlab.testing import random_qkv
    from option_probe import ms_per_call  # (this directory: the script's own)

    model = bwd_config.split_parts
    variants = {"whole": lambda *a: 1, "model": model, "p3": lambda *a: 3, "p5": lambda *a: 5}
    names = list(variants)
    results = {}
    try:
        for row, B, S, D in ROWS:
            q, k, v = random_qkv(B, 16, S, S, D, torch.bfloat16, "cuda", requires_grad=True)
            dout = torch.randn_like(q)
            out = differentiable_attention(q, k, v, None, None)
            tiles = B * 16 * -(-S // 128)
            steps = -(-S // bwd_launch._config(D, False, False, None).tile_m)
            times = {n: [] for n in names}
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    bwd_config.split_parts = variants[name]
                    bwd_launch._PLANS.clear()
                    # (the untimed first call builds the plan; compiles once)
                    times[name].append(ms_per_call(lambda o=out, d=dout: o.backward(d, retain_graph=True), CALLS))
            median = {n: statistics.median(t) for n, t in times.items()}
            speedup = {n: median["whole"] / m for n, m in median.items()}
            results[row] = {"tiles": tiles, "steps": steps, "model_parts": model(tiles, 132, steps),
                            "median_ms": median, "speedup_vs_whole": speedup, "rounds_ms": times}
            print(row, f"tiles {tiles} steps {steps} model parts {model(tiles, 132, steps)}",
                  " ".join(f"{n}={m:.3f}({median['whole'] / m:.3f})" for n, m in median.items()), flush=True)
            del q, k, v, dout, out
            torch.cuda.empty_cache()
    finally:
        bwd_config.split_parts = model
        with open(args.out, "w") as f:
            json.dump({"calls_per_sample": CALLS, "rounds": args.rounds, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
