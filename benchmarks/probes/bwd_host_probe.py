"""H200 probe of the host cost of a flexlab training step: wall clock vs summed kernel time, and one backward's host time.

Usage: python benchmarks/probes/bwd_host_probe.py OUT.json   (not a test; run on the GPU machine)

Per shape, with backend="cute" (forward kernel + the three backward kernels):
  wall_ms             median fwd+bwd step (triton do_bench; gradients reset every call): what a step waits for;
  kernel_ms           GPU time of every kernel and memset of one step (torch.profiler), summed;
  gap_ms              wall_ms - kernel_ms: time the GPU waited for the host;
  bwd_op_host_us      host time of one backward custom-op call (as autograd makes it) with the GPU idle: from the
                      call to its return, kernels queued but not waited for (median over `REPEATS` calls);
  bwd_launch_host_us  the same for `flexlab.kernels.bwd_launch.backward` alone (no custom-op dispatch);
  fwd_op_host_us      the same for the forward custom op;
  bwd_sync_free       a warm backward call under torch.cuda.set_sync_debug_mode("error") raised nothing (no
                      device-to-host read in the steady state).
Shapes: dense and sliding window (1024) at B1 S16k H16 D128, document masking (8 packed documents) at B4 S4k H16 D128.
"""
from __future__ import annotations

import importlib.metadata
import json
import statistics
import sys
import time

import torch

REPEATS = 50
SHAPES = [("dense", 1, 16, 16384, 128), ("sliding_window", 1, 16, 16384, 128), ("document", 4, 16, 4096, 128)]


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "missing"


def host_us(fn, repeats: int = REPEATS) -> dict:
    """Host time of `fn` with the GPU idle before every call (the launch queue empty), in microseconds."""
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return {"median": statistics.median(samples), "min": min(samples)}


def sync_free(fn) -> tuple[bool, str]:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return True, ""
    except RuntimeError as e:
        return False, str(e)[:500]
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


def probe(variant: str, B: int, H: int, S: int, D: int) -> dict:
    from torch.nn.attention.flex_attention import noop_mask
    from triton.testing import do_bench

    import flexlab
    from flexlab import _ops
    from flexlab.autograd import _block_mask_tensors, _mods_key
    from flexlab.bench.cases import build_case
    from flexlab.bench.timing import kernel_profile_cuda
    from flexlab.kernels import bwd_launch
    from flexlab.mask import create_block_mask

    case = build_case(variant, B, H, S, "cuda")
    bm = create_block_mask(case.mask_mod, None, None, S, S, device="cuda") if case.mask_mod is not None else None
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)

    def step():
        q.grad = k.grad = v.grad = None
        out = flexlab.flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm, backend="cute")
        out.backward(dout)

    t0 = time.perf_counter()
    step()  # compiles
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    wall = do_bench(step, warmup=25, rep=200, grad_to_none=[q, k, v], return_mode="median")
    kernel_ms, kernels = kernel_profile_cuda(step, calls=10, top=6)

    # The ops exactly as autograd calls them, on this step's saved tensors.
    mask_mod = None if bm is None or bm.mask_mod is noop_mask else bm.mask_mod
    key = _mods_key(case.score_mod, mask_mod)
    entry = _ops.mod_entry(key)
    masks, sizes = _block_mask_tensors(bm)
    scale = D ** -0.5
    qd, kd, vd = (t.detach() for t in (q, k, v))
    out, lse = _ops.flex_attention_fwd(qd, kd, vd, entry.aux_tensors, masks, sizes, scale, key, entry.aux_scalars,
                                       False)

    def bwd_op():
        return _ops.flex_attention_bwd(dout, qd, kd, vd, out, lse, None, entry.aux_tensors, masks, sizes, scale, key,
                                       entry.aux_scalars, False)

    def bwd_launch_only():
        return bwd_launch.backward(dout, qd, kd, vd, out, lse, None, entry, entry.aux_tensors, masks, sizes, scale,
                                   entry.aux_scalars, False)

    def fwd_op():
        return _ops.flex_attention_fwd(qd, kd, vd, entry.aux_tensors, masks, sizes, scale, key, entry.aux_scalars,
                                       False)

    bwd_op()
    ok, why = sync_free(bwd_op)
    row = dict(variant=variant, B=B, H=H, S=S, D=D, first_call_s=first_s, wall_ms=wall, kernel_ms=kernel_ms,
               gap_ms=wall - kernel_ms, top_kernels=kernels, bwd_op_host_us=host_us(bwd_op),
               bwd_launch_host_us=host_us(bwd_launch_only), fwd_op_host_us=host_us(fwd_op), bwd_sync_free=ok,
               bwd_sync_error=why)
    print(f"{variant:15s} B{B} H{H} S{S} D{D}: wall {wall:.3f} ms, kernels {kernel_ms:.3f} ms, gap "
          f"{wall - kernel_ms:.3f} ms | host: bwd op {row['bwd_op_host_us']['median']:.0f} us, bwd launch "
          f"{row['bwd_launch_host_us']['median']:.0f} us, fwd op {row['fwd_op_host_us']['median']:.0f} us | "
          f"sync-free {ok}", flush=True)
    return row


def main(path: str) -> None:
    info = dict(torch=torch.__version__, cutlass_dsl=_version("nvidia-cutlass-dsl"),
                tvm_ffi=_version("apache-tvm-ffi"), device=torch.cuda.get_device_name(), python=sys.version.split()[0])
    rows = []
    for shape in SHAPES:
        try:
            rows.append(probe(*shape))
        except Exception as e:  # noqa: BLE001 - one failing shape must not lose the others
            rows.append({"variant": shape[0], "shape": shape[1:], "error": f"{type(e).__name__}: {e}"})
            print(f"{shape}: {type(e).__name__}: {e}", flush=True)
        torch.cuda.empty_cache()
    with open(path, "w") as f:
        json.dump({"info": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__.split("\n\n")[1])
    main(sys.argv[1])
