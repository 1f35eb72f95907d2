"""Compile report of the backward's speed options, no GPU needed: registers, spills and shared memory of every
candidate configuration (`bwd_config.candidate_bwd_configs`) in every kernel flavour the launcher builds.

    python tests/kernels/bwd_option_report.py [OUT.json] [--jobs 2] [--variants a,b] [--kinds dense,mask]

Flavours: dense; block-sparse with a causal mask_mod; a learnable relative bias (score_mod + its derivative +
captured-tensor gradient atomics) with the causal mask; deterministic dense; deterministic block-sparse. The ptxas
numbers come from the system ptxas on the kernel's PTX, as tests/kernels/test_bwd_compile.py reads them. Not a test
(no test_ prefix): the full matrix takes minutes; test_bwd_options.py compiles a few of its cells in CI.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

KINDS = ("dense", "mask", "bias", "det", "det_mask")


def _mods(kind: str):
    """(generated mods or None, block_sparse, deterministic) of one kernel flavour."""
    import torch

    from flexlab.codegen import generate

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    if kind in ("dense", "det"):
        return None, False, kind == "det"
    if kind in ("mask", "det_mask"):
        return generate(None, causal, fastmath=True), True, kind == "det_mask"
    bias = torch.randn(4, 129, requires_grad=True)

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, torch.clamp(kv_idx - q_idx, -64, 64) + 64]

    if kind == "dense_bias":  # a learnable relative bias without a block mask
        return generate(rel_bias, None, fastmath=True), False, False
    return generate(rel_bias, causal, fastmath=True), True, False


def key_for(cfg, g, block_sparse: bool, deterministic: bool):
    """The launcher's BwdKey for this config and generated module (None: no mods)."""
    from flexlab.kernels.bwd_launch import main_key
    if g is None:
        return main_key(None, (), [], "bfloat16", cfg, block_sparse, deterministic)
    slots = [i for i, rg in enumerate(g.aux_requires_grad) if rg]
    return main_key(g, g.kernel_aux_tensors(), slots, "bfloat16", cfg, block_sparse, deterministic)


def compile_ptx(key, g) -> str:
    """PTX of the main kernel for this key. The DSL names the kept PTX file after the argument types (not the
    configuration) and reads `__ptx__` back from it, so each compile gets its own dump directory: parallel compiles
    in one working directory would read each other's files."""
    from flexlab.kernels.bwd_launch import compile_main
    with tempfile.TemporaryDirectory() as tmp:
        compiled = compile_main(key, g.module() if g is not None else None, options=f" --keep-ptx --dump-dir {tmp}")
        return compiled.__ptx__


def ptxas_report(ptx: str) -> dict:
    from flexlab.runtime.ptxas import assemble
    info, log = assemble(ptx)
    return {"registers": info["registers"], "spill_stores": info["spill_store_bytes"],
            "spill_loads": info["spill_load_bytes"],
            "ptxas_warnings": [line.strip() for line in log.splitlines() if "warning" in line.lower()]}


def compile_cell(job: tuple) -> dict:
    variant, head_dim, kind = job
    from flexlab.kernels.bwd_config import candidate_bwd_configs
    cfg = candidate_bwd_configs(head_dim)[variant]
    rec = {"variant": variant, "head_dim": head_dim, "kind": kind, "config": repr(cfg),
           "smem_bytes": cfg.smem_bytes(), "consumer_registers": cfg.register_split[1]}
    try:
        g, block_sparse, det = _mods(kind)
        t = time.perf_counter()
        ptx = compile_ptx(key_for(cfg, g, block_sparse, det), g)
        rec["compile_s"] = round(time.perf_counter() - t, 2)
        rec.update(ptxas_report(ptx))
        rec["local_memory"] = "ld.local" in ptx or "st.local" in ptx
        rec["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - the report lists every failure
        rec["status"] = "error"
        rec["message"] = f"{type(e).__name__}: {str(e)[:1500]}"
    return rec


def main(argv=None):
    from flexlab.kernels.bwd_config import candidate_bwd_configs
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", nargs="?", default=None)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--variants", default="")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--head-dims", default="64,128")
    args = ap.parse_args(argv)
    wanted = set(filter(None, args.variants.split(",")))
    jobs = [(v, d, k) for d in map(int, args.head_dims.split(",")) for v in candidate_bwd_configs(d)
            if not wanted or v in wanted for k in args.kinds.split(",")]
    with ProcessPoolExecutor(args.jobs) as pool:
        records = list(pool.map(compile_cell, jobs))
    print(f"{'D':>3} {'variant':<20} {'kind':<9} {'smem':>7} {'spill st/ld':>12} {'compile':>8}  status")
    for r in records:
        spill = f"{r.get('spill_stores', '?')}/{r.get('spill_loads', '?')}"
        print(f"{r['head_dim']:>3} {r['variant']:<20} {r['kind']:<9} {r['smem_bytes']:>7} {spill:>12} "
              f"{r.get('compile_s', 0):>7.1f}s  {r['status']} {r.get('message', '')[:200]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
    bad = [r for r in records if r["status"] != "ok" or r.get("spill_stores") or r.get("spill_loads")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
