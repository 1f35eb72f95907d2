"""H200 probe of the backward: TFLOP/s of the three backward kernels, the cost of deterministic mode, and peers.

Usage: python benchmarks/probes/bwd_perf_probe.py OUT.json   (not a test; run on the GPU machine)

Times only the backward (forward outputs, LSE and dO are prepared once): flexlab's ops with and without
deterministic=True, and torch's compiled flex_attention backward on the same inputs for reference. FLOPs count the
five backward GEMMs, 2.5x the forward's (4 * B * H * S^2 * D * density for the forward).
"""
from __future__ import annotations

import json
import sys

import torch


def tflops(ms, B, H, S, D, density=1.0):
    return 2.5 * 4 * B * H * S * S * D * density / (ms * 1e-3) / 1e12


def _bench(fn):
    from triton.testing import do_bench
    fn()
    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def main(path):
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    from flexlab import _ops, create_block_mask
    from flexlab.autograd import differentiable_attention  # noqa: F401  (registers the autograd formula)

    rows = []
    shapes = [(8, 16, 1024, 128), (4, 16, 4096, 128), (1, 16, 16384, 128), (4, 16, 4096, 64)]
    torch_bwd = torch.compile(lambda q, k, v, bm: torch_flex(q, k, v, block_mask=bm))
    for B, H, S, D in shapes:
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        dout = torch.randn_like(q)
        for kind in ("dense", "causal"):
            bm, masks, sizes, density = None, [], [], 1.0
            key = _ops.register_mods(None, None)
            if kind == "causal":
                def causal(b, h, qi, kv):
                    return qi >= kv
                bm = create_block_mask(causal, 1, 1, S, S, device="cuda")
                key = _ops.register_mods(None, causal)
                masks = [bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                         bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices]
                sizes = [int(x) for x in bm.BLOCK_SIZE]
                density = (S + 1) / (2 * S)
            scale = D ** -0.5
            out, lse = _ops.flex_attention_fwd(q, k, v, [], masks, sizes, scale, key, [], False)
            row = dict(kind=kind, B=B, H=H, S=S, D=D)
            for det in (False, True):
                fn = lambda det=det: _ops.flex_attention_bwd(dout, q, k, v, out, lse, None, [], masks, sizes,  # noqa
                                                             scale, key, [], det)
                ms = _bench(fn)
                row["deterministic_ms" if det else "ms"] = ms
                row["deterministic_tflops" if det else "tflops"] = tflops(ms, B, H, S, D, density)
            qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
            o = torch_bwd(qg, kg, vg, bm)
            row["torch_flex_ms"] = _bench(lambda: torch.autograd.grad(o, (qg, kg, vg), dout, retain_graph=True))
            row["deterministic_cost"] = row["deterministic_ms"] / row["ms"] - 1
            rows.append(row)
            print(f"{kind:6s} B{B} H{H} S{S} D{D}: {row['ms']:.3f} ms {row['tflops']:.0f} TFLOP/s | deterministic "
                  f"+{100 * row['deterministic_cost']:.0f}% | torch flex bwd {row['torch_flex_ms']:.3f} ms", flush=True)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bwd_probe.json")
