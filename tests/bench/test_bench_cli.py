"""The command line end to end on CPU: tiny rows, the reference and SDPA run, CUDA-only peers say why not."""
import json

import pytest
import torch

from flexlab.bench.cli import main


def test_quick_cpu_run_writes_json_and_tables(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["--rows", "validate", "--only", " causal B4", "--quick", "--device", "cpu",
               "--backends", "reference,sdpa,flex-triton,fa4,flexlab", "--json", str(out), "--label", "ci"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == 1 and doc["settings"]["label"] == "ci" and doc["environment"]["torch"] == torch.__version__
    names = [r["name"] for r in doc["rows"]]
    assert names == ["fwd causal B1 S256 H2 D128 bf16", "fwd+bwd causal B1 S256 H2 D128 bf16"]
    for row in doc["rows"]:
        res = row["results"]
        assert row["density"] == pytest.approx(257 / 512)
        assert res["reference"]["status"] == "ok" and res["sdpa"]["status"] == "ok"
        assert res["sdpa"]["wall_ms"] > 0 and res["sdpa"]["kernel_ms"] is None
        assert res["sdpa"]["tflops"] == pytest.approx(row["flops"] / res["sdpa"]["wall_ms"] / 1e9)
        assert res["flex-triton"]["status"] == "n/a" and "CUDA" in res["flex-triton"]["error"]
        assert res["fa4"]["status"] == "n/a"
        assert res["flexlab"]["status"] in ("n/a", "error", "ok")
        assert row["best_peer"] == "sdpa"
    assert set(doc["rows"][1]["results"]["sdpa"]["rel_l2"]) == {"out", "dq", "dk", "dv"}
    printed = capsys.readouterr().out
    assert "fwd+bwd causal B1 S256" in printed and "best peer" in printed

    assert main(["--show", str(out), "--markdown"]) == 0
    assert "| fwd causal B1 S256 H2 D128 bf16 |" in capsys.readouterr().out


def test_time_budget_marks_the_rest_skipped(tmp_path):
    out = tmp_path / "b.json"
    assert main(["--rows", "validate", "--only", "alibi", "--quick", "--device", "cpu", "--backends", "sdpa",
                 "--time-budget", "0", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["skipped"] == "time budget spent" and row["results"] == {}


def test_bad_arguments_exit_with_status_2(capsys):
    assert main(["--rows", "nope"]) == 2
    assert "unknown row set" in capsys.readouterr().err
    assert main(["--backends", "flash3"]) == 2


def test_list_rows(capsys):
    assert main(["--rows", "bwd-default", "--list"]) == 0
    assert len(capsys.readouterr().out.split("\n")) == 17


@pytest.mark.gpu
def test_gpu_smoke_every_peer_on_one_small_row(tmp_path):
    out = tmp_path / "gpu.json"
    assert main(["--rows", "validate", "--only", "fwd causal", "--backends", "peers", "--json", str(out),
                 "--warmup-ms", "5", "--rep-ms", "20"]) == 0
    res = json.loads(out.read_text())["rows"][0]["results"]
    assert res["flex-triton"]["status"] == "ok" and res["sdpa"]["status"] == "ok"
    assert res["flex-triton"]["kernel_ms"] > 0


def test_resume_keeps_finished_rows_and_measures_the_rest(tmp_path, capsys):
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    common = ["--rows", "validate", "--only", " causal B4", "--quick", "--device", "cpu", "--backends", "sdpa"]
    # The first run of a resumed series has nothing to resume from yet.
    assert main(common + ["--json", str(first), "--resume", str(first), "--time-budget", "1e9"]) == 0
    assert "no results at" in capsys.readouterr().out
    saved = json.loads(first.read_text())
    saved["rows"][1] = {**saved["rows"][1], "density": None, "skipped": "time budget spent", "results": {}}
    first.write_text(json.dumps(saved))
    capsys.readouterr()
    assert main(common + ["--json", str(second), "--resume", str(first)]) == 0
    assert "kept from the resumed results" in capsys.readouterr().out
    rows = json.loads(second.read_text())["rows"]
    assert rows[0] == saved["rows"][0]                       # copied, not re-measured
    assert rows[1]["results"]["sdpa"]["status"] == "ok"      # the skipped row was measured this time
    # Asking for a backend the saved row lacks measures that backend only and keeps the saved one.
    assert main(common[:-1] + ["sdpa,reference", "--json", str(second), "--resume", str(first)]) == 0
    row = json.loads(second.read_text())["rows"][0]
    assert row["results"]["sdpa"] == saved["rows"][0]["results"]["sdpa"]
    assert row["results"]["reference"]["status"] == "ok" and row["best_peer"] == "sdpa"
