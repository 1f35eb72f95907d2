"""The forward sweep's watchdog on the CPU: a hanging, a crashing and a CUDA-faulting variant are each reported and
dropped for later rows, and everything else is still measured and tabulated (fake timing child, no GPU)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "probes", "fwd_perf_sweep.py")


@pytest.mark.slow
def test_selftest_reports_hang_crash_and_cuda_fault(tmp_path):
    out = tmp_path / "sweep.json"
    res = subprocess.run([sys.executable, SCRIPT, str(out), "--selftest", "--case-timeout", "20", "--run-timeout", "3",
                          "--budget", "120"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads(out.read_text())
    first, second = (r["results"] for r in doc["rows"])
    assert first["-overlap"]["status"] == "timeout" and "hang" in first["-overlap"]["message"]
    assert first["persistent"]["status"] == "crashed"
    assert first["stages3"]["status"] == "error"
    assert {second[v]["status"] for v in ("-overlap", "persistent", "stages3")} == {"dropped"}
    assert first["baseline"]["status"] == "ok" and second["combo"]["status"] == "ok"
    assert "Candidates" in res.stdout and "Ablations" in res.stdout
    # the interleaved rounds of a row reach the JSON and the report (FA4 as a ratio of times, candidates as speedups)
    assert doc["rows"][1]["interleaved"]["combo"]["kernel_ms"] == 0.8
    assert doc["interleaved_summary"]["combo"]["geomean_speedup"] == pytest.approx(1.25)
    assert doc["interleaved_summary"]["fa4"]["geomean_speedup"] == pytest.approx(0.9)  # FA4's time / the baseline's
    assert "Interleaved rounds" in res.stdout and " | x1.250 | 0.900" in res.stdout
