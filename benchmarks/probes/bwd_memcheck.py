"""Small backward cases through flexlab's custom ops, for compute-sanitizer:

    compute-sanitizer --tool memcheck --report-api-errors no python benchmarks/probes/bwd_memcheck.py
    compute-sanitizer --tool racecheck python benchmarks/probes/bwd_memcheck.py   (shared-memory hazards)

(`--report-api-errors no`: the CUDA driver bindings probe optional entry points with cuGetProcAddress, which the
sanitizer otherwise lists as errors although no kernel touched memory out of bounds.)

racecheck reports hazards between the producer's bulk copies of the LSE2/D rows into a stage and the consumers'
reads of them (none with `--config stats_from_global`; FA4's backward, which also stages its LSE/D rows through
shared memory, draws 8 such reports on a 300-token case). Those accesses are ordered by the stage's mbarriers: the
consumers wait on the stage's full barrier before reading and arrive on its empty barrier only after the step's
last read, one elected lane per warp, which the tool does not appear to credit to the other lanes. memcheck is clean.

Lengths are not tile multiples and Sq != Skv, so tail tiles, padded D/LSE rows, the TMA clipping of dK/dV stores and
the dQ reduce past Sq are exercised, with GQA, a block mask, every trainable gallery variant, a gradient into the
LSE output, and deterministic mode.
"""
from __future__ import annotations

import sys

import torch

import flexlab
from flexlab.autograd import differentiable_attention
from flexlab.gallery import load_gallery
from flexlab.testing import random_qkv


def _run(Sq, Skv, D, Hkv, score_mod=None, bm=None, trainable=(), with_lse=False, deterministic=False):
    q, k, v = random_qkv(1, 4, Sq, Skv, D, torch.bfloat16, "cuda", Hkv=Hkv, requires_grad=True)
    out, lse = differentiable_attention(q, k, v, score_mod, bm, enable_gqa=Hkv != 4, return_lse=True,
                                        deterministic=deterministic)
    loss = out.float().square().sum() + (lse[torch.isfinite(lse)].sum() if with_lse else 0.0)
    loss.backward()
    torch.cuda.synchronize()
    for t in (q, k, v, *trainable):
        assert t.grad is not None and not torch.isnan(t.grad).any()


def _force_persistent(ctas: int):
    from dataclasses import replace

    from flexlab.kernels import bwd_launch
    default = bwd_launch._config

    def forced(head_dim, deterministic, *rest):
        cfg = default(head_dim, deterministic, *rest)
        looped = replace(cfg, persistent_ctas=ctas)
        return cfg if deterministic or looped.feasibility_error() else looped
    bwd_launch._config = forced


def _force_cut(workers: int, parts: int):
    """Dense grids cut their last wave as if `workers` CTAs ran at once, each cut tile into `parts` parts (more parts
    than a tile has steps leaves some empty: they publish zeros)."""
    from flexlab.kernels import bwd_config, bwd_launch
    bwd_launch._cut_workers = lambda dev: workers
    bwd_config.split_parts = lambda tiles, w, steps: parts if tiles % w else 1


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="default",
                    help="a name from bwd_config.candidate_bwd_configs (run for every head dim and both modes), to "
                         "tell which option a sanitizer report comes with")
    ap.add_argument("--no-gallery", action="store_true", help="only the dense, GQA and causal-window cases")
    ap.add_argument("--variants", default="", help="comma-separated gallery variants only (default: all at D=128), "
                    "each at every --head-dims; with --no-basic, nothing else")
    ap.add_argument("--head-dims", default="64,128,256", help="head dims of the basic and --variants cases")
    ap.add_argument("--no-basic", action="store_true", help="skip the dense, GQA and causal-window cases")
    ap.add_argument("--deterministic", action="store_true", help="run each gallery case in deterministic mode too")
    ap.add_argument("--persistent-ctas", type=int, default=0,
                    help="run every non-deterministic backward as this many persistent CTAs (small: each loops over "
                         "several KV tiles, which the default's one CTA per SM never does at these lengths)")
    ap.add_argument("--cut-wave", default="", metavar="WORKERS,PARTS",
                    help="cut every dense grid's last wave as if WORKERS CTAs ran at once, into PARTS parts per tile "
                         "(the whole tiles' kernel, then the parts' kernel)")
    args = ap.parse_args(argv)
    if args.cut_wave:
        _force_cut(*(int(x) for x in args.cut_wave.split(",")))
    if args.persistent_ctas:
        _force_persistent(args.persistent_ctas)
    if args.config != "default":
        from flexlab.kernels import bwd_launch
        from flexlab.kernels.bwd_config import candidate_bwd_configs
        bwd_launch._config = lambda head_dim, deterministic, *rest: candidate_bwd_configs(head_dim,
                                                                                         deterministic)[args.config]
    head_dims = tuple(int(d) for d in args.head_dims.split(","))
    for D in (() if args.no_basic else head_dims):
        _run(200, 333, D, 2)
        _run(333, 200, D, 4, with_lse=True)
        _run(1, 1, D, 1)
        _run(300, 300, D, 2, deterministic=True)
        bm = flexlab.create_block_mask(lambda b, h, qi, kv: (qi >= kv) & (qi - kv < 150), 1, 1, 300, 300,
                                       device="cuda")
        _run(300, 300, D, 2, bm=bm)
        _run(300, 300, D, 2, bm=bm, deterministic=True)
        print(f"ran dense/GQA/causal-window D={D}", flush=True)
    if args.no_gallery:
        return 0
    wanted = [w for w in args.variants.split(",") if w]
    for name, variant in sorted(load_gallery().items()):
        S = next((s for s in (200, 256, 333) if variant.accepts_lengths(s, s)), None)
        if S is None or (wanted and name not in wanted):
            continue
        for D in (head_dims if wanted else (128,)):
            mods = variant.build(1, 4, S, S, device="cuda")
            trainable = [mods.tensors[t].requires_grad_(True) for t in variant.trainable]
            bm = flexlab.create_block_mask(mods.mask_mod, 1, 4, S, S, device="cuda") if mods.mask_mod else None
            _run(S, S, D, 2, mods.score_mod, bm, trainable)
            if args.deterministic:
                _run(S, S, D, 2, mods.score_mod, bm, trainable, deterministic=True)
            print(f"ran {name} S={S} D={D}{' (and deterministic)' if args.deterministic else ''}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
