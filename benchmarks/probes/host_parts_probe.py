"""H200 probe: where one warm forward call's host time goes, layer by layer, next to torch's own attention calls.

Usage: python benchmarks/probes/host_parts_probe.py OUT.json   (not a test; run on the GPU machine)

Each entry is timed two ways on a tiny shape (B=1, H=2, S=512, D=128, bf16; the kernels take a few microseconds):

  * idle:   the GPU has drained before every call (`torch.cuda.synchronize()` first), median of single calls;
  * queued: 200 calls issued back to back after a drain, total host time / 200 (what a training or serving loop
            sees: the kernels queue behind the host, the host never waits).

Layers, innermost first: the two output allocations alone; the compiled kernel called directly with preallocated
outputs (TVM-FFI argument conversion + driver launch); `runtime.launch.forward`; `flexlab.flex_attention(...,
backend="cute")` and `backend="auto"`; the same with a causal BlockMask and with a soft-cap score_mod. Each
`flex_attention` entry runs warm (its signature seen before) and, as "full path", with the warm-call cache emptied
before every call (validation, backend choice and launch planning each time); without `return_lse` the kernel
writes no LSE and only O is allocated. The warm entries' parts are timed alone too: the bound launch
(`runtime.launch.BoundForward`) of the dense, soft-cap and causal calls, the soft-cap's capture check, and the call
signature. For scale: SDPA (cuDNN and flash
backends) and torch's compiled flex_attention on the same inputs.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bwd_host_probe import host_us  # noqa: E402  (idle: the GPU drained before each call)

REPEATS = 300
QUEUED_CALLS = 200


def queued_us(fn) -> float:
    runs = []
    for _ in range(7):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(QUEUED_CALLS):
            fn()
        runs.append((time.perf_counter() - t0) * 1e6 / QUEUED_CALLS)
    torch.cuda.synchronize()
    return statistics.median(runs)


def entries(B=1, H=2, S=512, D=128):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    import flexlab
    import flexlab.api as api
    from flexlab.backends import cute
    from flexlab.runtime import launch
    from flexlab.runtime.schedule import heads_per_group

    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    causal = flexlab.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, S, S, device="cuda")

    def softcap(score, b, h, qi, ki):
        return 20.0 * torch.tanh(score / 20.0)

    launch.forward(q, k, v)
    fn, key = next(iter(launch._FAST.values()))
    counter = launch.tile_counter(q.device) if key.config.dynamic_tiles else None
    out = torch.empty_like(q)
    lse = torch.empty((B, H, S), device="cuda", dtype=torch.float32)
    group = heads_per_group(S, D, 2, 1, B * H, False)
    compiled_flex = torch.compile(torch_flex)

    def sdpa(backend):
        def call():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v)
        return call

    # The warm entries' own parts (`backends.cute.WarmForward`): the capture check and the bound launch alone.
    flexlab.flex_attention(q, k, v)
    flexlab.flex_attention(q, k, v, score_mod=softcap)
    flexlab.flex_attention(q, k, v, block_mask=causal)
    warm = {w.score_mod or w.mask_mod or "dense": w for w in api._WARM.values()}
    soft, dense, masked = warm[softcap], warm["dense"], warm[causal.mask_mod]

    parts = {
        "dense: bound launch": lambda: dense.bound(q, k, v, None),
        "softcap: bound launch": lambda: soft.bound(q, k, v, None),
        "softcap: capture check": lambda: cute._mods_state(softcap, None) != soft.lowered.state,
        "softcap: warm call": lambda: soft(q, k, v, None),
        "causal: bound launch": lambda: masked.bound(q, k, v, None),
        "signature": lambda: api._signature(q, k, v, softcap, None, None, False, False, "auto"),
    }
    return parts | {
        "torch.empty x2": lambda: (torch.empty((B, H, S, D), dtype=q.dtype, device=q.device),
                                   torch.empty((B, H, S), dtype=torch.float32, device=q.device)),
        "kernel call (preallocated)": lambda: fn(q, k, v, out, lse, D ** -0.5, 1, group, None, None, counter, (), ()),
        "launch.forward": lambda: launch.forward(q, k, v),
        "cute backend forward": lambda: cute.flex_attention_forward(q, k, v, None, None, None, False),
        "flex_attention cute": lambda: flexlab.flex_attention(q, k, v, backend="cute"),
        "flex_attention cute, full path": lambda: (api._WARM.clear(), flexlab.flex_attention(q, k, v, backend="cute")),
        "flex_attention cute, return_lse": lambda: flexlab.flex_attention(q, k, v, return_lse=True, backend="cute"),
        "flex_attention auto": lambda: flexlab.flex_attention(q, k, v),
        "flex_attention causal mask": lambda: flexlab.flex_attention(q, k, v, block_mask=causal),
        "flex_attention causal mask, full path": lambda: (api._WARM.clear(),
                                                          flexlab.flex_attention(q, k, v, block_mask=causal)),
        "flex_attention softcap": lambda: flexlab.flex_attention(q, k, v, score_mod=softcap),
        "flex_attention softcap, full path": lambda: (api._WARM.clear(),
                                                      flexlab.flex_attention(q, k, v, score_mod=softcap)),
        "sdpa cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa flash": sdpa(SDPBackend.FLASH_ATTENTION),
        "torch flex (compiled)": lambda: compiled_flex(q, k, v),
        "torch flex causal (compiled)": lambda: compiled_flex(q, k, v, block_mask=causal),
    }


def main(path: str) -> None:
    rows = []
    for name, fn in entries().items():
        try:
            for _ in range(50):
                fn()
            rec = dict(entry=name, idle_us=host_us(fn, REPEATS)["median"], queued_us=queued_us(fn))
        except Exception as e:  # noqa: BLE001 - one missing peer must not lose the rest
            rec = dict(entry=name, error=f"{type(e).__name__}: {str(e)[:300]}")
        rows.append(rec)
        if "error" in rec:
            print(f"{name:30s} {rec['error']}", flush=True)
        else:
            print(f"{name:30s} idle {rec['idle_us']:7.1f} us   queued {rec['queued_us']:7.1f} us", flush=True)
    with open(path, "w") as f:
        json.dump(dict(rows=rows, torch=torch.__version__, shape="B1 H2 S512 D128 bf16"), f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__.split("\n\n")[1])
    main(sys.argv[1])
