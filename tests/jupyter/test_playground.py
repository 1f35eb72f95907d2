"""The playground driven from Python: prefill, Run handlers, sliders without recompiles, inline errors."""
from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("anywidget")
pytest.importorskip("ipywidgets")

import flexlab  # noqa: E402
from flexlab.gallery import get_variant  # noqa: E402
from flexlab.jupyter.playground import CUSTOM, STATIC, CodeEditor, Playground  # noqa: E402
from flexlab.mask import create_mask  # noqa: E402


def fast(pg: Playground) -> Playground:
    """Small shapes and one backend keep each run well under a second on a CPU."""
    pg.S.value, pg.H.value, pg.D.value, pg.dtype.value = 64, 1, 16, "fp32"
    pg.backend_boxes["torch"].value = False
    return pg


def test_lazy_public_name_and_bundled_editor():
    assert flexlab.Playground is Playground
    js = (STATIC / "editor.js").read_text()
    assert "flexlab-editor" in js and "Mod-Enter" in js and "export" in js
    # Offline: everything is bundled, nothing is imported from a URL at run time.
    assert not re.search(r"""import\s*\(?\s*["']https?:""", js) and not re.search(r"""from\s*["']https?:""", js)
    editor = CodeEditor()
    assert "flexlab-editor" in editor._esm and editor._css.strip().startswith("/*")


def test_prefill_from_variant():
    pg = Playground("sliding_window")
    v = get_variant("sliding_window")
    assert pg.editor.code == v.source
    assert list(pg.sliders) == ["window"] and pg.sliders["window"].value == 64
    assert "flexlab-run" in pg.run_button._dom_classes and "flexlab-editor" in pg.editor._dom_classes


def test_run_shows_table_and_mask_plot():
    pg = fast(Playground("sliding_window"))
    pg.sliders["window"].value = 8                   # no result yet: a slider alone does not run
    assert pg.run_count == 0
    pg.run_button.click()
    assert pg.run_count == 1 and pg.last_error is None and pg.result.passed
    panel = pg.output.children[0]
    table = panel.children[0].value
    assert "data-testid='flexlab-results'" in table and "reference" in table
    tabs = panel.children[1]
    masks = [c for c in tabs.children if "flexlab-mask-plot" in getattr(c, "_dom_classes", ())]
    assert len(masks) == 1
    z = torch.tensor(masks[0].figure.data[0].z)
    want = create_mask(lambda b, h, q, kv: (q >= kv) & (q - kv < 8), 1, 1, 64, 64)[0, 0]
    assert torch.equal(z.bool(), want)
    assert masks[0].outputs[0]["data"]["application/vnd.plotly.v1+json"]["data"][0]["type"] == "heatmap"


def test_slider_reruns_without_recompiling():
    pg = fast(Playground("sliding_window"))
    first = pg.run()
    assert pg.codegen_count == 1
    pg.sliders["window"].value = 4                   # observed: re-runs by itself
    assert pg.run_count == 2 and pg.codegen_count == 1
    assert pg.result is not first and pg.result.density < first.density
    assert pg.result.recompiles["flexlab kernels"] == 0
    assert "0 recompiles" in pg.status.value and "codegen reused" in pg.status.value


def _from_browser(widget, data: dict) -> None:
    """Deliver a comm message the way the front-end sends it (through ipywidgets' own dispatch)."""
    widget._handle_msg({"content": {"data": data}, "buffers": []})


def test_editor_text_and_ctrl_enter_arrive_from_the_browser():
    pg = fast(Playground("causal"))
    code = "def mask_mod(b, h, q_idx, kv_idx):\n    return (q_idx >= kv_idx) & (q_idx - kv_idx < 3)\n"
    _from_browser(pg.editor, {"method": "update", "state": {"code": code}, "buffer_paths": []})
    assert pg.editor.code == code
    _from_browser(pg.editor, {"method": "custom", "content": {"type": "run"}})
    assert pg.run_count == 1 and pg.result is not None
    assert pg.result.density == pytest.approx((3 * 64 - 3) / 64 ** 2)


def test_syntax_error_is_inline_with_line():
    pg = fast(Playground("sliding_window"))
    pg.editor.code = pg.editor.code.replace("causal & recent", "causal &")
    assert pg.run() is None
    line = next(i for i, t in enumerate(pg.editor.code.splitlines(), 1) if t.strip() == "return causal &")
    assert pg.editor.error_line == line and f"line {line}" in pg.error_box.value
    assert "syntax error" in pg.error_box.value


def test_unsupported_op_points_at_line():
    pg = fast(Playground(None))
    pg.editor.code = ("def score_mod(score, b, h, q_idx, kv_idx):\n"
                      "    if score.item() > 0:\n"
                      "        return score\n"
                      "    return score * 2\n")
    assert pg.run() is None
    assert pg.editor.error_line == 2 and "unsupported" in pg.error_box.value


def test_shape_and_settings_errors_are_inline():
    pg = fast(Playground("block_diffusion"))
    pg.S.value = 65
    assert pg.run() is None and "does not accept S=65" in pg.error_box.value
    pg = fast(Playground("causal"))
    pg.backend_boxes["reference"].value = False
    assert pg.run() is None and "backends must be" in pg.error_box.value


def test_changing_variant_resets_editor_and_sliders():
    pg = fast(Playground("sliding_window"))
    pg.run()
    pg.variant_picker.value = "document"
    assert pg.editor.code == get_variant("document").source and list(pg.sliders) == ["num_documents"]
    assert pg.output.children == () or list(pg.output.children) == []
    pg.variant_picker.value = CUSTOM
    assert "def mask_mod" in pg.editor.code and pg.sliders == {}
    assert pg.run() is not None and pg.result.passed


def test_unknown_variant_is_named():
    with pytest.raises(ValueError, match="no gallery variant named 'nope'"):
        Playground("nope")


def test_runtime_mistake_is_reported_once():
    pg = fast(Playground(None))
    pg.editor.code = "def mask_mod(b, h, q_idx, kv_idx):\n    return q_idx >= undefined_name\n"
    assert pg.run() is None
    assert pg.error_box.value.count("data-testid='flexlab-error'") == 1
    assert "NameError" in pg.error_box.value and pg.editor.error_line == 2
