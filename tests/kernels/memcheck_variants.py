"""Small case of every gallery variant (and dense) through backend='cute', for compute-sanitizer:

    compute-sanitizer --tool memcheck --report-api-errors no python tests/kernels/memcheck_variants.py

Lengths are not tile multiples, so tail tiles, clamped captured-tensor reads and the TMA clipping are exercised.
"""
from __future__ import annotations

import sys

import torch

import flexlab
from flexlab.gallery import load_gallery
from flexlab.testing import random_qkv


def main() -> int:
    for name, v in [("dense", None)] + sorted(load_gallery().items()):
        S = next((s for s in (200, 256, 333, 1000) if v is None or v.accepts_lengths(s, s)), None)
        if S is None:
            print(f"skip {name}: no small length")
            continue
        for D in ((64, 128, 256) if v is None else (128,)):  # dense covers every tile config
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
