"""H200 probe: which Q tile the D=64 forward should use once a mask's partial blocks are stored bits.

    . .deps/activate.sh && python3 benchmarks/probes/mask_bits_tile_probe.py OUT.json

Masks that read captured tensors used to take 128-row tiles at D=64 (evaluating them at 192 rows spilled); read from
stored bits they compile without spills at 192 rows too. For the benchmark's document mask (8 documents, H=16, bf16)
at B1·S16k and B4·S4k this times the launcher's choice against 192-row tiles, one CTA per tile and dynamic tiles,
each checked against float64 attention on two heads (rel-L2 < 1e-2). Time: median of `triton.testing.do_bench` over
the whole launch (host work included, the same for every candidate). Not collected by pytest.
"""
from __future__ import annotations

import dataclasses
import json
import sys


def main(out_path: str) -> int:
    import torch
    from triton.testing import do_bench

    from flexlab.backends.cute import _lowered
    from flexlab.bench.cases import build_case
    from flexlab.kernels.config import FwdConfig
    from flexlab.mask import create_block_mask
    from flexlab.runtime import launch
    from flexlab.testing import reference, rel_l2

    records = []
    for B, S in ((1, 16384), (4, 4096)):
        H, D = 16, 64
        case = build_case("document", B, H, S, "cuda")
        low = _lowered(None, case.mask_mod)
        bm = create_block_mask(case.mask_mod, None, None, S, S, device="cuda")
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, H, S, D, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ref, _ = reference(q[:1, :2], k[:1, :2], v[:1, :2], None, bm)
        args = (q, k, v, low.mods, low.tensors_on(q.device), low.aux_scalars, bm)
        t192 = FwdConfig(head_dim=64, tile_m=192, tile_n=128, num_stages=3, mask_bits=True)
        candidates = {"launcher": None, "tile192": t192, "tile192+dynamic": launch._dynamic(t192, 132),
                      "tile128+one_cta_per_tile": dataclasses.replace(
                          launch.config_for(D, True, low.mods, S), mask_bits=True)}
        for name, cfg in candidates.items():
            def call():
                return launch.forward(*args, config=cfg, stored_masks=low.stored_masks)
            out, _ = call()
            torch.cuda.synchronize()
            err = rel_l2(out[:1, :2], ref)
            ms = float(do_bench(call, warmup=25, rep=200, return_mode="median"))
            rec = {"row": f"fwd document B{B} S{S} H{H} D{D}", "candidate": name, "ms": ms, "rel_l2": err,
                   "ok": bool(err < 1e-2 and torch.isfinite(out).all()),
                   "config": repr(cfg) if cfg is not None else "launcher default"}
            records.append(rec)
            print(json.dumps(rec), flush=True)
    json.dump({"records": records, "torch": torch.__version__}, open(out_path, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "mask_bits_tile_probe.json"))
