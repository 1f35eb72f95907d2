"""gallery/_bench.py on a CPU: rows in the benchmark schema, checked against float64, picked up by the page."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

GALLERY = Path(__file__).parents[2] / "gallery"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"gallery_{name}", GALLERY / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_cpu_run_writes_rows_the_page_reads(tmp_path):
    bench, render = _load("_bench"), _load("_render")
    out = tmp_path / "results" / "gallery_cpu.json"
    doc = bench.main(["--device", "cpu", "--quick", "--only", "causal,softcap,document", "--json", str(out)])
    assert [r["variant"] for r in doc["rows"]] == ["causal", "softcap", "document"]
    saved = json.loads(out.read_text())
    for row in saved["rows"]:
        assert row["name"].startswith(f"fwd gallery:{row['variant']} B1 S256 H2 D64 bf16")
        assert 0 < row["density"] <= 1 and row["flops"] > 0
        torch_result = row["results"]["flex-triton"]
        assert torch_result["status"] == "ok", torch_result
        assert torch_result["rel_l2"]["out"] < 1e-2 and torch_result["wall_ms"] > 0
        assert row["results"]["flexlab"]["status"] in ("n/a", "ok")  # no CUDA here: cute says why it cannot run
    assert saved["rows"][0]["density"] < 0.6 and saved["rows"][1]["density"] == 1.0
    results = render.latest_results(out.parent)
    assert {"causal", "softcap", "document"} <= set(results)
    assert "ms" in render._numbers_table(results["document"])
