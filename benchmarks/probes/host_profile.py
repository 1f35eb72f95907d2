"""H200 profile of flexlab's host path: where the microseconds of one call go, per public entry point.

Usage: python benchmarks/probes/host_profile.py OUT.json OUT.txt   (not a test; run on the GPU machine)

For each case (tiny shapes, so the GPU never holds the host back) and each entry point -- the inference call
`flexlab.flex_attention`, the forward and backward custom ops exactly as autograd calls them, the backward launch
alone, and a whole training step -- it records the median host time per call with the GPU idle before each call
(kernels queued, not waited for), and a cProfile of many calls (top functions by own time) in OUT.txt.
"""
from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bwd_host_probe import host_us  # noqa: E402

CASES = [("dense", None), ("document", None), ("softcap_causal", None), ("alibi_causal", None)]
PROFILE_CALLS = 300


def entry_points(variant: str, B=1, H=2, S=512, D=128):
    from torch.nn.attention.flex_attention import noop_mask

    import flexlab
    from flexlab import _ops
    from flexlab.autograd import _block_mask_tensors, _mods_key
    from flexlab.bench.cases import build_case
    from flexlab.kernels import bwd_launch
    from flexlab.mask import create_block_mask

    case = build_case(variant, B, H, S, "cuda")
    bm = create_block_mask(case.mask_mod, None, None, S, S, device="cuda") if case.mask_mod is not None else None
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    qd, kd, vd = (t.detach() for t in (q, k, v))
    dout = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)

    def infer():
        with torch.no_grad():
            return flexlab.flex_attention(qd, kd, vd, score_mod=case.score_mod, block_mask=bm, backend="cute")

    def step():
        q.grad = k.grad = v.grad = None
        flexlab.flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm, backend="cute").backward(dout)

    step()
    infer()
    mask_mod = None if bm is None or bm.mask_mod is noop_mask else bm.mask_mod
    key = _mods_key(case.score_mod, mask_mod)
    entry = _ops.mod_entry(key)
    masks, sizes = _block_mask_tensors(bm)
    scale = D ** -0.5
    out, lse = _ops.flex_attention_fwd(qd, kd, vd, entry.aux_tensors, masks, sizes, scale, key, entry.aux_scalars,
                                       False)
    return {
        "infer": infer,
        "fwd_op": lambda: _ops.flex_attention_fwd(qd, kd, vd, entry.aux_tensors, masks, sizes, scale, key,
                                                  entry.aux_scalars, False),
        "bwd_op": lambda: _ops.flex_attention_bwd(dout, qd, kd, vd, out, lse, None, entry.aux_tensors, masks, sizes,
                                                  scale, key, entry.aux_scalars, False),
        "bwd_launch": lambda: bwd_launch.backward(dout, qd, kd, vd, out, lse, None, entry, entry.aux_tensors, masks,
                                                  sizes, scale, entry.aux_scalars, False),
        "train_step": step,
    }


def profile_text(fn, calls=PROFILE_CALLS, top=30) -> str:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for i in range(calls):
        fn()
        if i % 50 == 49:
            torch.cuda.synchronize()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def main(json_path: str, text_path: str) -> None:
    rows, report = [], []
    for variant, _ in CASES:
        try:
            fns = entry_points(variant)
        except Exception as e:  # noqa: BLE001 - one failing case must not lose the others
            rows.append(dict(variant=variant, error=f"{type(e).__name__}: {e}"))
            continue
        for name, fn in fns.items():
            t = host_us(fn, repeats=200)
            rows.append(dict(variant=variant, entry=name, host_us=t))
            print(f"{variant:15s} {name:11s} host {t['median']:7.1f} us (min {t['min']:.1f})", flush=True)
            report.append(f"\n===== {variant} / {name}: median {t['median']:.1f} us per call\n")
            report.append(profile_text(fn))
    with open(json_path, "w") as f:
        json.dump(dict(rows=rows, torch=torch.__version__), f, indent=1)
    with open(text_path, "w") as f:
        f.write("".join(report))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.split("\n\n")[1])
    main(*sys.argv[1:])
