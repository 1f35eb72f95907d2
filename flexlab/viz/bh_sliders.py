"""The b / h slider box the mask plot and the sparsity inspector share (ipywidgets, imported when used)."""
from __future__ import annotations

from typing import Callable


def figure_with_bh_sliders(fig, B: int, H: int, redraw: Callable[[object, int, int], None], css_class: str):
    """A VBox of two sliders over `fig` (a plotly FigureWidget); moving either calls `redraw(fig, b, h)`.

    The box exposes `.figure`, `.b_slider` and `.h_slider` for notebooks and tests."""
    import ipywidgets as widgets

    b_slider = widgets.IntSlider(value=0, min=0, max=max(B - 1, 0), description="b", disabled=B <= 1)
    h_slider = widgets.IntSlider(value=0, min=0, max=max(H - 1, 0), description="h", disabled=H <= 1)

    def on_change(_change=None):
        redraw(fig, b_slider.value, h_slider.value)

    b_slider.observe(on_change, names="value")
    h_slider.observe(on_change, names="value")
    box = widgets.VBox([widgets.HBox([b_slider, h_slider]), fig])
    box.add_class(css_class)
    box.figure, box.b_slider, box.h_slider = fig, b_slider, h_slider
    return box
