"""The rich result panel shared by ``%%flexattn`` and the playground.

A summary table (correctness and timing per backend) on top, then tabs: a timing bar chart, the mask heatmap, the
block-sparsity inspector and the generated source. The HTML pieces are plain strings (testable without a browser);
:meth:`ResultPanel.widget` assembles them with ipywidgets, and figures are shown with plotly's own renderer.
"""
from __future__ import annotations

import html
from typing import Optional, Sequence

from .experiment import CodeError, RunResult

SECTIONS = ("timing", "mask", "blocks", "code")
#: Longest sequence whose mask heatmap is drawn entry by entry; longer ones are aggregated by mask_plot itself.
PASS_COLOR, FAIL_COLOR, NA_COLOR = "#2a6f97", "#c0392b", "#9e9e9e"


def _fmt(value, spec: str, none: str = "—") -> str:
    return none if value is None else format(value, spec)


def results_table_html(result: RunResult) -> str:
    """The per-backend table; stable hooks ``class="flexlab-results"`` / ``data-testid="flexlab-results"``."""
    s = result.spec
    base = result.baseline
    head = ("<tr><th>backend</th><th>median ms</th><th>TFLOP/s</th>"
            f"<th title='time of this backend / time of {base}'>vs {html.escape(str(base))}</th>"
            "<th>rel-L2 vs fp64</th><th>max abs</th><th>NaN</th><th>check</th>"
            "<th title='the first call includes compiling'>first call s</th></tr>")
    body = []
    for r in result.rows:
        if r.error is not None:
            body.append(f"<tr class='flexlab-row-na' data-backend='{r.backend}'><td>{r.backend}</td>"
                        f"<td colspan='8' style='color:#777;text-align:left'>{html.escape(r.error)}</td></tr>")
            continue
        verdict = ("<span style='color:#1e7d32;font-weight:bold'>pass</span>" if r.passed
                   else "<span style='color:#b00020;font-weight:bold'>FAIL</span>")
        speed = "baseline" if r.backend == base else (f"{r.speedup:.2f}× slower" if r.speedup and r.speedup >= 1
                                                      else f"{1 / r.speedup:.2f}× faster" if r.speedup else "—")
        body.append(f"<tr data-backend='{r.backend}'><td>{r.backend}</td><td>{_fmt(r.ms, '.3f')}</td>"
                    f"<td>{_fmt(r.tflops, '.3g')}</td><td>{speed}</td><td>{_fmt(r.rel_l2, '.2e')}</td>"
                    f"<td>{_fmt(r.max_abs, '.2e')}</td><td>{'yes' if r.has_nan else 'no'}</td><td>{verdict}</td>"
                    f"<td>{_fmt(r.first_call_s, '.2f')}</td></tr>")
    rebuilt = result.recompiles.get("flexlab kernels", 0)
    notes = [f"B={s.B} H={s.H} Sq={s.S} Skv={s.Skv} D={s.D} {s.dtype} on {s.device}",
             f"mask density {result.density:.1%}", f"{result.flops / 1e9:.3g} GFLOP",
             f"tolerance rel-L2 ≤ {result.tolerance:g}",
             f"<span class='flexlab-recompiles'>{rebuilt} recompile{'s' if rebuilt != 1 else ''}</span>"]
    if result.cached:
        notes.append("<b>cached result</b> (cell unchanged)")
    caption = " · ".join(notes)
    style = ("<style>.flexlab-results td,.flexlab-results th{padding:2px 10px;text-align:right}"
             ".flexlab-results td:first-child,.flexlab-results th:first-child{text-align:left}"
             ".flexlab-results tr:nth-child(even){background:var(--jp-layout-color2,#f3f3f3)}</style>")
    return (f"{style}<table class='flexlab-results' data-testid='flexlab-results' style='border-collapse:collapse'>"
            f"<caption style='text-align:left;caption-side:top'>{caption}</caption>{head}{''.join(body)}</table>")


def error_html(err: BaseException, code: Optional[str] = None) -> str:
    """An inline error box; for a :class:`CodeError` it quotes the line it points at."""
    if isinstance(err, CodeError):
        where = f"line {err.line}: " if err.line else ""
        quote = (f"<pre style='margin:4px 0 0 0'>{err.line:>4} | {html.escape(err.source_line)}</pre>"
                 if err.line and err.source_line else "")
        return (f"<div class='flexlab-error' data-testid='flexlab-error' data-line='{err.line or ''}' "
                f"style='color:#b00020;border-left:3px solid #b00020;padding:4px 8px'>"
                f"<b>{html.escape(err.kind)} error</b> {where}{html.escape(err.message)}{quote}</div>")
    return (f"<div class='flexlab-error' data-testid='flexlab-error' style='color:#b00020;border-left:3px solid "
            f"#b00020;padding:4px 8px'><b>{html.escape(type(err).__name__)}</b>: {html.escape(str(err))}</div>")


class ErrorDisplay:
    """An error for ``display()``: the HTML box in notebooks, a plain line in terminals."""

    def __init__(self, err: BaseException):
        self.err = err

    def _repr_html_(self) -> str:
        return error_html(self.err)

    def __repr__(self) -> str:
        return f"flexlab error: {self.err}"


def timing_figure(result: RunResult):
    """Bar chart of median ms per backend, coloured by the correctness check; TFLOP/s in the hover."""
    import plotly.graph_objects as go

    ran = [r for r in result.rows if r.ms is not None]
    fig = go.Figure(go.Bar(
        x=[r.backend for r in ran], y=[r.ms for r in ran],
        marker_color=[PASS_COLOR if r.passed else FAIL_COLOR for r in ran],
        text=[f"{r.ms:.3g} ms" for r in ran], textposition="outside",
        customdata=[[r.tflops or 0.0, r.rel_l2 or 0.0] for r in ran],
        hovertemplate="%{x}: %{y:.4g} ms<br>%{customdata[0]:.3g} TFLOP/s<br>rel-L2 %{customdata[1]:.2e}"
                      "<extra></extra>"))
    s = result.spec
    fig.update_layout(title=dict(text=f"median time per call · B={s.B} H={s.H} S={s.S} D={s.D} {s.dtype}",
                                 font=dict(size=13)),
                      yaxis_title="ms (lower is better)", height=340, width=640, margin=dict(t=60))
    fig.layout.meta = dict(flexlab="timing")
    return fig


def _report_head_dim(head_dim: int) -> int:
    """The head dim the compile report builds the forward kernel for: the experiment's own where the kernel has it,
    else 128 (the report then describes the nearest kernel there is)."""
    from ..kernels.config import SUPPORTED_HEAD_DIMS
    return head_dim if head_dim in SUPPORTED_HEAD_DIMS else 128


class ResultPanel:
    """Everything one run shows. Build pieces lazily: a 128k mask plot or a compile report costs time."""

    def __init__(self, result: RunResult, show: Sequence[str] = SECTIONS, user_code: Optional[str] = None,
                 compile_report: bool = False, source=None):
        unknown = [s for s in show if s not in SECTIONS]
        if unknown:
            raise ValueError(f"show must be a subset of {SECTIONS}, got {list(show)}")
        self.result, self.show = result, tuple(show)
        self.user_code, self.compile_report = user_code, compile_report
        self._cache: dict = {} if source is None else {"code": source}

    # -- pieces -----------------------------------------------------------------------------------------------
    def table_html(self) -> str:
        return results_table_html(self.result)

    def timing_figure(self):
        return self._get("timing", lambda: timing_figure(self.result))

    def mask_figure(self):
        def build():
            from ..viz.mask_plot import plot_mask
            mods, s = self.result.mods, self.result.spec
            if mods is None or (mods.mask_mod is None and mods.score_mod is None):
                return None
            return plot_mask(mods.mask_mod, mods.score_mod, q_len=s.S, kv_len=s.Skv, head_dim=s.D)
        return self._get("mask", build)

    def sparsity(self):
        def build():
            from ..viz.sparsity import inspect_blocks
            bm = self.result.block_mask
            return None if bm is None else inspect_blocks(bm, tile=(128, 128), head_dim=self.result.spec.D)
        return self._get("blocks", build)

    def source(self):
        def build():
            from ..viz.source_view import UserSource, source_view
            mods = self.result.mods
            if mods is None:
                return None
            user = UserSource(self.user_code, mods.filename) if self.user_code is not None else None
            dtype = self.result.spec.dtype
            kernel_dtype = "float16" if dtype == "fp16" else "bfloat16"
            return source_view(mods.score_mod, mods.mask_mod, user=user, compile_report=self.compile_report,
                               dtype=kernel_dtype, head_dim=_report_head_dim(self.result.spec.D))
        return self._get("code", build)

    def _get(self, key, build):
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    # -- assembly ---------------------------------------------------------------------------------------------
    def widget(self):
        """ipywidgets: the table, then one tab per requested section."""
        import ipywidgets as widgets

        table = widgets.HTML(self.table_html())
        table.add_class("flexlab-results-box")
        tabs, titles = [], []
        for name in self.show:
            box = self._section_widget(name, widgets)
            if box is not None:
                tabs.append(box)
                titles.append({"timing": "Timing", "mask": "Mask", "blocks": "Blocks", "code": "Source"}[name])
        tab = widgets.Tab(children=tabs)
        for i, t in enumerate(titles):
            tab.set_title(i, t)
        panel = widgets.VBox([table, tab] if tabs else [table])
        panel.add_class("flexlab-panel")
        return panel

    def _section_widget(self, name: str, widgets):
        if name == "timing":
            return _figure_output(self.timing_figure(), "flexlab-timing-plot", widgets)
        if name == "mask":
            fig = self.mask_figure()
            if fig is None:
                return widgets.HTML("<i>no score_mod or mask_mod</i>")
            return _figure_output(fig, "flexlab-mask-plot", widgets)
        if name == "blocks":
            rep = self.sparsity()
            if rep is None:
                return widgets.HTML("<i>no mask_mod: every tile is full, nothing is skipped</i>")
            out = _figure_output(rep.figure(), "flexlab-blocks-plot", widgets)
            return widgets.VBox([widgets.HTML(rep._repr_html_()), out])
        if name == "code":
            view = self.source()
            if view is None:
                return widgets.HTML("<i>no mods</i>")
            shown = widgets.HTML(view._repr_html_())
            if view.report is not None or view.source is None:
                return shown
            button = widgets.Button(description="Compile report (sm_90a)", icon="cogs",
                                    tooltip="compile our forward kernel with these mods to PTX and SASS; no GPU needed")
            button.add_class("flexlab-compile-report-button")

            def compile_now(_button):
                button.disabled, button.description = True, "compiling…"
                self.add_compile_report()
                shown.value = view._repr_html_()
                button.layout.display = "none"

            button.on_click(compile_now)
            box = widgets.VBox([button, shown])
            box.compile_button = button
            return box
        return None

    def add_compile_report(self):
        """Compile our kernel around the mods (tens of seconds on a CPU) and attach the report to the source view."""
        view = self.source()
        if view is None or view.source is None or view.report is not None:
            return None if view is None else view.report
        from ..viz.compile_report import forward_kernel_report
        mods, spec = self.result.mods, self.result.spec
        try:
            view.report = forward_kernel_report(mods.score_mod, mods.mask_mod,
                                                dtype="float16" if spec.dtype == "fp16" else "bfloat16",
                                                head_dim=_report_head_dim(spec.D))
        except Exception as err:                                   # noqa: BLE001 - shown in the view
            view.error = f"compile report failed: {type(err).__name__}: {err}"
        return view.report

    def _repr_mimebundle_(self, **kwargs):
        try:
            return self.widget()._repr_mimebundle_(**kwargs)
        except ImportError:
            return {"text/html": self._repr_html_()}

    def _repr_html_(self) -> str:
        """A static fallback without widgets: the table, the inspector table and the source view."""
        parts = [self.table_html()]
        if "blocks" in self.show and self.sparsity() is not None:
            parts.append(self.sparsity()._repr_html_())
        if "code" in self.show and self.source() is not None:
            parts.append(self.source()._repr_html_())
        return "".join(parts)


def _figure_output(fig, css_class: str, widgets):
    out = widgets.Output()
    out.add_class(css_class)
    out.figure = fig               # kept for tests and for users who want the plotly object
    # Written as a display_data record directly: works the same with or without a running kernel.
    out.outputs = ({"output_type": "display_data", "data": figure_bundle(fig), "metadata": {}},)
    return out


def figure_bundle(fig) -> dict:
    """A plotly figure as the plotly mimetype (JupyterLab renders it offline with its own plotly.js), whatever
    plotly's default renderer is set to on this machine."""
    import json

    import plotly.io as pio
    spec = {"data": [], "layout": {}, "config": {"responsive": True}}
    spec.update(json.loads(pio.to_json(fig, validate=False)))
    return {"application/vnd.plotly.v1+json": spec, "text/plain": f"<plotly figure: {fig.layout.title.text}>"}
