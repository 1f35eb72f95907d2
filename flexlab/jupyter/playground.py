"""``flexlab.Playground``: edit a score_mod / mask_mod, press Run, see correctness, speed and what it compiles to.

The widget is a column of plain ipywidgets around one anywidget, the CodeMirror editor (bundled in ``static/``,
no CDN). Run re-executes the editor code with the current shape and slider values and compares the chosen
backends with the float64 reference. The generated source is rebuilt only when the code text changes; moving a
slider changes captured values, which our kernels take as runtime arguments, so the status line shows
"0 recompiles". Every error is caught and shown next to the code; the kernel never dies.

Stable hooks for browser tests: the editor has class/data-testid ``flexlab-editor``, the Run button class
``flexlab-run``, the results table ``flexlab-results`` and the mask plot ``flexlab-mask-plot``.
"""
from __future__ import annotations

import html
import importlib.util
import time
from pathlib import Path
from typing import Optional

import anywidget
import ipywidgets as widgets
import traitlets

from ..errors import UnsupportedModError

from .experiment import (BACKENDS, DTYPES, CodeError, RunResult, RunSpec, _code_error, code_hash, load_mods,
                         run_experiment)
from .panel import ResultPanel, error_html

STATIC = Path(__file__).parent / "static"
CUSTOM = "(custom)"
CUSTOM_CODE = '''# Define score_mod(score, b, h, q_idx, kv_idx) and/or mask_mod(b, h, q_idx, kv_idx).
# torch, B, H, Q_LEN, KV_LEN and device are available as plain names.
window = 64

def mask_mod(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

def score_mod(score, b, h, q_idx, kv_idx):
    return score - 0.01 * (q_idx - kv_idx)
'''


class CodeEditor(anywidget.AnyWidget):
    """CodeMirror 6 editor synced to ``code``; Ctrl/Cmd-Enter calls the ``on_run`` handlers."""

    _esm = STATIC / "editor.js"
    _css = STATIC / "editor.css"
    code = traitlets.Unicode("").tag(sync=True)
    error_line = traitlets.Int(0).tag(sync=True)          # 1-based line to mark, 0 for none
    height = traitlets.Unicode("300px").tag(sync=True)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._run_handlers = []
        self.on_msg(self._on_custom_msg)
        self.add_class("flexlab-editor")

    def on_run(self, handler) -> None:
        self._run_handlers.append(handler)

    def _on_custom_msg(self, _widget, content, _buffers):
        if isinstance(content, dict) and content.get("type") == "run":
            for handler in self._run_handlers:
                handler()


def _backend_availability(device: str) -> dict[str, tuple[bool, str]]:
    cuda = device.startswith("cuda")
    flash = cuda and importlib.util.find_spec("flash_attn") is not None
    cute = cuda and importlib.util.find_spec("cutlass") is not None
    return {"reference": (True, "dense float math, any device"),
            "torch": (True, "torch's flex_attention (compiled on CUDA)"),
            "sdpa": (True, "scaled_dot_product_attention with a dense mask; n/a with a score_mod"),
            "flash": (flash, "torch flex_attention with BACKEND=FLASH" if flash else
                      "needs CUDA and flash-attn-4"),
            "cute": (cute, "flexlab's CuTeDSL kernel" if cute else "needs a Hopper GPU and nvidia-cutlass-dsl")}


class Playground(widgets.VBox):
    """An editor prefilled from a gallery variant, shape/dtype/backend controls, parameter sliders and results.

    Args:
        variant: a gallery variant name (``flexlab.gallery.load_gallery()``), or None for an empty example.
        B, H, S, D, dtype: the initial shape and input dtype (``"bf16"``, ``"fp16"``, ``"fp32"``, ``"fp64"``).
        backends: backends to compare; default reference + torch on CPU, everything available on a GPU.
        device: ``"cpu"`` or ``"cuda"``; default CUDA when present.
    """

    def __init__(self, variant: Optional[str] = None, *, B: int = 1, H: int = 2, S: Optional[int] = None,
                 D: int = 64, dtype: str = "bf16", backends=None, device: Optional[str] = None):
        from ..gallery import load_gallery
        import torch

        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.variants = load_gallery()
        if variant is not None and variant not in self.variants:
            raise ValueError(f"no gallery variant named {variant!r}; available: {', '.join(self.variants)}")
        self.result: Optional[RunResult] = None
        self.last_error: Optional[BaseException] = None
        self.run_count = 0
        self.codegen_count = 0                     # how often the generated source had to be rebuilt
        self._source_cache: dict[str, object] = {}
        self._suspend = False

        # -- controls -------------------------------------------------------------------------------------------
        self.variant_picker = widgets.Dropdown(options=[CUSTOM, *self.variants], value=variant or CUSTOM,
                                               description="variant", layout=widgets.Layout(width="260px"))
        self.B = widgets.BoundedIntText(value=B, min=1, max=4096, description="B", layout=_narrow())
        self.H = widgets.BoundedIntText(value=H, min=1, max=1024, description="H", layout=_narrow())
        self.S = widgets.BoundedIntText(value=S or 256, min=1, max=1 << 20, description="S", layout=_narrow(150))
        self.D = widgets.BoundedIntText(value=D, min=1, max=512, description="D", layout=_narrow())
        self.dtype = widgets.Dropdown(options=list(DTYPES), value=dtype, description="dtype",
                                      layout=widgets.Layout(width="150px"))
        avail = _backend_availability(self.device)
        default = backends or (("reference", "torch") if self.device == "cpu"
                               else tuple(b for b in BACKENDS if avail[b][0]))
        self.backend_boxes = {
            name: widgets.Checkbox(value=name in default and ok, description=name, disabled=not ok, tooltip=why,
                                   indent=False, layout=widgets.Layout(width="95px"))
            for name, (ok, why) in avail.items()}
        self.editor = CodeEditor()
        self.run_button = widgets.Button(description="Run", button_style="primary", icon="play",
                                         tooltip="run (Ctrl/Cmd-Enter in the editor)")
        self.run_button.add_class("flexlab-run")
        self.progress = widgets.FloatProgress(value=0.0, min=0.0, max=1.0, layout=widgets.Layout(width="160px"))
        self.status = widgets.HTML("")
        self.status.add_class("flexlab-status")
        self.error_box = widgets.HTML("")
        self.error_box.add_class("flexlab-error-box")
        self.params_box = widgets.VBox([])
        self.params_box.add_class("flexlab-params")
        self.sliders: dict[str, widgets.Widget] = {}
        self.output = widgets.VBox([])
        self.output.add_class("flexlab-output")

        self.run_button.on_click(lambda _b: self.run())
        self.editor.on_run(self.run)
        self.variant_picker.observe(self._on_variant, names="value")

        shape_row = widgets.HBox([self.variant_picker, self.B, self.H, self.S, self.D, self.dtype])
        backend_row = widgets.HBox([widgets.HTML("<b>compare</b>&nbsp;"), *self.backend_boxes.values()])
        run_row = widgets.HBox([self.run_button, self.progress, self.status])
        super().__init__([shape_row, backend_row, self.editor, self.params_box, run_row, self.error_box,
                          self.output])
        self.add_class("flexlab-playground")
        self._load_variant(self.variant_picker.value)

    # -- state ------------------------------------------------------------------------------------------------
    @property
    def variant(self):
        name = self.variant_picker.value
        return None if name == CUSTOM else self.variants[name]

    @property
    def params(self) -> dict:
        return {name: s.value for name, s in self.sliders.items()}

    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(name for name, box in self.backend_boxes.items() if box.value and not box.disabled)

    def spec(self) -> RunSpec:
        return RunSpec(B=self.B.value, H=self.H.value, S=self.S.value, D=self.D.value, dtype=self.dtype.value,
                       backends=self.backends, device=self.device)

    def _on_variant(self, change) -> None:
        self._load_variant(change["new"])

    def _load_variant(self, name: str) -> None:
        """Prefill the editor and sliders from a variant (its factories, as the gallery shows them)."""
        self._suspend = True
        try:
            variant = None if name == CUSTOM else self.variants[name]
            self.editor.code = CUSTOM_CODE if variant is None else variant.source
            self.editor.error_line = 0
            self.sliders = {}
            for p in (variant.params if variant is not None else ()):
                cls = widgets.IntSlider if p.is_int else widgets.FloatSlider
                slider = cls(value=p.default, min=p.min, max=p.max, step=p.step, description=p.name,
                             tooltip=p.description, continuous_update=False, style={"description_width": "initial"},
                             layout=widgets.Layout(width="420px"))
                slider.observe(self._on_param, names="value")
                self.sliders[p.name] = slider
            label = [widgets.HTML("<b>parameters</b> <span style='color:#777'>(re-run without recompiling)</span>")] \
                if self.sliders else []
            self.params_box.children = label + list(self.sliders.values())
            if variant is not None and not variant.accepts_lengths(self.S.value, self.S.value):
                self.S.value = variant.example_lengths[0]
            self.error_box.value = ""
            self.output.children = []
            self.status.value = (f"<span style='color:#555'>{html.escape(variant.description)}</span>"
                                 if variant is not None else "")
        finally:
            self._suspend = False

    def _on_param(self, _change) -> None:
        if not self._suspend and self.result is not None:
            self.run()

    # -- running ----------------------------------------------------------------------------------------------
    def _progress(self, text: str, frac: float) -> None:
        self.progress.value = frac
        self.status.value = f"<span style='color:#555'>{html.escape(text)}…</span>"

    def _source_view(self, mods, code: str):
        """The generated-source view, rebuilt only when the code text changed."""
        key = code_hash(code)
        view = self._source_cache.get(key)
        if view is None:
            from ..viz.source_view import UserSource, source_view
            view = source_view(mods.score_mod, mods.mask_mod, user=UserSource(code, mods.filename))
            self._source_cache = {key: view}          # keep only the current code's view
            self.codegen_count += 1
        return view

    def run(self) -> Optional[RunResult]:
        """Run the editor code; returns the result, or None when an error was shown instead."""
        code = self.editor.code
        self.run_count += 1
        self.last_error = None
        self.error_box.value = ""
        self.editor.error_line = 0
        self.run_button.disabled = True
        t0 = time.perf_counter()
        try:
            spec = self.spec()
            variant = self.variant
            params = variant.resolve_params(**self.params) if variant is not None else {}
            if variant is not None and not variant.accepts_lengths(spec.S, spec.Skv):
                raise CodeError(f"variant {variant.name!r} does not accept S={spec.S}: its rule is "
                                f"'{variant.lengths_rule}'", kind="shape")
            self._progress("running the code", 0.02)
            mods = load_mods(code, params=params, variant=variant, B=spec.B, H=spec.H, Q_LEN=spec.S,
                             KV_LEN=spec.Skv, device=spec.device)
            changed = code_hash(code) not in self._source_cache
            self._progress("generating CuTeDSL" if changed else "code unchanged, reusing the generated source", 0.04)
            g0 = time.perf_counter()
            view = self._source_view(mods, code)
            codegen_s = time.perf_counter() - g0
            late_warning = None
            if view.exception is not None:
                warning = _code_error(view.exception, code, mods.filename, "generating CuTeDSL")
                if isinstance(view.exception, UnsupportedModError):
                    self._show_error(warning, warning=True)
                else:                   # most likely the same mistake the run reports next; say it only if not
                    late_warning = warning
            try:
                result = run_experiment(mods, spec, progress=self._progress)
            except Exception as err:                               # noqa: BLE001 - located in the user's code
                raise _code_error(err, code, mods.filename, "computing attention") from None
        except Exception as err:                                   # noqa: BLE001 - the kernel must survive
            self._show_error(err, keep=self.error_box.value)
            return None
        finally:
            self.run_button.disabled = False
            self.progress.value = 1.0
        self.result = result
        if late_warning is not None:
            self._show_error(late_warning, warning=True)
        panel = ResultPanel(result, user_code=code, source=view)
        self.panel = panel
        self.output.children = [panel.widget()]
        kernels = result.recompiles.get("flexlab kernels", 0)
        graphs = result.recompiles.get("torch graphs", 0)
        verdict = ("<b style='color:#1e7d32'>all checks pass</b>" if result.passed
                   else "<b style='color:#b00020'>a check failed</b>")
        self.status.value = (f"{verdict} · <span class='flexlab-recompile-count'>{kernels} recompile"
                             f"{'s' if kernels != 1 else ''}</span> (torch: {graphs} new graph"
                             f"{'s' if graphs != 1 else ''}) · codegen "
                             f"{'%.2f s' % codegen_s if changed else 'reused'} · total "
                             f"{time.perf_counter() - t0:.1f} s")
        return result

    def _show_error(self, err: BaseException, warning: bool = False, keep: str = "") -> None:
        """Show ``err`` under the editor and mark its line; ``keep`` is HTML already shown (e.g. a warning)."""
        line = getattr(err, "line", None)
        if line:
            self.editor.error_line = int(line)
        box = error_html(err)
        if warning:
            box = box.replace("error</b>", "warning</b> (the cute backend cannot run this; other backends still run)",
                              1)
        else:
            self.last_error = err
            if self.output.children:
                box += "<div style='color:#777;font-size:12px'>the results below are from the previous run</div>"
        self.error_box.value = keep + box
        if not warning:
            self.status.value = "<b style='color:#b00020'>error</b>"


def _narrow(width: int = 130):
    return widgets.Layout(width=f"{width}px")


__all__ = ["Playground", "CodeEditor"]
