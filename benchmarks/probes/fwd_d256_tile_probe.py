"""H200 probe: the dense D=256 forward at one KV tile width, through the public API (not collected by pytest).

    . .deps/activate.sh && python3 benchmarks/probes/fwd_d256_tile_probe.py TILE_N OUT_DIR

Runs flexlab's forward with `default_config` answering (128, TILE_N, 2 stages) for dense D=256, checks one (batch,
head) block against fp32 SDPA (rel-L2) and times the call (median of `triton.testing.do_bench`, wall time of the
public call) at B4·S4k, B1·S16k and B8·S1k, H=16, bf16. Run once per width in separate processes, twice each in
turn, to compare widths (benchmarks/results/fwd_d256_tile_n{64,80}_h200_2026-12-01.json.gz).
"""
import json
import os
import sys

import torch
import triton

import flexlab
from flexlab.kernels.config import FwdConfig
from flexlab.runtime import launch


def main(tile_n: int, out_dir: str) -> None:
    original = launch.default_config

    def patched(head_dim, sparse=False, has_score_mod=False, **kw):
        if head_dim == 256 and not sparse:
            return FwdConfig(head_dim=256, tile_m=128, tile_n=tile_n, num_stages=2)
        return original(head_dim, sparse, has_score_mod, **kw)

    launch.default_config = patched
    launch._config.cache_clear()
    results = {}
    for B, S in ((4, 4096), (1, 16384), (8, 1024)):
        q, k, v = (torch.randn(B, 16, S, 256, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out = flexlab.flex_attention(q, k, v, backend="cute")
        ref = torch.nn.functional.scaled_dot_product_attention(*(t[:1, :2].float() for t in (q, k, v)))
        err = float((out[:1, :2].float() - ref).norm() / ref.norm())
        ms = triton.testing.do_bench(lambda: flexlab.flex_attention(q, k, v, backend="cute"), warmup=50, rep=300,
                                     return_mode="median")
        results[f"B{B}-S{S}"] = dict(ms=ms, tflops=4 * B * 16 * S * S * 256 / ms / 1e9, err=err)
        print(tile_n, B, S, round(ms, 4), round(results[f"B{B}-S{S}"]["tflops"], 1), f"{err:.1e}", flush=True)
    with open(os.path.join(out_dir, f"fwd256_tn{tile_n}.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else os.environ.get("OUT", "."))
