"""`ptxas -v` on PTX text, no GPU needed: the one place that runs it and reads its numbers.

Used by the compile report (`runtime.compile.compile_report`, `viz.compile_report`) and by the compile-only kernel
tests, which check registers, spills and serialized wgmma pipelines without a GPU.
"""
from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

_PATTERNS = {
    "registers": r"Used (\d+) registers",
    "barriers": r"used (\d+) barriers",
    "stack_bytes": r"(\d+) bytes stack frame",
    "spill_store_bytes": r"(\d+) bytes spill stores",
    "spill_load_bytes": r"(\d+) bytes spill loads",
    "smem_static_bytes": r"(\d+) bytes smem",
}


_SUMMED = ("spill_store_bytes", "spill_load_bytes")  # over every function of the module; the rest: the largest


def parse_ptxas_verbose(text: str) -> dict:
    """Numbers from ``ptxas -v``: registers, barriers, spills, stack, static shared memory."""
    out: dict = {}
    for key, pat in _PATTERNS.items():
        found = [int(x) for x in re.findall(pat, text)]
        if found:
            out[key] = sum(found) if key in _SUMMED else max(found)
    out.setdefault("barriers", 0)
    out.setdefault("smem_static_bytes", 0)
    return out


def assemble(ptx: str, arch: str = "sm_90a", ptxas: str = "ptxas", timeout_s: float | None = None) -> tuple[dict, str]:
    """(`parse_ptxas_verbose` numbers, ptxas's whole log) for `ptx`; raises CalledProcessError if ptxas rejects it."""
    with tempfile.TemporaryDirectory(prefix="flexlab-ptxas-") as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        res = subprocess.run([ptxas, f"-arch={arch}", "-v", str(src), "-o", str(Path(tmp) / "kernel.cubin")],
                             capture_output=True, text=True, check=True, timeout=timeout_s)
    log = res.stdout + res.stderr
    return parse_ptxas_verbose(log), log
