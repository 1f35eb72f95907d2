"""FA4's sm90 backward step beside ours, in SASS, on a machine without a GPU (not a test; a reading aid).

    python benchmarks/probes/bwd_peer_sass.py causal 128
    python benchmarks/probes/bwd_peer_sass.py dense 128 --json step_loops.json
    python benchmarks/probes/bwd_peer_sass.py sliding_window 128   # the benchmark's window of 1024 keys
    python benchmarks/probes/bwd_peer_sass.py causal 128 --liveness  # and registers live at once in the step loop

flash-attn-4 compiles its kernels for sm_90a under torch's fake tensors when told the target
(FLASH_ATTENTION_ARCH, CUTE_DSL_ARCH, set here), so its main backward kernel's PTX can be assembled and disassembled
like ours (`flexlab.viz.compile_report`). For each kernel this prints, per step loop (the loops that issue HGMMA and
exponentials): instructions, HGMMA, MUFU.EX2, shared-memory loads, and how many exponentials come before the first
full wgmma wait (the wait for dP: what runs beside that GEMM); then the opcodes whose counts differ between the
loops. FA4 is a peer, never a dependency: it is imported from wherever it is installed
(`pip install --target DIR --no-deps flash-attn-4 quack-kernels apache-tvm-ffi triton` and PYTHONPATH=DIR is enough).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile

# FA4 picks its kernel family from these, not from a GPU; the DSL reads its target once, when cutlass is first
# imported, so they are set before anything imports it (our kernels are compiled for sm_90a either way).
PEER_TARGET = {"FLASH_ATTENTION_ARCH": "sm_90", "CUTE_DSL_ARCH": "sm_90a", "FLASH_ATTENTION_NUM_SMS": "132"}


def step_loops(ptx: str) -> dict:
    """Registers, spills and a summary of each step loop of one kernel's PTX."""
    from flexlab.viz.compile_report import exp2_before, report_from_ptx
    rep = report_from_ptx(ptx)
    if rep.missing:
        raise SystemExit(f"needs {rep.missing}")
    loops = []
    for body, ops in zip(rep.gemm_loop_bodies, rep.gemm_loops):
        if not ops.get("MUFU.EX2"):
            continue
        full_wait = "WARPGROUP.DEPBAR.LE gsb0, 0x0"
        before, exps = exp2_before(body, full_wait) if full_wait in body else (None, ops["MUFU.EX2"])
        loops.append({"instructions": sum(ops.values()),
                      "hgmma": sum(n for op, n in ops.items() if op.startswith("HGMMA")),
                      "exp2": exps, "exp2_before_dp_wait": before,
                      "lds": sum(n for op, n in ops.items() if op.startswith("LDS")),
                      "top": ops.most_common(12), "opcodes": dict(ops)})
    return {"registers": rep.registers, "spill_store_bytes": rep.spill_store_bytes, "loops": loops}


def print_opcode_diff(columns: dict) -> None:
    """Print the opcodes whose counts differ between step loops ({column name: opcode counts}), side by side: where
    two steps of equal GEMM work spend their other instructions."""
    names = list(columns)
    print("opcodes that differ".ljust(34), *(n.rjust(9) for n in names))
    for op in sorted(set().union(*columns.values())):
        counts = [columns[n].get(op, 0) for n in names]
        if len(set(counts)) > 1:
            print(op.ljust(34), *(str(c).rjust(9) for c in counts))


def live_registers(ptx: str) -> dict:
    """Live registers per instruction of the innermost step loop (ptxas, then `nvdisasm -lrm count`): the most and
    the mean of general registers live at once, and the most uniform ones. Where two kernels' steps differ in
    schedule, this says whether register pressure can be why."""
    import re
    import statistics
    import subprocess

    from flexlab.viz.compile_report import find_tool
    ptxas, nvdisasm = find_tool("ptxas"), find_tool("nvdisasm")
    if ptxas is None or nvdisasm is None:
        raise SystemExit("--liveness needs ptxas and nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        subprocess.run([ptxas, "-arch=sm_90a", src, "-o", cubin], check=True)
        text = subprocess.run([nvdisasm, "-lrm", "count", "-c", cubin], capture_output=True, text=True,
                              check=True).stdout
    ins, labels = [], {}  # (instruction, live GPRs, live uniform registers); label -> index
    for line in text.splitlines():
        if m := re.match(r"^\s*(\.L_x_\d+):", line):
            labels[m.group(1)] = len(ins)
        elif m := re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?);\s*//\s*\|\s*(\d*)\s*\|\s*\d*\s*\|\s*(\d*)\s*\|", line):
            ins.append((m.group(1).strip(), int(m.group(2) or 0), int(m.group(3) or 0)))
    loops = []
    for end, (text_i, _, _) in enumerate(ins):  # a step loop: a backward branch over HGMMA and exponentials
        m = re.search(r"BRA `\((\.L_x_\d+)\)", text_i)
        start = labels.get(m.group(1)) if m else None
        if start is None or start >= end:
            continue
        body = ins[start:end + 1]
        if sum(t.startswith("HGMMA") for t, _, _ in body) >= 8 and any("MUFU.EX2" in t for t, _, _ in body):
            loops.append(body)
    # the shortest: the step loop itself, not a loop over tiles or heads around it, nor a wait's slow path placed
    # after the kernel's end that branches back into it
    body = min(loops, key=len)
    gprs = [g for _, g, _ in body]
    return {"instructions": len(body), "gpr_max": max(gprs), "gpr_mean": round(statistics.mean(gprs), 1),
            "uniform_max": max(u for _, _, u in body)}


def peer_ptx(variant: str, head_dim: int, seqlen: int, dump: str) -> str:
    """PTX of FA4's main sm90 backward kernel for a dense, causal or sliding-window B1·H16 problem (the window as the
    benchmark spells it for FA4); the DSL keeps it in `dump` (`CUTE_DSL_DUMP_DIR`, set by `main` before cutlass is
    imported)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    try:
        from flash_attn.cute import interface
    except ImportError as err:
        raise SystemExit(f"flash_attn.cute does not import ({err}); see this script's docstring") from err
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v, out, dout = (torch.empty(1, seqlen, 16, head_dim, dtype=torch.bfloat16, device="cuda")
                              for _ in range(5))
        lse = torch.empty(1, 16, seqlen, dtype=torch.float32, device="cuda")
        window = {}
        if variant == "sliding_window":
            window = dict(zip(("window_size_left", "window_size_right"), fa4_window()))
        interface._flash_attn_bwd(q, k, v, out, dout, lse, causal=variant != "dense", **window)
    found = glob.glob(os.path.join(dump, "*BackwardSm90*.ptx"))
    if not found:
        raise SystemExit("FA4 compiled no sm90 backward kernel (is FLASH_ATTENTION_ARCH honoured?)")
    with open(found[0]) as f:
        return f.read()


def fa4_window() -> tuple[int, int]:
    from flexlab.bench.cases import SLIDING_WINDOW
    return SLIDING_WINDOW - 1, 0  # (the gallery's window counts the query itself, FA4's left window does not)


def our_ptx(variant: str, head_dim: int) -> str:
    """PTX of the main backward kernel the launcher runs for this variant (masked: torch's default 128 block mask)."""
    from flexlab.codegen import generate
    from flexlab.kernels.bwd_launch import compile_main, config_for, main_key

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    mask_mod = None
    if variant == "causal":
        mask_mod = causal
    elif variant == "sliding_window":
        from flexlab.bench.cases import SLIDING_WINDOW
        from gallery.sliding_window import generate_sliding_window
        mask_mod = generate_sliding_window(SLIDING_WINDOW)
    g = generate(None, mask_mod, fastmath=True) if mask_mod is not None else None
    block_sparse = g is not None
    cfg = config_for(head_dim, False, g, False, 128 if block_sparse else None)
    key = main_key(g, g.kernel_aux_tensors() if g is not None else (), [], "bfloat16", cfg, block_sparse, False)
    with tempfile.TemporaryDirectory() as dump:
        compiled = compile_main(key, g.module() if g is not None else None,
                                options=f" --keep-ptx --dump-dir {dump}")
        return compiled.__ptx__


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variant", choices=("dense", "causal", "sliding_window"))
    ap.add_argument("head_dim", type=int, choices=(64, 128))
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--json", help="also write the summaries here")
    ap.add_argument("--liveness", action="store_true", help="also registers live at once in the step loop")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as dump:
        os.environ.update(PEER_TARGET, CUTE_DSL_KEEP_PTX="1", CUTE_DSL_DUMP_DIR=dump)
        ptx = {"flexlab": our_ptx(args.variant, args.head_dim),
               "fa4": peer_ptx(args.variant, args.head_dim, args.seqlen, dump)}
    result = {name: step_loops(text) for name, text in ptx.items()}
    if args.liveness:
        for name, text in ptx.items():
            result[name]["liveness"] = live_registers(text)
    for name, rec in result.items():
        print(f"{name}: {rec['registers']} registers, {rec['spill_store_bytes']} spill bytes")
        for i, loop in enumerate(rec["loops"]):
            print(f"  loop {i}: {loop['instructions']} instructions, {loop['hgmma']} HGMMA, {loop['lds']} LDS, "
                  f"{loop['exp2_before_dp_wait']} of {loop['exp2']} exponentials before the dP wait")
        if "liveness" in rec:
            live = rec["liveness"]
            print(f"  live registers over a {live['instructions']}-instruction step loop: at most {live['gpr_max']} "
                  f"(mean {live['gpr_mean']}), uniform at most {live['uniform_max']}")
    print_opcode_diff({f"{name}{i}": loop["opcodes"] for name, rec in result.items()
                       for i, loop in enumerate(rec["loops"])})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"variant": args.variant, "head_dim": args.head_dim, **result}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
