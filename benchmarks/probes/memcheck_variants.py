"""Small case of every gallery variant (and dense) through backend='cute', for compute-sanitizer:

    compute-sanitizer --tool memcheck --report-api-errors no python benchmarks/probes/memcheck_variants.py
    compute-sanitizer --tool memcheck --report-api-errors no python benchmarks/probes/memcheck_variants.py --split-tail

Lengths are not tile multiples, so tail tiles, clamped captured-tensor reads and the TMA clipping are exercised.
`--split-tail` runs dense cases through the split tail instead (`FwdConfig.split_tail`): few workers with small and
large remainders, pairs of CTAs, more workers than tiles, and the launcher's default on long keys. `--d64` runs the
gallery variants at head_dim 64 instead of 128 (192-row tiles, with the padded rows in the first tile where the
launcher moves them there: `FwdConfig.ragged_first_tile`).
"""
from __future__ import annotations

import sys

import torch

import flexlab
from flexlab.gallery import load_gallery
from flexlab.testing import random_qkv


def split_tail_cases() -> int:
    import dataclasses

    from flexlab.kernels.config import default_config
    from flexlab.runtime.compile import KernelMods
    from flexlab.runtime.launch import forward
    for D in (64, 128):
        for ctas, cluster in ((7, 1), (5, 1), (10, 2), (132, 2)):
            cfg = dataclasses.replace(default_config(D), persistent_ctas=ctas, cluster_m=cluster, split_tail=True)
            q, k, v = random_qkv(1, 3, 1000, 1100, D, torch.bfloat16, "cuda", Hkv=1)
            forward(q, k, v, KernelMods(), config=cfg)
            forward(q, k, v, KernelMods(), config=cfg, with_lse=False)
            torch.cuda.synchronize()
            print(f"ran split tail D={D} ctas={ctas} cluster={cluster}", flush=True)
    q, k, v = random_qkv(1, 2, 700, 8300, 128, torch.bfloat16, "cuda")  # the launcher's default: 65 KV blocks
    forward(q, k, v)
    torch.cuda.synchronize()
    print("ran split tail, launcher default", flush=True)
    return 0


def main() -> int:
    if "--split-tail" in sys.argv[1:]:
        return split_tail_cases()
    for name, v in [("dense", None)] + sorted(load_gallery().items()):
        S = next((s for s in (200, 256, 333, 1000) if v is None or v.accepts_lengths(s, s)), None)
        if S is None:
            print(f"skip {name}: no small length")
            continue
        variant_dims = (64,) if "--d64" in sys.argv[1:] else (128,)
        for D in ((64, 128, 256) if v is None else variant_dims):  # dense covers every tile config
            q, k, vv = random_qkv(1, 2, S, S, D, torch.bfloat16, "cuda")
            mods = v.build(1, 2, S, S, device="cuda") if v is not None else None
            bm = (flexlab.create_block_mask(mods.mask_mod, 1, 2, S, S, device="cuda")
                  if mods is not None and mods.mask_mod else None)
            with torch.no_grad():
                flexlab.flex_attention(q, k, vv, score_mod=mods.score_mod if mods else None, block_mask=bm,
                                       backend="cute")
            torch.cuda.synchronize()
        print(f"ran {name} S={S}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
