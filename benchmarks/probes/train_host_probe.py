"""H200 probe: host time of one training step, split into the forward call and the backward call, for flexlab and
for FA4 on the same inputs (tiny shapes, so the GPU never holds the host back).

Usage: python benchmarks/probes/train_host_probe.py OUT.json   (not a test; run on the GPU machine)

Per variant: `fwd` is the forward call with gradients wanted (kernels queued, not waited for), `bwd` the
`out.backward(dout)` that follows it, `step` both plus the gradient reset, each the median host time over many
calls with the GPU idle before every call. The backends take turns (`ROUNDS` rounds of `REPEATS` calls each),
because a host's speed wanders by more than the difference being measured. `flexlab-full-path` is flexlab with its
warm training path off (`full_path`): every call validated, planned and lowered as a first call is. The
learnable-bias variant (flexlab only: FA4 has no spelling for it) edits its table in place after every step, as an
optimizer does.
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))

VARIANTS = ("dense", "causal", "document", "softcap_causal", "learnable_bias")
BACKENDS = ("flexlab", "flexlab-full-path", "fa4")
REPEATS = 50
ROUNDS = 4


@contextlib.contextmanager
def full_path():
    """flexlab as it ran before its warm training path: no bound training calls, the backward planned per call, and
    an in-place edit of a captured tensor lowering the mods again."""
    from flexlab import api
    from flexlab.backends import cute
    from flexlab.kernels import bwd_launch

    class NeverKept(dict):
        def __setitem__(self, key, value):
            pass

    saved = api._WARM_TRAIN, cute._Lowered.follow_in_place_edits, bwd_launch._plan
    api._WARM_TRAIN = NeverKept()
    cute._Lowered.follow_in_place_edits = lambda self, state: False

    def plan_every_call(q, k, entry, block_mask, block_size, deterministic, has_dlse, arch):
        cfg = bwd_launch.config_for(q.shape[3], deterministic, entry.generated, bool(entry.grad_slots),
                                    int(block_size[0]) if block_mask else None)
        return bwd_launch._build_plan(q, k, entry, cfg, block_mask, block_size, deterministic, has_dlse, arch)

    bwd_launch._plan = plan_every_call
    try:
        yield
    finally:
        api._WARM_TRAIN, cute._Lowered.follow_in_place_edits, bwd_launch._plan = saved


def _learnable_bias_case(B, H, S):
    """Causal attention with a learnable relative bias (the gallery's), the table on the GPU requiring grad."""
    from flexlab.bench.cases import Case
    from flexlab.gallery import get_variant
    mods = get_variant("learnable_relative_bias").build(B=B, H=H, Q_LEN=S, KV_LEN=S, device="cuda")
    mods.tensors["bias"].requires_grad_(True)
    causal = get_variant("causal").build(B=B, H=H, Q_LEN=S, KV_LEN=S, device="cuda").mask_mod
    return Case("learnable_bias", mods.score_mod, causal, mods_source="gallery:learnable_relative_bias + causal"), \
        mods.tensors["bias"]


def split_samples(prepared, dout, out: dict, table=None) -> None:
    """Append REPEATS host-time samples (µs) of the forward call, the backward call and a whole step to `out`;
    `table` (a learnable captured tensor) is edited in place after every step, outside the timed spans."""
    leaves = tuple(prepared.inputs) + ((table,) if table is not None else ())
    for _ in range(REPEATS):
        if table is not None:
            with torch.no_grad():
                table.mul_(0.999)
        for t in leaves:
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
        for t in leaves:
            t.grad = None
        prepared.call().backward(dout)
        out["step"].append((time.perf_counter() - t4) * 1e6)
        if table is not None:
            with torch.no_grad():
                table.mul_(1.001)


def main(path: str, B=1, H=2, S=512, D=128) -> None:
    from flexlab.bench import peers
    from flexlab.bench.cases import build_case
    from flexlab.mask import create_block_mask

    rows = []
    for variant in VARIANTS:
        table = None
        if variant == "learnable_bias":
            case, table = _learnable_bias_case(B, H, S)
        else:
            case = build_case(variant, B, H, S, "cuda")
        bm = create_block_mask(case.mask_mod, None, None, S, S, device="cuda") if case.mask_mod else None
        q, k, v, dout = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        prepared = {}
        for name in BACKENDS:
            try:
                if table is not None and name == "fa4":
                    raise peers.Unavailable("FA4 has no learnable captured tensors")
                prep = peers.PEERS[name.removesuffix("-full-path")][0](case, q, k, v, bm, True)
            except peers.Unavailable as e:
                rows.append(dict(variant=variant, backend=name, error=str(e)))
                continue
            d = prep.from_bhsd(dout)
            with full_path() if name.endswith("-full-path") else contextlib.nullcontext():
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
                with full_path() if name.endswith("-full-path") else contextlib.nullcontext():
                    split_samples(prep, d, samples, table)
        for name in names:
            samples = prepared[name][2]
            r = dict(variant=variant, backend=name, **{k: round(statistics.median(v), 1) for k, v in samples.items()})
            rows.append(r)
            print(f"{variant:15s} {name:17s} fwd {r['fwd']:6.1f} us  bwd {r['bwd']:6.1f} us  step {r['step']:6.1f} us",
                  flush=True)
    with open(path, "w") as f:
        json.dump(dict(rows=rows, shape=[B, H, S, D], torch=torch.__version__), f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__.split("\n\n")[1])
    main(sys.argv[1])
