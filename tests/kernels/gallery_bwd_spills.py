"""Backward main kernel of every gallery variant, compiled for sm_90a on a CPU with the launcher's own configuration
(trainable tensors requiring grad, a block mask at torch's 128 where the variant has a mask_mod), and ptxas -v's
spill bytes and registers per kernel (not a test; no GPU):

    python tests/kernels/gallery_bwd_spills.py OUT.json [--head-dims 64,128] [--jobs 2] [--persistent]

`--persistent`: the kernels as the launcher runs them on short KV tiles (`bwd_config.runs_persistent`), where it does.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor


def compile_variant(job: tuple) -> dict:
    name, D, persistent = job
    import os
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bwd_option_report import compile_ptx, key_for, ptxas_report

    from flexlab.backends import cute as backend
    from flexlab.codegen import generate
    from flexlab.gallery import get_variant
    from flexlab.kernels.bwd_config import drop_gathering_kind_loops
    from flexlab.kernels.bwd_launch import config_for, mask_gathers
    variant = get_variant(name)
    mods = variant.build(1, 4, 256, 256)
    for t in variant.trainable:
        mods.tensors[t].requires_grad_(True)
    g = generate(mods.score_mod, mods.mask_mod, fastmath=True)
    sparse = mods.mask_mod is not None
    grads = any(g.aux_requires_grad)
    bits = sparse and backend.stores_mask_bits(mods.score_mod, mods.mask_mod)
    cfg = drop_gathering_kind_loops(config_for(D, False, g, grads, 128 if sparse else None), mask_gathers(g))
    if bits:
        from flexlab.kernels.bwd_launch import with_mask_bits
        cfg = with_mask_bits(cfg)
    if persistent:
        from dataclasses import replace

        from flexlab.kernels.bwd_config import H200_SMS, runs_persistent
        from flexlab.kernels.bwd_launch import has_captured_grads
        if not runs_persistent(cfg, 0, False, captured_grads=has_captured_grads(g, grads)):
            return {"name": name, "D": D, "tile_m": cfg.tile_m, "mask_ops": 0, "status": "not persistent"}
        cfg = replace(cfg, persistent_ctas=H200_SMS)
    key = key_for(cfg, g, sparse, False)
    rec = {"name": name, "D": D, "tile_m": cfg.tile_m, "dq_swap_ab": cfg.dq_swap_ab, "mask_bits": cfg.mask_bits,
           "mask_ops": g.mask_op_count if sparse else 0}
    t0 = time.perf_counter()
    try:
        rec.update(ptxas_report(compile_ptx(key, g)))
        rec["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - one record per variant
        rec.update(status="error", message=f"{type(e).__name__}: {e}"[:500])
    rec["compile_s"] = round(time.perf_counter() - t0, 1)
    return rec


def main(argv=None):
    from flexlab.gallery import load_gallery
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated variant names")
    ap.add_argument("--persistent", action="store_true", help="persistent CTAs where the launcher would run them")
    args = ap.parse_args(argv)
    names = [n for n in load_gallery() if not args.only or n in args.only.split(",")]
    jobs = [(n, int(d), args.persistent) for d in args.head_dims.split(",") for n in names]
    with ProcessPoolExecutor(args.jobs) as pool:
        records = list(pool.map(compile_variant, jobs))
    for r in records:
        print(f"{r['name']:<26} D={r['D']:<4} tile_m={r['tile_m']:<4} ops={r['mask_ops']:<3} "
              f"spill {r.get('spill_stores', '?')}/{r.get('spill_loads', '?')} {r['status']} {r.get('message', '')}")
    with open(args.out, "w") as f:
        json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
