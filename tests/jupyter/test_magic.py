"""%%flexattn inside a real IPython InteractiveShell: results, -o, cache, errors that leave the shell alive."""
from __future__ import annotations

import pytest

pytest.importorskip("ipywidgets")

from IPython.testing.globalipapp import get_ipython  # noqa: E402
from IPython.utils.capture import capture_output  # noqa: E402

from flexlab.jupyter import magic  # noqa: E402

CELL = """\
def mask_mod(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < window)
"""
ARGS = "-B 1 -H 1 -S 64 -D 16 --dtype fp32 --compare reference,sdpa --show timing,mask"


@pytest.fixture(scope="module")
def ip():
    shell = get_ipython()
    shell.run_line_magic("load_ext", "flexlab")
    yield shell
    shell.run_line_magic("unload_ext", "flexlab")


def _text(cap) -> str:
    return "".join(o.data.get("text/plain", "") for o in cap.outputs)


def test_load_ext_registers_cell_magic(ip):
    assert "flexattn" in ip.magics_manager.magics["cell"]
    doc = ip.magics_manager.magics["cell"]["flexattn"].__doc__
    for flag in ("-B", "-H", "-S", "-D", "--dtype", "--compare", "--show", "-o"):
        assert flag in doc


def test_cell_runs_and_stores_result(ip):
    ip.user_ns["window"] = 9
    with capture_output() as cap:
        ip.run_cell_magic("flexattn", ARGS + " -o res", CELL)
    res = ip.user_ns["res"]
    assert [r.backend for r in res.rows] == ["reference", "sdpa"] and res.passed and not res.cached
    assert res.spec.S == 64 and res.spec.dtype == "fp32"
    # The mods the cell defines land in the namespace like a normal cell's, and see the notebook's variables.
    mask_mod = ip.user_ns["mask_mod"]
    import torch
    assert bool(mask_mod(0, 0, torch.tensor(20), torch.tensor(12))) and not bool(
        mask_mod(0, 0, torch.tensor(20), torch.tensor(11)))
    assert any("VBox" in o.data.get("text/plain", "") for o in cap.outputs)


def test_unchanged_cell_hits_cache(ip, monkeypatch):
    ip.user_ns["window"] = 9
    ip.run_cell_magic("flexattn", ARGS + " -o first", CELL)
    calls = []
    monkeypatch.setattr(magic, "run_experiment", lambda *a, **k: calls.append(a) or pytest.fail("not cached"))
    ip.run_cell_magic("flexattn", ARGS + " -o again", CELL)
    assert ip.user_ns["again"].cached and ip.user_ns["again"].rows == ip.user_ns["first"].rows and not calls


def test_changed_notebook_variable_is_not_served_from_cache(ip):
    ip.user_ns["window"] = 9
    ip.run_cell_magic("flexattn", ARGS + " -o w9", CELL)
    ip.user_ns["window"] = 30
    ip.run_cell_magic("flexattn", ARGS + " -o w30", CELL)
    assert not ip.user_ns["w30"].cached and ip.user_ns["w30"].density > ip.user_ns["w9"].density


def test_changed_arguments_run_again(ip):
    ip.run_cell_magic("flexattn", ARGS.replace("-S 64", "-S 32") + " -o small", CELL)
    assert ip.user_ns["small"].spec.S == 32 and not ip.user_ns["small"].cached


def test_errors_are_shown_not_raised(ip):
    with capture_output() as cap:
        ip.run_cell_magic("flexattn", ARGS, "def mask_mod(b, h, q_idx, kv_idx):\n    return q_idx >=\n")
    text = _text(cap)
    assert text.startswith("flexlab error") and "line 2" in text and "SyntaxError" in text
    with capture_output() as cap:
        ip.run_cell_magic("flexattn", "--compare triton", CELL)
    assert "unknown or empty" in _text(cap)
    # The shell is still usable afterwards.
    assert ip.run_cell("1 + 1").result == 2
