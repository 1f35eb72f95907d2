"""The result panel's table, chart and tabs reflect the run's numbers, failures and inapplicable backends."""
from __future__ import annotations

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

from flexlab.jupyter.experiment import BackendRow, CodeError, RunResult, RunSpec, load_mods  # noqa: E402
from flexlab.jupyter.panel import ErrorDisplay, ResultPanel, error_html, results_table_html, timing_figure  # noqa: E402


def _result(mods=None) -> RunResult:
    rows = [BackendRow("reference", ms=2.0, tflops=0.5, rel_l2=1e-7, max_abs=1e-6, has_nan=False, passed=True,
                       speedup=1.0),
            BackendRow("torch", ms=4.0, tflops=0.25, rel_l2=3e-2, max_abs=0.1, has_nan=True, passed=False,
                       speedup=2.0),
            BackendRow("sdpa", error="n/a: SDPA has no score_mod")]
    spec = RunSpec(B=1, H=2, S=64, D=16, dtype="fp32", backends=("reference", "torch", "sdpa"))
    return RunResult(spec, rows, density=0.5, flops=1e6, tolerance=1e-5, baseline="reference", code_hash="x",
                     recompiles={"flexlab kernels": 0, "torch graphs": 1}, mods=mods)


def test_table_marks_pass_fail_and_na():
    html = results_table_html(_result())
    assert "data-testid='flexlab-results'" in html and "class='flexlab-results'" in html
    assert html.count(">pass<") == 1 and html.count(">FAIL<") == 1
    assert "n/a: SDPA has no score_mod" in html and "2.00× slower" in html and "baseline" in html
    assert "0 recompiles" in html and "mask density 50.0%" in html


def test_timing_chart_has_one_bar_per_timed_backend():
    fig = timing_figure(_result())
    assert list(fig.data[0].x) == ["reference", "torch"] and list(fig.data[0].y) == [2.0, 4.0]
    assert fig.data[0].marker.color[1] != fig.data[0].marker.color[0]     # the failing one stands out


def test_widget_tabs_and_source_button():
    mods = load_mods("def mask_mod(b, h, q_idx, kv_idx):\n    return q_idx >= kv_idx\n", Q_LEN=64)
    panel = ResultPanel(_result(mods), show=("timing", "mask", "code"), user_code=None)
    box = panel.widget()
    table, tabs = box.children
    assert "flexlab-results" in table.value
    assert [tabs.get_title(i) for i in range(3)] == ["Timing", "Mask", "Source"]
    assert "flexlab-timing-plot" in tabs.children[0]._dom_classes
    assert "flexlab-mask-plot" in tabs.children[1]._dom_classes
    source = tabs.children[2]
    assert "flexlab-compile-report-button" in source.compile_button._dom_classes
    assert "generated CuTeDSL" in source.children[1].value


def test_blocks_section_without_mask():
    panel = ResultPanel(_result(load_mods("def score_mod(score, b, h, q_idx, kv_idx):\n    return score\n")),
                        show=("blocks",))
    assert "every tile is full" in panel.widget().children[1].children[0].value
    with pytest.raises(ValueError, match="show must be a subset"):
        ResultPanel(_result(), show=("everything",))


def test_error_box_quotes_the_line():
    err = CodeError("SyntaxError: invalid syntax", 3, "    return q >=", "syntax")
    html = error_html(err)
    assert "data-line='3'" in html and "line 3" in html and "return q &gt;=" in html
    assert repr(ErrorDisplay(err)).startswith("flexlab error: SyntaxError")


@pytest.mark.slow
def test_compile_button_adds_the_kernel_report():
    pytest.importorskip("cutlass")
    from flexlab.viz.compile_report import find_tool
    if find_tool("ptxas") is None:
        pytest.skip("ptxas is not installed")
    mods = load_mods("def mask_mod(b, h, q_idx, kv_idx):\n    return q_idx >= kv_idx\n", Q_LEN=64)
    result = _result(mods)
    result.spec = RunSpec(B=1, H=2, S=64, D=64, dtype="bf16", backends=("reference",))
    source = ResultPanel(result, show=("code",)).widget().children[1].children[0]
    source.compile_button.click()
    html = source.children[1].value
    assert "compile report" in html and "registers / thread" in html
    assert ("HGMMA" in html) == (find_tool("nvdisasm") is not None)
    assert source.compile_button.layout.display == "none"
