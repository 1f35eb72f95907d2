"""H200 probe: forward + backward time when captured tensors are learned (not a test; GPU machine only).

    python benchmarks/probes/aux_grad_probe.py OUT.json [B H S D] [--no-triton]

For the gallery's trainable tables (learnable relative bias, T5 buckets, per-head key bias), each with a causal
block mask: flexlab with the table requiring grad, flexlab on the same mods with a table that needs none (what
the table's gradient costs), flexlab in deterministic mode, and torch FlexAttention (Triton, compiled), the one peer
that can differentiate captured tensors. Timed in turns (`flexlab.bench.timing.measure_interleaved`), wall clock
and kernel time; the table gradients of flexlab's two modes and Triton's are compared (relative L2 difference).
"""
from __future__ import annotations

import json
import sys
import time

import torch

VARIANTS = ("learnable_relative_bias", "t5_relative_bias", "per_head_bias")


def bench_fields(row: dict, density: float) -> dict:
    """`row` in the benchmark's result schema as well (`name`, `mods`, per-backend `results` with wall and kernel
    ms and TFLOP/s at the mask's density), which `gallery/_render.py` puts on the variant's card."""
    from flexlab.bench.rows import attention_flops
    flops = attention_flops(row["B"], row["H"], row["S"], row["S"], row["D"], density, "fwd+bwd")
    length = f"{row['S'] // 1024}k" if row["S"] % 1024 == 0 else str(row["S"])
    results = {name: {"status": "ok", "wall_ms": t["wall_ms"], "kernel_ms": t["kernel_ms"],
                      "tflops": flops / (t["wall_ms"] * 1e-3) / 1e12} for name, t in row["timing"].items()}
    results.update({name: {"status": "error", "error": err} for name, err in row["errors"].items()})
    return {"name": f"fwd+bwd {row['variant']} (table learned) + causal B{row['B']} S{length} H{row['H']} D{row['D']} "
                    "bf16",
            "mods": f"gallery:{row['variant']} + gallery:causal", "density": density, "results": results}


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def probe_variant(name: str, B: int, H: int, S: int, D: int, triton: bool) -> dict:
    from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    import flexlab
    from flexlab.bench.timing import measure_interleaved
    from flexlab.gallery import get_variant

    variant = get_variant(name)
    mods = variant.build(B=B, H=H, Q_LEN=S, KV_LEN=S, device="cuda")
    table = mods.tensors[variant.trainable[0]].requires_grad_(True)
    frozen = variant.build(B=B, H=H, Q_LEN=S, KV_LEN=S, device="cuda")  # its own table, no grad
    causal = get_variant("causal").build(B=B, H=H, Q_LEN=S, KV_LEN=S, device="cuda").mask_mod
    bm = flexlab.create_block_mask(causal, None, None, S, S, device="cuda")
    q, k, v, dout = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    leaves = [t.requires_grad_(True) for t in (q, k, v)]

    def step(forward):
        def call():
            for t in leaves + [table]:
                t.grad = None
            forward().backward(dout)
        return call

    calls = {
        "flexlab": step(lambda: flexlab.flex_attention(q, k, v, mods.score_mod, bm, backend="cute")),
        "flexlab-frozen-table": step(lambda: flexlab.flex_attention(q, k, v, frozen.score_mod, bm, backend="cute")),
        "flexlab-deterministic": step(lambda: flexlab.flex_attention(q, k, v, mods.score_mod, bm, backend="cute",
                                                                     deterministic=True)),
    }
    if triton:
        compiled = torch.compile(torch_flex, dynamic=False)
        tbm = torch_block_mask(causal, None, None, S, S, device="cuda")
        calls["flex-triton"] = step(lambda: compiled(q, k, v, score_mod=mods.score_mod, block_mask=tbm))
    row = {"variant": name, "mask": "causal", "B": B, "H": H, "S": S, "D": D, "errors": {}, "table_grad": {}}
    grads = {}
    for backend, call in list(calls.items()):
        try:
            call()
            torch.cuda.synchronize()
        except Exception as e:  # a peer that cannot compile this row is reported, not fatal
            row["errors"][backend] = repr(e)[:400]
            del calls[backend]
            continue
        if backend != "flexlab-frozen-table":
            grads[backend] = table.grad.clone()
    timings = measure_interleaved(calls, torch.device("cuda"), warmup_ms=25, rep_ms=300, rounds=3)
    row["timing"] = {n: {"wall_ms": t.wall_ms, "kernel_ms": t.kernel_ms, "wall_rounds": t.wall_rounds}
                     for n, t in timings.items()}
    for other in ("flexlab-deterministic", "flex-triton"):
        if other in grads:
            row["table_grad"][f"rel_l2_flexlab_vs_{other}"] = _rel(grads["flexlab"], grads[other])
    from flexlab.bench.density import mask_density
    row.update(bench_fields(row, mask_density(bm)))
    return row


def main(argv: list[str]) -> None:
    triton = "--no-triton" not in argv
    args = [a for a in argv if a != "--no-triton"]
    path, shape = args[0], [int(x) for x in args[1:5]] or [4, 16, 4096, 128]
    rows = []
    for name in VARIANTS:
        row = probe_variant(name, *shape, triton)
        rows.append(row)
        print(name, {n: (round(t["wall_ms"], 3), round(t["kernel_ms"], 3)) for n, t in row["timing"].items()},
              row["table_grad"], list(row["errors"]), flush=True)
    with open(path, "w") as f:
        json.dump({"kind": "aux-grad-probe", "rows": rows, "torch": torch.__version__,
                   "environment": {"gpu": torch.cuda.get_device_name(),
                                   "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}}, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__.split("\n\n")[1])
    main(sys.argv[1:])
