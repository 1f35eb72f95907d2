"""Tables and JSON of the benchmark: best-peer choice, formatting, merging, files."""
import gzip
import json
from pathlib import Path

import pytest

from flexlab.bench.report import (best_peer, format_document, format_markdown, format_row, median_interval,
                                  merge_documents, paired_interval, paired_speedup, read_json, result_files, standing,
                                  summarize_row, write_json)

RESULTS = Path(__file__).parents[2] / "benchmarks" / "results"


def _row(name="fwd causal B1 S4k H16 D128 bf16", **results):
    rec = {"name": name, "density": 0.5, "flops": 1e12, "results": results}
    summarize_row(rec)
    return rec


def _ok(ms, tflops=100.0):
    return {"status": "ok", "wall_ms": ms, "kernel_ms": ms * 0.9, "tflops": tflops, "tflops_kernel": tflops * 1.1,
            "roof_pct": tflops / 7.9, "rel_l2": {"out": 2e-3}}


def test_best_peer_ignores_flexlab_wrong_and_suspect_results():
    rec = _row(flexlab=_ok(0.1), sdpa=_ok(0.5), fa4={**_ok(0.2), "status": "wrong"},
               **{"flex-triton": {**_ok(0.3), "status": "suspect"}, "flex-flash": _ok(0.4)})
    assert best_peer(rec["results"]) == ("flex-flash", 0.4)
    assert rec["flexlab_speedup_vs_best_peer"] == 0.4 / 0.1
    assert _row(sdpa={"status": "n/a", "error": "x"})["best_peer"] is None


def test_deterministic_mode_is_priced_against_flexlab_and_is_no_peer():
    rec = _row("fwd+bwd causal B1 S4k H16 D128 bf16", flexlab=_ok(2.0), fa4=_ok(1.5),
               **{"flexlab-deterministic": _ok(0.5)})
    assert rec["best_peer"] == "fa4"  # the deterministic flexlab is faster here, yet it is not a peer
    assert rec["deterministic_cost"] == 0.5 / 2.0
    assert "deterministic mode: 0.25x" in format_document({"schema": 1, "environment": {}, "settings": {},
                                                           "matmul_ceiling_tflops": 790, "rows": [rec]})
    assert _row(flexlab=_ok(1.0))["deterministic_cost"] is None


def test_text_and_markdown_tables(tmp_path):
    rec = _row(flexlab={"status": "n/a", "error": "no kernel"}, sdpa=_ok(0.479, 574.4),
               fa4={"status": "error", "error": "RuntimeError: boom"})
    doc = {"schema": 1, "environment": {"gpu": "H200", "torch": "2.11"}, "settings": {},
           "matmul_ceiling_tflops": 790.0, "rows": [rec]}
    text = format_document(doc)
    assert "sdpa" in text and "0.479" in text and "574.4" in text and "RuntimeError: boom" in text
    assert "best peer: sdpa 0.479 ms; flexlab: no result" in text
    md = format_markdown(doc)
    line = md.splitlines()[2]
    assert line.startswith("| fwd causal B1 S4k") and "0.479 (574)" in line and "| n/a |" in line
    assert "| error |" in line and "| sdpa |" in line and "73%" in line
    path = tmp_path / "out" / "r.json"
    write_json(doc, path)
    assert json.loads(path.read_text()) == doc


def test_merge_unions_backends_of_a_row_and_keeps_order():
    skipped = {"name": "b", "density": None, "flops": None, "skipped": "time budget spent", "results": {}}
    first = {"environment": {"date_utc": "t1"}, "rows": [_row("a", sdpa=_ok(1.0)), skipped]}
    second = {"environment": {"date_utc": "t2"},
              "rows": [_row("b", sdpa=_ok(2.0)), _row("c", sdpa=_ok(3.0)), _row("a", flexlab=_ok(0.5))]}
    merged = merge_documents([first, second])
    assert [r["name"] for r in merged["rows"]] == ["a", "b", "c"]
    a = merged["rows"][0]
    assert set(a["results"]) == {"sdpa", "flexlab"} and a["flexlab_speedup_vs_best_peer"] == 2.0
    assert a["results"]["sdpa"]["measured_utc"] == "t1" and a["results"]["flexlab"]["measured_utc"] == "t2"
    assert merged["rows"][1]["results"]["sdpa"]["wall_ms"] == 2.0
    assert [e["date_utc"] for e in merged["runs"]] == ["t1", "t2"]
    assert "not run: time budget spent" in format_document({**merged, "rows": [skipped]})


def test_kernel_table_compares_kernel_times():
    # Wall clock: flexlab 1.0 ms against FA4's 0.8 (0.80x); kernels: flexlab 0.6 against 0.72 (1.20x).
    rec = _row(flexlab={**_ok(1.0), "kernel_ms": 0.6}, fa4={**_ok(0.8), "kernel_ms": 0.72})
    doc = {"schema": 1, "environment": {}, "settings": {}, "matmul_ceiling_tflops": 790.0, "rows": [rec]}
    assert "| 0.80x |" in format_markdown(doc, "wall_ms").splitlines()[2]
    assert "| 1.20x |" in format_markdown(doc, "kernel_ms").splitlines()[2]


def test_rounds_that_waited_for_the_host_are_flagged():
    r = {**_ok(0.7), "wall_ms_rounds": [0.83, 0.71, 0.64, 0.80, 0.63], "kernel_ms_rounds": [0.62] * 5}
    rec = _row(flexlab=r, fa4={**_ok(0.6), "wall_ms_rounds": [0.6] * 5, "kernel_ms_rounds": [0.6] * 5})
    text = format_row(rec)
    assert "wall > 1.1x kernel in 3/5 rounds" in text.splitlines()[1]
    assert "rounds" not in text.splitlines()[2]


def test_results_round_trip_plain_and_gzip(tmp_path):
    doc = {"schema": 1, "rows": [{"name": "fwd dense B1 S1k H2 D64 bf16", "results": {}}]}
    write_json(doc, tmp_path / "a.json")
    write_json(doc, tmp_path / "b.json.gz")
    assert json.loads((tmp_path / "a.json").read_text()) == doc
    assert json.loads(gzip.decompress((tmp_path / "b.json.gz").read_bytes())) == doc
    (tmp_path / "notes.txt").write_text("not a result")
    assert [p.name for p in result_files(tmp_path)] == ["a.json", "b.json.gz"]
    assert [read_json(p) for p in result_files(tmp_path)] == [doc, doc]
    assert result_files(tmp_path / "missing") == []


def test_committed_results_are_compressed_and_readable():
    # results are committed gzip-compressed, a seventh of their plain size, to keep the repository small
    files = sorted(RESULTS.iterdir())
    assert files and all(p.name.endswith((".json.gz", ".txt.gz", ".csv.gz")) for p in files), \
        [p.name for p in files if not p.name.endswith(".gz")]
    for path in files:
        if path.name.endswith(".json.gz"):
            assert isinstance(read_json(path), (dict, list)), path.name
        else:
            assert gzip.decompress(path.read_bytes()).strip(), path.name


def test_merge_refuses_runs_from_different_gpus():
    import pytest
    h100 = {"environment": {"date_utc": "t1", "gpu": "NVIDIA H100 80GB HBM3"}, "rows": [_row("a", sdpa=_ok(1.0))]}
    h200 = {"environment": {"date_utc": "t2", "gpu": "NVIDIA H200"}, "rows": [_row("a", flexlab=_ok(0.9))]}
    with pytest.raises(ValueError, match="different GPUs"):
        merge_documents([h100, h200])
    assert merge_documents([h100, {**h100, "rows": [_row("a", flexlab=_ok(0.9))]}])["rows"][0]["results"].keys() == {
        "sdpa", "flexlab"}


def test_roof_is_the_gpu_s_own():
    import torch

    from flexlab.bench.report import apply_roof, document
    from flexlab.bench.roof import known_ceiling, matmul_ceiling
    assert known_ceiling("NVIDIA H200") == 790.0 and known_ceiling("NVIDIA H100 80GB HBM3") == 720.0
    assert known_ceiling("NVIDIA A100-SXM4-80GB") is None and known_ceiling(None) is None
    tflops, basis = matmul_ceiling({"gpu": "NVIDIA H100 80GB HBM3"}, torch.device("cuda"))
    assert tflops == 720.0 and "H100" in basis
    tflops, basis = matmul_ceiling({}, torch.device("cpu"))  # no GPU: the H200's, and said so
    assert tflops == 790.0 and "no GPU" in basis
    doc = document({}, {}, [], (720.0, basis))
    rec = _row(flexlab=_ok(1.0, tflops=360.0), sdpa={"status": "n/a"})
    apply_roof(rec, doc["matmul_ceiling_tflops"])
    assert rec["results"]["flexlab"]["roof_pct"] == 50.0 and "roof_pct" not in rec["results"]["sdpa"]


def _rounds(walls, stamp="2026-12-05T08:00:00Z"):
    return {**_ok(sorted(walls)[len(walls) // 2]), "wall_ms_rounds": walls,
            "kernel_ms_rounds": [w * 0.9 for w in walls], "measured_utc": stamp}


def test_paired_speedup_divides_round_by_round():
    # The clock moved after round two: flexlab's median lands on a slow round, the peer's on a fast one, so the ratio
    # of medians reads 0.83x; round by round the two are level.
    ours, peer = _rounds([1.0, 1.0, 1.2, 1.2, 1.2]), _rounds([1.0, 1.0, 1.0, 1.2, 1.2])
    rec = _row(flexlab=ours, fa4=peer)
    assert abs(rec["flexlab_speedup_vs_best_peer"] - 1.0 / 1.2) < 1e-9
    assert rec["flexlab_paired_speedup_vs_best_peer"] == {"wall_ms": 1.0, "kernel_ms": 1.0}
    doc = {"schema": 1, "environment": {}, "settings": {}, "matmul_ceiling_tflops": 790.0, "rows": [rec]}
    assert "| 0.83x | 1.00x | 0.83-1.00 at 94% |" in format_markdown(doc).splitlines()[2]
    assert "flexlab 0.83x of it (1.00x paired by round, 0.83-1.00 at 94%: level)" in format_row(rec)
    assert format_document(doc).splitlines()[-1].rstrip().endswith("0.83    1.00  0.83-1.00 at 94%   level")


def test_median_interval_takes_order_statistics_with_binomial_coverage():
    # 5 values: the lowest and highest, covering the median with probability 1 - 2 / 2^5
    assert median_interval([3.0, 1.0, 5.0, 2.0, 4.0]) == (1.0, 5.0, 1 - 2 / 32)
    # 15: the 4th and 12th (P[Binomial(15, 1/2) <= 3] = 576 / 32768); the 5th and 11th would cover only 88%
    low, high, coverage = median_interval([float(x) for x in range(15, 0, -1)])
    assert (low, high) == (4.0, 12.0) and abs(coverage - (1 - 2 * 576 / 32768)) < 1e-12
    assert median_interval([1.0, 2.0, 3.0, 4.0], coverage=0.9) == (1.0, 4.0, 1 - 2 / 16)  # short of 90%: widest
    with pytest.raises(ValueError, match="at least 2"):
        median_interval([1.0])


def test_standing_says_behind_only_when_every_plausible_ratio_is():
    peer = _rounds([1.0, 1.0, 1.0, 1.0, 1.0])
    behind = _rounds([1.02, 1.03, 1.05, 1.04, 1.02])  # flexlab slower in every round
    assert standing(paired_interval(behind, peer)) == "behind"
    assert standing(paired_interval(_rounds([0.98, 0.97, 0.99, 0.95, 0.99]), peer)) == "ahead"
    assert standing(paired_interval(_rounds([0.98, 1.03, 0.99, 1.02, 1.0]), peer)) == "level"
    assert paired_interval(behind, _ok(1.0)) is None and standing(None) is None  # not timed together
    rec = _row(flexlab=behind, fa4=peer)
    assert rec["flexlab_standing"] == "behind"
    low, high, _ = rec["flexlab_paired_interval_vs_best_peer"]["wall_ms"]
    assert abs(low - 1 / 1.05) < 1e-12 and abs(high - 1 / 1.02) < 1e-12
    assert _row(flexlab=behind)["flexlab_paired_interval_vs_best_peer"] is None
    # a bound just below 1 keeps its third decimal: "behind" never prints as reaching 1.00
    close = _row(flexlab=_rounds([1.002, 1.03, 1.05, 1.04, 1.02]), fa4=peer)
    assert close["flexlab_standing"] == "behind" and "0.95-0.998 at 94%: behind" in format_row(close)


def test_paired_speedup_needs_one_interleaved_measurement():
    ours = _rounds([1.0, 1.1, 1.2])
    assert abs(paired_speedup(ours, _rounds([1.1, 1.1, 1.1])) - 1.0) < 1e-9
    assert paired_speedup(ours, _rounds([1.1, 1.1, 1.1], stamp="2026-12-05T09:00:00Z")) is None  # another run
    assert paired_speedup(ours, _rounds([1.1, 1.1])) is None  # other rounds
    assert paired_speedup(ours, {**_rounds([1.1, 1.1, 1.1]), "status": "wrong"}) is None
    assert paired_speedup(ours, _ok(1.0)) is None  # timed without rounds
    assert _row(flexlab=ours, fa4=_ok(1.0))["flexlab_paired_speedup_vs_best_peer"] == {"wall_ms": None,
                                                                                       "kernel_ms": None}
    assert _row(flexlab=ours)["flexlab_paired_speedup_vs_best_peer"] is None  # no peer
