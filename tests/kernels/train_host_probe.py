"""H200 probe: host time of one training step, split into the forward call and the backward call, for flexlab and
for FA4 on the same inputs (tiny shapes, so the GPU never holds the host back).

Usage: python tests/kernels/train_host_probe.py OUT.json   (not a test; run on the GPU machine)

Per variant: `fwd` is the forward call with gradients wanted (kernels queued, not waited for), `bwd` the
`out.backward(dout)` that follows it, `step` both plus the gradient reset, each the median host time over many
calls with the GPU idle before every call. The two backends take turns (`ROUNDS` rounds of `REPEATS` calls each),
because a host's speed wanders by more than the difference being measured.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))

VARIANTS = ("dense", "causal", "document", "softcap_causal")
REPEATS = 50
ROUNDS = 4


def split_samples(prepared, dout, out: dict) -> None:
    """Append REPEATS host-time samples (µs) of the forward call, the backward call and a whole step to `out`."""
    for _ in range(REPEATS):
        for t in prepared.inputs:
            t.grad = None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = prepared.call()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        res.backward(dout)
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        out["fwd"].append((t1 - t0) * 1e6)
        out["bwd"].append((t3 - t2) * 1e6)
        t4 = time.perf_counter()
        for t in prepared.inputs:
            t.grad = None
        prepared.call().backward(dout)
        out["step"].append((time.perf_counter() - t4) * 1e6)


def main(path: str, B=1, H=2, S=512, D=128) -> None:
    from flexlab.bench import peers
    from flexlab.bench.cases import build_case
    from flexlab.mask import create_block_mask

    rows = []
    for variant in VARIANTS:
        case = build_case(variant, B, H, S, "cuda")
        bm = create_block_mask(case.mask_mod, None, None, S, S, device="cuda") if case.mask_mod else None
        q, k, v, dout = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        prepared = {}
        for name in ("flexlab", "fa4"):
            try:
                prep = peers.PEERS[name][0](case, q, k, v, bm, True)
            except peers.Unavailable as e:
                rows.append(dict(variant=variant, backend=name, error=str(e)))
                continue
            d = prep.from_bhsd(dout)
            for _ in range(3):
                for t in prep.inputs:
                    t.grad = None
                prep.call().backward(d)
            prepared[name] = (prep, d, {"fwd": [], "bwd": [], "step": []})
        torch.cuda.synchronize()
        names = list(prepared)
        for r in range(ROUNDS):  # in turns, the order rotated each round
            for name in names[r % len(names):] + names[:r % len(names)]:
                prep, d, samples = prepared[name]
                split_samples(prep, d, samples)
        for name in names:
            samples = prepared[name][2]
            r = dict(variant=variant, backend=name, **{k: round(statistics.median(v), 1) for k, v in samples.items()})
            rows.append(r)
            print(f"{variant:15s} {name:8s} fwd {r['fwd']:6.1f} us  bwd {r['bwd']:6.1f} us  step {r['step']:6.1f} us",
                  flush=True)
    with open(path, "w") as f:
        json.dump(dict(rows=rows, shape=[B, H, S, D], torch=torch.__version__), f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__.split("\n\n")[1])
    main(sys.argv[1])
