"""Time every gallery variant's forward pass on flexlab's kernel and on torch's FlexAttention, checked vs float64.

    python gallery/_bench.py --json benchmarks/results/gallery_h200_<date>.json.gz [--only NAME] [--time-budget 300]
    python gallery/_bench.py --device cpu --quick        # checks the script itself on a CPU

The main benchmark (`python -m flexlab.bench`) races all peers on a handful of variants; this one covers the whole
gallery with the two backends that can run any mod, and writes the same JSON schema, so `gallery/_render.py`
puts the numbers on each variant's card. Each row's error is measured against a float64 reference on the first
and last (batch, head) pair before it is timed; a row that fails the check is reported, not timed.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent

BACKENDS = {"flexlab": "cute", "flex-triton": "torch"}


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def bench_variant(variant, B: int, H: int, S: int, D: int, dtype: str, device: torch.device,
                  warmup_ms: float, rep_ms: float) -> dict | None:
    """One benchmark row (the bench JSON schema) for `variant` at (B, H, S, S, D), or None if S is not allowed."""
    import flexlab
    from flexlab.bench.check import compare, reference
    from flexlab.bench.density import mask_density
    from flexlab.bench.rows import attention_flops
    from flexlab.bench.timing import measure
    from flexlab.testing import random_qkv

    if not variant.accepts_lengths(S, S):
        return None
    label, dtype = dtype, DTYPES[dtype]
    length = f"{S // 1024}k" if S % 1024 == 0 else str(S)
    mods = variant.build(B, H, S, S, device=device)
    q, k, v = random_qkv(B, H, S, S, D, dtype=dtype, device=device)
    block_mask = flexlab.create_block_mask(mods.mask_mod, B, H, S, S, device=device) if mods.mask_mod else None
    density = mask_density(block_mask)
    flops = attention_flops(B, H, S, S, D, density)
    t0 = time.perf_counter()
    ref = reference(q, k, v, mods.score_mod, mods.mask_mod)
    row = {"name": f"fwd gallery:{variant.name} B{B} S{length} H{H} D{D} {label}",
           "variant": variant.name, "B": B, "S": S, "D": D, "H": H, "dtype": label,
           "mode": "fwd", "density": density, "flops": flops, "mods": f"gallery:{variant.name}",
           "reference_s": round(time.perf_counter() - t0, 3), "results": {}}
    for name, backend in BACKENDS.items():

        def call():
            return flexlab.flex_attention(q, k, v, score_mod=mods.score_mod, block_mask=block_mask,
                                          backend=backend)

        try:
            with torch.no_grad():
                t0 = time.perf_counter()
                out = call()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                first = time.perf_counter() - t0
                check = compare(ref, out, None, dtype)
                result = {"status": "ok" if check["passed"] else "failed", "first_call_s": round(first, 3),
                          "rel_l2": check["rel_l2"]}
                if not check["passed"]:
                    result["error"] = check.get("why", "check failed")
                else:
                    timing = measure(call, device, warmup_ms, rep_ms)
                    result["wall_ms"] = timing.wall_ms
                    result["tflops"] = flops / (timing.wall_ms * 1e9)
                    if timing.kernel_ms is not None:
                        result["kernel_ms"] = timing.kernel_ms
        except Exception as err:  # noqa: BLE001 - one backend's failure is a result, not the end of the run
            result = {"status": "n/a", "error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
        row["results"][name] = result
    return row


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None, help="write results here (rewritten after each row)")
    parser.add_argument("--only", default=None, help="comma-separated variant names")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("-B", type=int, default=4)
    parser.add_argument("-H", type=int, default=16)
    parser.add_argument("-S", type=int, default=4096)
    parser.add_argument("-D", type=int, default=128)
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--warmup-ms", type=float, default=25)
    parser.add_argument("--rep-ms", type=float, default=100)
    parser.add_argument("--time-budget", type=float, default=None, help="seconds after which no new row starts")
    parser.add_argument("--quick", action="store_true", help="B1 H2 S256 D64 and short timing: checks the script")
    args = parser.parse_args(argv)
    from flexlab.bench.report import apply_roof, document, environment, write_json
    from flexlab.bench.roof import matmul_ceiling
    from flexlab.gallery import load_gallery

    if args.quick:
        args.B, args.H, args.S, args.D, args.warmup_ms, args.rep_ms = 1, 2, 256, 64, 1, 5
    device = torch.device(args.device)
    gallery = load_gallery()
    names = list(gallery) if not args.only else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in gallery]
    if unknown:
        parser.error(f"--only: unknown variant(s) {unknown}; known: {', '.join(gallery)}")
    settings = {"warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms, "backends": list(BACKENDS),
                "quick": args.quick, "script": "gallery/_bench.py"}
    rows: list[dict] = []
    env = environment(device)
    doc = document(env, settings, rows, matmul_ceiling(env, device))
    start = time.perf_counter()
    for name in names:
        if args.time_budget is not None and time.perf_counter() - start > args.time_budget:
            print(f"time budget spent; skipping {name} and the rest", flush=True)
            break
        row = bench_variant(gallery[name], args.B, args.H, args.S, args.D, args.dtype, device,
                            args.warmup_ms, args.rep_ms)
        if row is None:
            print(f"{name}: S={args.S} breaks its rule ({gallery[name].lengths_rule}); skipped", flush=True)
            continue
        apply_roof(row, doc["matmul_ceiling_tflops"])
        rows.append(row)
        cells = [f"{b} {r['wall_ms']:.3f} ms" if "wall_ms" in r else f"{b} {r['status']}"
                 for b, r in row["results"].items()]
        print(f"{row['name']}: " + " | ".join(cells), flush=True)
        if args.json is not None:
            write_json(doc, args.json)
    return doc


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing flexlab
    main()
