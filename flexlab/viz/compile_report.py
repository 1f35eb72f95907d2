"""What the GPU would run, measured without a GPU: PTX -> ptxas -v -> cubin -> nvdisasm -> instruction mix.

CuTeDSL lowers a kernel to PTX on any machine; NVIDIA's assembler and disassembler then tell registers, spills,
barriers, static shared memory and the SASS instructions (HGMMA = wgmma on the tensor cores, MUFU = the special
function unit behind exp2/rcp/tanh). The tools are looked up on PATH, under CUDA_HOME, and inside the PyPI wheels
``nvidia-cuda-nvcc`` (ptxas) and ``nvidia-cuda-nvdisasm``; whatever is missing is reported, never raised.
"""
from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..runtime.ptxas import parse_ptxas_verbose  # noqa: F401  (part of this module's interface)

INSTALL_HINTS = {
    "ptxas": "pip install nvidia-cuda-nvcc",
    "nvdisasm": "pip install nvidia-cuda-nvdisasm",
    "cutlass": "pip install nvidia-cutlass-dsl==4.8.1",
}

#: Lines of PTX shown inline (a forward kernel has ~10k); the full text stays on the report object.
PTX_PREVIEW_LINES = 1500

# SASS opcode (before the first '.') -> the group the report shows.
SASS_GROUPS = {
    "HGMMA": "tensor core (HGMMA = wgmma)",
    "MUFU": "special function (MUFU: exp2, rcp, tanh, ...)",
    "FFMA": "fp32 math", "FMUL": "fp32 math", "FADD": "fp32 math", "FMNMX": "fp32 math", "FSEL": "fp32 math",
    "FSETP": "fp32 math", "F2FP": "conversion", "I2FP": "conversion", "F2I": "conversion", "I2F": "conversion",
    "UTMALDG": "TMA", "UTMASTG": "TMA", "UTMAPF": "TMA", "UBLKCP": "TMA",
    "LDS": "shared memory", "STS": "shared memory", "LDSM": "shared memory", "STSM": "shared memory",
    "LDG": "global memory", "STG": "global memory", "RED": "global memory", "ATOMG": "global memory",
    "BAR": "barriers and sync", "SYNCS": "barriers and sync", "WARPSYNC": "barriers and sync",
    "SHFL": "warp shuffle",
    "BRA": "control flow", "EXIT": "control flow", "RET": "control flow", "CALL": "control flow",
}


def _wheel_bin_dirs() -> list[Path]:
    """bin/ folders of NVIDIA's PyPI wheels (nvidia/cu13/bin, nvidia/cuda_nvcc/bin, ...)."""
    try:
        import nvidia  # namespace package shared by the nvidia-* wheels
    except ImportError:
        return []
    dirs = []
    for root in getattr(nvidia, "__path__", []):
        dirs.extend(sorted(Path(root).glob("*/bin")))
    return dirs


def find_tool(name: str) -> Optional[str]:
    """Path of a CUDA tool: PATH first, then $CUDA_HOME/bin, then the nvidia-* wheels; None when absent."""
    found = shutil.which(name)
    if found:
        return found
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            candidate = Path(os.environ[env]) / "bin" / name
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    for d in _wheel_bin_dirs():
        candidate = d / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


# ------------------------------------------------------------------------------------------------ parsing
_SASS_LINE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)")


def sass_opcodes(sass: str) -> Counter:
    """Full opcode (with modifiers, e.g. ``MUFU.EX2``) -> count, from ``nvdisasm`` output."""
    return Counter(m.group(1) for m in _SASS_LINE.finditer(sass))


_SASS_LABEL = re.compile(r"^(\.L_x_\d+):")
# A loop's back edge is a predicated branch; an unconditional backward BRA is the jump home from an out-of-line
# mbarrier retry stub that ptxas puts at the end of the kernel, not a loop (its "body" would span the kernel).
_SASS_BRANCH_TARGET = re.compile(r"@!?U?P\w+\s+BRA\b.*`\((\.L_x_\d+)\)")


def sass_gemm_loop(sass: str) -> Counter:
    """Full opcode -> count over the kernel's main loop: the smallest span between a label and a backward branch to
    it that issues HGMMA and, if any such loop does, exp2 (MUFU.EX2: an attention step, not a GEMM-only fragment of
    one). Empty when no loop issues HGMMA. What the loop costs per iteration decides a kernel's issue rate."""
    return main_loop(sass_gemm_loops(sass))


def main_loop(loops: list[Counter]) -> Counter:
    """`sass_gemm_loop` from already counted loops (`sass_gemm_loops`)."""
    with_exp2 = [body for body in loops if body.get("MUFU.EX2")]
    return min(with_exp2 or loops, key=lambda c: sum(c.values()), default=Counter())


def sass_gemm_loops(sass: str) -> list[Counter]:
    """Opcode counts of every loop that issues HGMMA, in program order (a masked forward has two: partial blocks,
    then full blocks). Loops end in a predicated backward branch."""
    return [loop_opcodes(body) for body in sass_gemm_loop_bodies(sass)]


def loop_opcodes(body: list[str]) -> Counter:
    """Full opcode -> count of one loop body from `sass_gemm_loop_bodies` (each instruction starts with its opcode)."""
    return Counter(ins.split()[0] for ins in body)


def exp2_before(body: list[str], instruction: str) -> tuple[int, int]:
    """(exponentials issued before the first `instruction` in a loop body, exponentials in the body): where ptxas
    put a GEMM wait inside a softmax (`FwdConfig.anchored_release`, `BwdConfig.anchored_wait`)."""
    exp2 = [i for i, ins in enumerate(body) if ins.startswith("MUFU.EX2")]
    at = body.index(instruction)
    return sum(1 for i in exp2 if i < at), len(exp2)


def variable_shifts_before_wait(body: list[str]) -> tuple[int, int]:
    """(left shifts by a register amount issued before a loop body's first GEMM wait, R2P after it): where a band
    mask's words (`kernels.mask.band_words`, two such shifts per row) and their bit tests sit around the wait for
    the scores (`mask_early` with `band_mask`)."""
    wait = next(i for i, ins in enumerate(body) if ins.startswith("WARPGROUP.DEPBAR"))
    shifts = [i for i, ins in enumerate(body) if re.match(r"SHF\.L\.U32 R\d+, R\d+(\.reuse)?, R\d+", ins)]
    return sum(1 for i in shifts if i < wait), sum(1 for ins in body[wait:] if ins.startswith("R2P"))


def sass_gemm_loop_bodies(sass: str) -> list[list[str]]:
    """The instructions (opcode and operands, predicate dropped) of every loop that issues HGMMA, in issue order: where
    ptxas placed a wait or a barrier inside a step, which opcode counts cannot say."""
    body_text: list[str] = []
    labels: dict[str, int] = {}
    loops: list[list[str]] = []
    for line in sass.splitlines():
        label = _SASS_LABEL.match(line.strip())
        if label:
            labels[label.group(1)] = len(body_text)
            continue
        m = _SASS_LINE.search(line)
        if not m:
            continue
        body_text.append(line[m.start(1):].split(";")[0].strip())
        target = _SASS_BRANCH_TARGET.search(line)
        if target and target.group(1) in labels:  # a label already seen: a backward branch
            body = body_text[labels[target.group(1)]:]
            if any(ins.startswith("HGMMA") for ins in body):
                loops.append(body)
    return loops


def sass_groups(opcodes: Counter) -> dict[str, int]:
    groups: Counter = Counter()
    for op, n in opcodes.items():
        groups[SASS_GROUPS.get(op.split(".")[0], "other")] += n
    return dict(groups.most_common())


def ptx_counts(ptx: str) -> dict[str, int]:
    """A few PTX instructions worth seeing before assembly (wgmma issue, exp2, TMA copies)."""
    return {"wgmma.mma_async": ptx.count("wgmma.mma_async"), "ex2.approx": ptx.count("ex2.approx"),
            "cp.async.bulk.tensor": ptx.count("cp.async.bulk.tensor"), "lines": ptx.count("\n")}


# ------------------------------------------------------------------------------------------------ report
@dataclass
class CompileReport:
    """Compile-only facts about one kernel; ``missing``/``errors`` say what could not be measured and why."""

    kernel: str
    arch: str = "sm_90a"
    compile_seconds: Optional[float] = None      # CuTeDSL trace + lowering to PTX
    ptxas_seconds: Optional[float] = None
    registers: Optional[int] = None
    spill_store_bytes: Optional[int] = None
    spill_load_bytes: Optional[int] = None
    stack_bytes: Optional[int] = None
    barriers: Optional[int] = None
    smem_static_bytes: Optional[int] = None
    smem_dynamic_bytes: Optional[int] = None     # what the launch requests (from the kernel configuration)
    ptx: dict = field(default_factory=dict)
    opcodes: Counter = field(default_factory=Counter)
    loop_opcodes: Counter = field(default_factory=Counter)  # the main (HGMMA) loop's body, `sass_gemm_loop`
    gemm_loops: list = field(default_factory=list)  # every HGMMA loop's opcodes, in program order
    gemm_loop_bodies: list = field(default_factory=list)  # the same loops' instructions in issue order
    missing: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    ptx_text: Optional[str] = field(default=None, repr=False)

    @property
    def hgmma(self) -> int:
        return sum(n for op, n in self.opcodes.items() if op.startswith("HGMMA"))

    @property
    def mufu(self) -> dict[str, int]:
        return {op: n for op, n in sorted(self.opcodes.items()) if op.startswith("MUFU")}

    @property
    def smem_bytes(self) -> Optional[int]:
        if self.smem_static_bytes is None and self.smem_dynamic_bytes is None:
            return None
        return (self.smem_static_bytes or 0) + (self.smem_dynamic_bytes or 0)

    def rows(self) -> list[tuple[str, str]]:
        def fmt(v, unit=""):
            return "—" if v is None else f"{v:,}{unit}"

        rows = [("kernel", self.kernel), ("arch", self.arch),
                ("compile (CuTeDSL → PTX)", "—" if self.compile_seconds is None else f"{self.compile_seconds:.2f} s"),
                ("ptxas", "—" if self.ptxas_seconds is None else f"{self.ptxas_seconds:.2f} s"),
                ("registers / thread", fmt(self.registers)),
                ("spills (store / load)", f"{fmt(self.spill_store_bytes, ' B')} / {fmt(self.spill_load_bytes, ' B')}"),
                ("stack frame", fmt(self.stack_bytes, " B")), ("named barriers", fmt(self.barriers)),
                ("shared memory / CTA", f"{fmt(self.smem_bytes, ' B')} (static {fmt(self.smem_static_bytes, ' B')}, "
                                        f"dynamic {fmt(self.smem_dynamic_bytes, ' B')})")]
        if self.opcodes:
            rows.append(("HGMMA (wgmma) instructions", f"{self.hgmma:,}"))
            rows.append(("MUFU instructions", ", ".join(f"{op} {n}" for op, n in self.mufu.items()) or "0"))
            rows.append(("SASS instructions", f"{sum(self.opcodes.values()):,}"))
        if self.loop_opcodes:
            loop_hgmma = sum(n for op, n in self.loop_opcodes.items() if op.startswith("HGMMA"))
            rows.append(("main loop (SASS, per iteration)",
                         f"{sum(self.loop_opcodes.values()):,} instructions, {loop_hgmma} HGMMA"))
        if self.ptx:
            rows.append(("PTX", ", ".join(f"{k} {v:,}" for k, v in self.ptx.items())))
        return rows

    def _repr_html_(self) -> str:
        body = "".join(f"<tr><th style='text-align:left'>{html.escape(k)}</th><td style='text-align:left'>"
                       f"{html.escape(v)}</td></tr>" for k, v in self.rows())
        mix = ""
        if self.opcodes:
            groups = sass_groups(self.opcodes)
            mix = ("<table class='flexlab-sass-mix'><caption style='text-align:left'>SASS instruction mix</caption>"
                   + "".join(f"<tr><td style='text-align:left'>{html.escape(g)}</td><td>{n:,}</td></tr>"
                             for g, n in groups.items()) + "</table>")
        ptx = ""
        if self.ptx_text:
            lines = self.ptx_text.splitlines()
            shown = "\n".join(lines[:PTX_PREVIEW_LINES])
            more = (f"\n… {len(lines) - PTX_PREVIEW_LINES:,} more lines (CompileReport.ptx_text has all)"
                    if len(lines) > PTX_PREVIEW_LINES else "")
            ptx = (f"<details><summary>PTX ({len(lines):,} lines)</summary><pre style='max-height:400px;"
                   f"overflow:auto;font-size:11px'>{html.escape(shown + more)}</pre></details>")
        notes = "".join(f"<div style='color:#a15c00'>missing: {html.escape(m)}</div>" for m in self.missing)
        notes += "".join(f"<div style='color:#b00020'>{html.escape(e)}</div>" for e in self.errors)
        return (f"<div class='flexlab-compile-report' data-testid='flexlab-compile-report'>{notes}"
                f"<div style='display:flex;gap:2em;align-items:flex-start'><table>{body}</table>{mix}</div>{ptx}</div>")


def _missing(name: str) -> str:
    return f"{name} (install with `{INSTALL_HINTS[name]}`)"


def report_from_ptx(ptx: str, *, kernel: str = "kernel", arch: str = "sm_90a", compile_seconds: Optional[float] = None,
                    smem_dynamic_bytes: Optional[int] = None, timeout_s: float = 300.0) -> CompileReport:
    """Assemble ``ptx`` with ``ptxas -v``, disassemble the cubin with ``nvdisasm`` and collect the numbers."""
    rep = CompileReport(kernel=kernel, arch=arch, compile_seconds=compile_seconds,
                        smem_dynamic_bytes=smem_dynamic_bytes, ptx=ptx_counts(ptx), ptx_text=ptx)
    ptxas = find_tool("ptxas")
    if ptxas is None:
        rep.missing.append(_missing("ptxas"))
        return rep
    with tempfile.TemporaryDirectory(prefix="flexlab-report-") as tmp:
        src, cubin = Path(tmp) / "kernel.ptx", Path(tmp) / "kernel.cubin"
        src.write_text(ptx)
        t0 = time.perf_counter()
        try:
            res = subprocess.run([ptxas, f"-arch={arch}", "-v", str(src), "-o", str(cubin)], capture_output=True,
                                 text=True, timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired) as err:
            rep.errors.append(f"ptxas failed to run: {err}")
            return rep
        rep.ptxas_seconds = time.perf_counter() - t0
        if res.returncode != 0:
            rep.errors.append(f"ptxas exited with {res.returncode}: {(res.stderr or res.stdout).strip()[:2000]}")
            return rep
        for key, value in parse_ptxas_verbose(res.stdout + res.stderr).items():
            setattr(rep, key, value)
        nvdisasm = find_tool("nvdisasm")
        if nvdisasm is None:
            rep.missing.append(_missing("nvdisasm"))
            return rep
        try:
            dis = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired) as err:
            rep.errors.append(f"nvdisasm failed to run: {err}")
            return rep
        if dis.returncode != 0:
            rep.errors.append(f"nvdisasm exited with {dis.returncode}: {dis.stderr.strip()[:2000]}")
            return rep
        rep.opcodes = sass_opcodes(dis.stdout)
        rep.gemm_loop_bodies = sass_gemm_loop_bodies(dis.stdout)
        rep.gemm_loops = [loop_opcodes(body) for body in rep.gemm_loop_bodies]
        rep.loop_opcodes = main_loop(rep.gemm_loops)
    return rep


# ------------------------------------------------------------------------------------------------ our kernel
_FORWARD_REPORTS: dict = {}


def forward_kernel_report(score_mod=None, mask_mod=None, *, dtype: str = "bfloat16", head_dim: int = 128,
                          block_sparse: Optional[bool] = None, arch: str = "sm_90a") -> CompileReport:
    """Compile flexlab's Hopper forward kernel with these mods inlined (no GPU needed) and report on it.

    Cached per generated-source hash and configuration: sliding a captured scalar does not recompile.
    """
    import importlib.util

    kernel = f"flexlab forward, {dtype}, head_dim {head_dim}"
    if importlib.util.find_spec("cutlass") is None:
        rep = CompileReport(kernel=kernel, arch=arch)
        rep.missing.append(_missing("cutlass"))
        return rep
    key, mods, cfg = _forward_key(score_mod, mask_mod, dtype, head_dim, block_sparse, arch)
    hit = _FORWARD_REPORTS.get(key)
    if hit is not None:
        return hit
    rep = CompileReport(kernel=kernel, arch=arch, smem_dynamic_bytes=cfg.smem_bytes())
    t0 = time.perf_counter()
    try:
        from ..runtime.compile import forward_ptx
        ptx = forward_ptx(key, mods)
    except Exception as err:                                       # noqa: BLE001 - shown in the report
        rep.errors.append(f"compiling the forward kernel failed: {type(err).__name__}: {str(err)[:2000]}")
        return rep
    rep = report_from_ptx(ptx, kernel=kernel, arch=arch, compile_seconds=time.perf_counter() - t0,
                          smem_dynamic_bytes=cfg.smem_bytes())
    _FORWARD_REPORTS[key] = rep
    return rep


def _forward_key(score_mod, mask_mod, dtype: str, head_dim: int, block_sparse: Optional[bool], arch: str):
    """(compile key, kernel mods, config) exactly as backend="cute" would build them for a launch with these mods
    (UnsupportedModError from the code generator names the user's line). TVM-FFI is off: we want PTX, not a .so.
    No sequence length or GPU is known here: where tiles are short, and under a block mask without a score_mod at
    every length up to D=128, the launcher runs this kernel as persistent CTAs with dynamic tiles
    (`runtime.launch.runs_dynamic`), the same code in a tile loop."""
    import dataclasses

    import torch

    from ..backends import cute as backend
    from ..runtime import launch

    mods = backend.kernel_mods(score_mod, mask_mod)
    sparse = (mods.mask_mod is not None) if block_sparse is None else bool(block_sparse)
    # partial blocks read stored bits where the mask_mod reads captured tensors (`runtime.mask_bits`)
    cfg = launch.config_for(head_dim, sparse, mods, mask_bits=sparse and backend.stores_mask_bits(score_mod, mask_mod))
    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    key = dataclasses.replace(launch.compile_key(mods, torch_dtype, cfg, arch, sparse), tvm_ffi=False)
    return key, mods, cfg
