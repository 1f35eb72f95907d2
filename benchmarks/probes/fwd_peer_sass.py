"""FA4's sm90 forward step beside ours, in SASS, on a machine without a GPU (not a test; a reading aid; the backward's
is `bwd_peer_sass.py`, whose set-up this shares).

    python benchmarks/probes/fwd_peer_sass.py causal 64            # B1·S16k, as the benchmark's S16k rows
    python benchmarks/probes/fwd_peer_sass.py dense 256 --batch 4 --seqlen 4096 --liveness

Ours is the kernel the launcher runs for that row on a 132-SM H200 (`runtime.launch.config_for`: persistent or
clustered as it would be; a causal mask through the code generator, at torch's default 128 block mask). For each
kernel this prints, per step loop (loops that issue HGMMA and exponentials): instructions, HGMMA, MUFU.EX2, and the
opcodes whose counts differ between the two kernels' loops, side by side.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
import tempfile
import warnings

from bwd_peer_sass import PEER_TARGET, live_registers, print_opcode_diff


def peer_ptx(variant: str, head_dim: int, batch: int, seqlen: int, dump: str) -> str:
    """PTX of FA4's sm90 forward kernel for a dense or causal problem of 16 heads (compiled under fake tensors)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    try:
        from flash_attn.cute import interface
    except ImportError as err:
        raise SystemExit(f"flash_attn.cute does not import ({err}); see bwd_peer_sass.py's docstring") from err
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = (torch.empty(batch, seqlen, 16, head_dim, dtype=torch.bfloat16, device="cuda") for _ in range(3))
        interface._flash_attn_fwd(q, k, v, causal=variant == "causal")
    found = glob.glob(os.path.join(dump, "*ForwardSm90*.ptx"))
    if not found:
        raise SystemExit("FA4 compiled no sm90 forward kernel (is FLASH_ATTENTION_ARCH honoured?)")
    with open(found[0]) as f:
        return f.read()


def our_ptx(variant: str, head_dim: int, batch: int, seqlen: int) -> tuple[str, object]:
    """(PTX, configuration) of the forward the launcher runs for this row on an H200."""
    import torch

    from flexlab.backends.cute import kernel_mods
    from flexlab.runtime.compile import forward_ptx
    from flexlab.runtime.launch import compile_key, config_for
    from flexlab.runtime.sparsity import kernel_block_mask

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    mask_mod = causal if variant == "causal" else None
    mods = kernel_mods(None, mask_mod)
    sparse = mask_mod is not None
    mean = None
    if sparse:
        import flexlab
        bm = flexlab.create_block_mask(causal, None, None, seqlen, seqlen, device="cpu")
        probe = config_for(head_dim, True, mods)
        mean = kernel_block_mask(bm, seqlen, probe.tile_m, probe.tile_n, seqlen).mean_kv_blocks
    cfg = config_for(head_dim, sparse, mods, None if sparse else seqlen, num_sms=132, mean_kv_blocks=mean)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return forward_ptx(compile_key(mods, torch.bfloat16, cfg, "sm_90a", sparse), mods), cfg


def step_loops(ptx: str) -> list:
    """Opcode counts of each loop that issues HGMMA and exponentials."""
    from flexlab.viz.compile_report import report_from_ptx
    rep = report_from_ptx(ptx)
    if rep.missing:
        raise SystemExit(f"needs {rep.missing}")
    return [ops for ops in rep.gemm_loops if ops.get("MUFU.EX2")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variant", choices=("dense", "causal"))
    ap.add_argument("head_dim", type=int, choices=(64, 128, 256))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--liveness", action="store_true", help="also registers live at once in the step loop")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as dump:
        os.environ.update(PEER_TARGET, CUTE_DSL_KEEP_PTX="1", CUTE_DSL_DUMP_DIR=dump)
        ours, cfg = our_ptx(args.variant, args.head_dim, args.batch, args.seqlen)
        ptx = {"flexlab": ours, "fa4": peer_ptx(args.variant, args.head_dim, args.batch, args.seqlen, dump)}
    print("flexlab:", cfg)
    columns = {}
    for name, text in ptx.items():
        for i, ops in enumerate(step_loops(text)):
            columns[f"{name}{i}"] = ops
            print(f"{name} loop {i}: {sum(ops.values())} instructions, "
                  f"{sum(n for op, n in ops.items() if op.startswith('HGMMA'))} HGMMA, {ops['MUFU.EX2']} MUFU.EX2")
        if args.liveness:
            live = live_registers(text)
            print(f"  live registers over its {live['instructions']}-instruction step loop: at most "
                  f"{live['gpr_max']} (mean {live['gpr_mean']}), uniform at most {live['uniform_max']}")
    print_opcode_diff(columns)


if __name__ == "__main__":
    sys.exit(main())
