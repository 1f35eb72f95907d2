"""Build many kernels at once into the disk cache, one process per CPU core.

Compiling is CPU work (tracing, MLIR passes, ptxas) and needs no GPU, so a test or benchmark session that will touch
every gallery variant can pay for all compiles in parallel up front:

    python -m flexlab.runtime.precompile --dims 64,128 --dtypes bfloat16,float16 --seqlens 1024,4096 --backward

For each (variant, head dim, dtype) it builds the forward kernels the launcher picks for the given key lengths
(`--seqlens`: at D=128 the K/V stage count, and the persistent kernels of short and mid-length tiles, depend on it;
under a block mask both tile schedulers are built, since the launcher picks one from the mask's density), each in its
LSE-writing (training, `return_lse=True`) and LSE-free (inference) form. With `--backward` it adds the backward's
three kernels, with the variant's trainable tensors requiring grad. Later calls in any process find the kernels on
disk (see `disk_cache.KernelCache`).
"""
from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

from ..kernels.config import H200_SMS  # the persistent kernels' grid size without a GPU to ask

_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "bf16": "bfloat16", "fp16": "float16"}


def _build_mods(name):
    """(score_mod, mask_mod or None, captured tensors to train) of a gallery variant, or of dense attention."""
    if name is None:
        return None, None, []
    from ..gallery import get_variant
    v = get_variant(name)
    m = v.build(1, 4, *next(ql for ql in [(1000, 1000), (1023, 1024), (256, 1000)] if v.accepts_lengths(*ql)))
    return m.score_mod, m.mask_mod, [m.tensors[t] for t in v.trainable]


def forward_keys(score_mod, mask_mod, head_dim: int, dtype, seqlens, num_sms: int) -> tuple:
    """(the `KernelMods`, the forward `CompileKey`s the launcher would use for them at these key lengths, training and
    inference forms), for a GPU of `num_sms` SMs; the mask is taken to come as a BlockMask, as callers pass it."""
    import dataclasses

    from ..backends.cute import kernel_mods, stores_mask_bits
    from .launch import bits_wide_tiles, compile_key, config_for, may_move_padding
    mods = kernel_mods(score_mod, mask_mod)
    sparse = mods.mask_mod is not None
    bits = sparse and stores_mask_bits(score_mod, mask_mod)
    keys = []
    for seqlen in seqlens:
        # Under a block mask the launcher picks the tile scheduler from the mask's density, unknown here: plan both.
        means = (None, 0) if sparse else (None,)
        for mean in means:
            cfgs = [config_for(head_dim, sparse, mods, seqlen, num_sms, mean, mask_bits=bits)]
            if cfgs[0].mask_bits and bits_wide_tiles(cfgs[0], float("inf"), mods.score_mod is not None) is not None:
                # wide tiles where the mask's density asks for them (`launch.bits_wide_tiles`): unknown here
                cfgs.append(dataclasses.replace(cfgs[0], tile_m=192, num_stages=3))
            # the padded Q rows in the first tile where the mask's lists get shorter so (`launch._ragged_first`)
            cfgs += [dataclasses.replace(cfg, ragged_first_tile=True) for cfg in cfgs
                     if sparse and may_move_padding(cfg, seqlen, mods, cfg.mask_bits)]
            for cfg in cfgs:
                for writes_lse in (True, False):
                    key = compile_key(mods, dtype, cfg, "sm_90a", sparse, writes_lse)
                    if key not in keys:
                        keys.append(key)
    return mods, keys


def _one(job: tuple) -> tuple[str, float, str]:
    """Compile one (variant, head dim, dtype) in this worker; returns (label, seconds, error or "")."""
    name, head_dim, dtype_name, seqlens, num_sms, backward = job
    import torch

    label = f"{name or 'dense'} D{head_dim} {dtype_name}"
    t0 = time.perf_counter()
    try:
        from .compile import forward_kernel
        dtype = getattr(torch, dtype_name)
        score_mod, mask_mod, trainable = _build_mods(name)
        mods, keys = forward_keys(score_mod, mask_mod, head_dim, dtype, seqlens, num_sms)
        for key in keys:
            forward_kernel(key, mods)
        label += f" ({len(keys)} forward"
        if backward:
            from .. import _ops
            from ..kernels.bwd_launch import backward_kernels
            for t in trainable:
                t.requires_grad_(True)
            mask = mask_mod if mods.mask_mod is not None else None  # torch's noop mask counts as none
            entry = _ops.mod_entry(_ops.register_mods(score_mod, mask))  # the autograd path's generated mods
            # (a mask comes as a BlockMask at torch's default block size)
            q_block = 128 if mask is not None else None
            for ctas in backward_persistence(entry, head_dim, q_block, seqlens, num_sms):
                backward_kernels(entry.generated, entry.grad_slots, dtype, head_dim, q_block,
                                 mask_bits=entry.stored_masks is not None, persistent_ctas=ctas)
                if q_block is None and not ctas:  # dense grids whose last wave is cut (`bwd_config.split_parts`:
                    # whether it is depends on the batch and head counts too, unknown here)
                    backward_kernels(entry.generated, entry.grad_slots, dtype, head_dim, None, cut_last_wave=True)
            label += " + backward"
        return label + ")", time.perf_counter() - t0, ""
    except Exception as e:  # noqa: BLE001  (reported per job; one bad variant must not stop the others)
        return label, time.perf_counter() - t0, f"{type(e).__name__}: {e}"[:300]


def backward_persistence(entry, head_dim: int, q_block, seqlens, num_sms: int) -> list[int]:
    """The `persistent_ctas` values the backward launcher would use for these mods (`bwd_config.runs_persistent`):
    under a block mask both (its tiles' length is unknown here), without one as the query lengths say (taken equal to
    the key lengths, MHA)."""
    from ..kernels import bwd_config
    from ..kernels.bwd_launch import config_for, has_captured_grads
    cfg = config_for(head_dim, False, entry.generated, bool(entry.grad_slots), q_block)
    steps = [0, float("inf")] if q_block is not None else [-(-s // cfg.tile_m) for s in seqlens]
    grads = has_captured_grads(entry.generated, entry.grad_slots)
    return sorted({num_sms if bwd_config.runs_persistent(cfg, n, False, grads) else 0 for n in steps})


def _default_sms() -> int:
    import torch
    if torch.cuda.is_available():
        from .launch import _sm_count
        return _sm_count(torch.device("cuda", torch.cuda.current_device()))
    return H200_SMS


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="all", help="comma-separated gallery names, 'all', or 'none' (dense only)")
    p.add_argument("--dims", default="64,128")
    p.add_argument("--dtypes", default="bfloat16")
    p.add_argument("--seqlens", default="1024,4096,16384",
                   help="key lengths the run will see (they choose the D=128 forward's stages and persistence)")
    p.add_argument("--sms", type=int, default=None,
                   help=f"SM count of the target GPU (default: this machine's GPU, else {H200_SMS}, an H200's)")
    p.add_argument("--backward", action="store_true", help="also build the backward kernels")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    from ..gallery import load_gallery
    names = [None] + (sorted(load_gallery()) if args.variants == "all" else  # dense attention always
                      [n for n in args.variants.split(",") if n not in ("", "none")])
    seqlens = tuple(int(s) for s in args.seqlens.split(","))
    sms = args.sms if args.sms is not None else _default_sms()
    jobs = [(n, int(d), _DTYPES[t], seqlens, sms, args.backward)
            for n in names for d in args.dims.split(",") for t in args.dtypes.split(",")]
    t0, failed = time.perf_counter(), 0
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for fut in as_completed([pool.submit(_one, j) for j in jobs]):
            label, sec, err = fut.result()
            failed += bool(err)
            print(f"{'FAIL' if err else 'ok  '} {label:56s} {sec:6.1f} s {err}", flush=True)
    print(f"{len(jobs)} jobs, {failed} failed, {time.perf_counter() - t0:.0f} s wall")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
