"""Build many kernels at once into the disk cache, one process per CPU core.

Compiling is CPU work (tracing, MLIR passes, ptxas) and needs no GPU, so a test or benchmark session that will touch
every gallery variant can pay for all compiles in parallel up front:

    python -m flexlab.runtime.precompile --dims 64,128 --dtypes bfloat16,float16

Later calls in any process find the kernels on disk (see `compile.KernelCache`).
"""
from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "bf16": "bfloat16", "fp16": "float16"}


def _one(job: tuple) -> tuple[str, float, str]:
    """Compile one (variant, head dim, dtype) in this worker; returns (label, seconds, error or "")."""
    name, head_dim, dtype_name = job
    import torch

    from ..backends.cute import kernel_mods
    from ..gallery import get_variant
    from .compile import KernelMods, kernel_cache
    from .launch import compile_key, config_for

    label = f"{name or 'dense'} D{head_dim} {dtype_name}"
    t0 = time.perf_counter()
    try:
        dtype = getattr(torch, dtype_name)
        if name is None:
            mods, sparse = KernelMods(), False
        else:
            v = get_variant(name)
            m = v.build(1, 4, *next(ql for ql in [(1000, 1000), (1023, 1024), (256, 1000)] if v.accepts_lengths(*ql)))
            sparse = m.mask_mod is not None  # callers build a BlockMask whenever there is a mask_mod
            mods = kernel_mods(m.score_mod, m.mask_mod)
        key = compile_key(mods, dtype, config_for(head_dim, sparse, mods), "sm_90a", sparse)
        kernel_cache().get(key, mods)
        return label, time.perf_counter() - t0, ""
    except Exception as e:  # noqa: BLE001  (reported per job; one bad variant must not stop the others)
        return label, time.perf_counter() - t0, f"{type(e).__name__}: {e}"[:300]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="all", help="comma-separated gallery names, 'all', or 'none' (dense only)")
    p.add_argument("--dims", default="64,128")
    p.add_argument("--dtypes", default="bfloat16")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    from ..gallery import load_gallery
    names = [None] + (sorted(load_gallery()) if args.variants == "all" else
                      [] if args.variants == "none" else args.variants.split(","))
    jobs = [(n, int(d), _DTYPES[t]) for n in names for d in args.dims.split(",") for t in args.dtypes.split(",")]
    t0, failed = time.perf_counter(), 0
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for fut in as_completed([pool.submit(_one, j) for j in jobs]):
            label, sec, err = fut.result()
            failed += bool(err)
            print(f"{'FAIL' if err else 'ok  '} {label:40s} {sec:6.1f} s {err}", flush=True)
    print(f"{len(jobs)} kernels, {failed} failed, {time.perf_counter() - t0:.0f} s wall")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
