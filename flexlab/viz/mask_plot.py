"""Heatmaps of a mask_mod / score_mod, exact for short sequences and cell-aggregated for long ones.

A 128k x 128k mask has 1.7e10 entries, so the visualizer never builds an S x S array: it splits both axes into at
most ``max_cells`` cells and evaluates the mods only on a separable lattice of sample indices (every index when the
grid is small enough, ``samples`` evenly spaced indices per cell axis otherwise), one bounded chunk of rows at a
time. Each cell shows the mean over its samples: the allowed fraction for a mask, the mean modified score over
allowed positions for a score_mod.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..errors import FlexlabValueError, check_positive_int
from ..mods import check_mask_mod, check_score_mod, evaluate_mask_mod, evaluate_score_mod, mod_name

MaskMod = Callable[..., torch.Tensor]
ScoreMod = Callable[..., torch.Tensor]

#: Upper bound on the number of mod evaluations held at once (one row chunk); keeps memory small at any length.
CHUNK_ELEMENTS = 1 << 21
#: Grids with at most this many entries are evaluated exactly, every index, even when cells are aggregated.
EXACT_BUDGET = 1 << 24


@dataclass(frozen=True)
class AxisCells:
    """How one sequence axis is cut into display cells and which indices are evaluated inside each cell."""

    length: int
    cell: int                      # nominal cell width in tokens (the last cell may be shorter)
    starts: torch.Tensor           # (n_cells,) first token of each cell
    ends: torch.Tensor             # (n_cells,) one past the last token of each cell
    sample_idx: torch.Tensor       # (n_samples,) token indices evaluated, grouped by cell
    sample_cell: torch.Tensor      # (n_samples,) the cell each sample belongs to

    @property
    def n_cells(self) -> int:
        return int(self.starts.numel())

    @property
    def exact(self) -> bool:
        return int(self.sample_idx.numel()) == self.length


@dataclass(frozen=True)
class MaskGrid:
    """What a heatmap shows: per-cell values plus the cell geometry needed for axes and hover text."""

    values: torch.Tensor           # (n_q_cells, n_kv_cells) float64; NaN where a score cell has no allowed entry
    q: AxisCells
    kv: AxisCells
    kind: str                      # "mask" or "score"
    b: int
    h: int

    @property
    def exact(self) -> bool:
        """True when every (q, kv) entry was evaluated (no sampling)."""
        return self.q.exact and self.kv.exact

    @property
    def aggregated(self) -> bool:
        """True when a cell covers more than one (q, kv) entry."""
        return self.q.cell > 1 or self.kv.cell > 1

    def describe(self) -> str:
        if not self.aggregated:
            return "every entry"
        how = "mean of all entries" if self.exact else (
            f"mean of {self.q.sample_idx.numel() // self.q.n_cells}x{self.kv.sample_idx.numel() // self.kv.n_cells}"
            " sampled entries")
        return f"{how} per {self.q.cell}x{self.kv.cell} cell"


def _cell_width(length: int, max_cells: int) -> int:
    """Smallest power-of-two width that fits ``length`` in ``max_cells`` cells (round numbers in the hover)."""
    if length <= max_cells:
        return 1
    return 1 << math.ceil(math.log2(math.ceil(length / max_cells)))


def axis_cells(length: int, max_cells: int, samples: Optional[int]) -> AxisCells:
    """Cut ``[0, length)`` into cells; ``samples=None`` evaluates every index of every cell."""
    if length < 1:
        raise FlexlabValueError(f"sequence length must be >= 1, got {length}")
    if max_cells < 1:
        raise FlexlabValueError(f"max_cells must be >= 1, got {max_cells}")
    cell = _cell_width(length, max_cells)
    starts = torch.arange(0, length, cell)
    ends = torch.clamp(starts + cell, max=length)
    if samples is None or cell <= samples:
        idx = torch.arange(length)
        owner = idx // cell
    else:
        # `samples` evenly spaced offsets centred in each cell; the last, shorter cell is spaced over its own width.
        widths = (ends - starts).to(torch.float64)
        frac = (torch.arange(samples, dtype=torch.float64) + 0.5) / samples
        idx = (starts[:, None] + (frac[None, :] * widths[:, None]).floor().long()).reshape(-1)
        idx = torch.unique_consecutive(idx)          # a last cell narrower than `samples` repeats offsets
        owner = idx // cell
    return AxisCells(length, cell, starts, ends, idx, owner)


def evaluate_mod(fn: Callable, b: int, h: int, q_idx: torch.Tensor, kv_idx: torch.Tensor,
                 score: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Evaluate a mask_mod (``score=None``) or a score_mod on the (len(q_idx), len(kv_idx)) grid for one (b, h).

    Goes through :mod:`flexlab.mods`, the one definition of how a mod is called, so the picture shows what every
    backend computes.
    """
    bt, ht = torch.tensor([b]), torch.tensor([h])
    if score is None:
        return evaluate_mask_mod(fn, bt, ht, q_idx, kv_idx)[0, 0]
    return evaluate_score_mod(fn, score[None, None], bt, ht, q_idx, kv_idx)[0, 0]


def _qk_rows(kind: str, length: int, head_dim: int, seed: int) -> torch.Tensor:
    if kind == "ones":
        return torch.ones(length, head_dim, dtype=torch.float32)
    if kind == "random":
        g = torch.Generator().manual_seed(seed)
        return torch.randn(length, head_dim, generator=g, dtype=torch.float32)
    raise FlexlabValueError(f"qk must be 'random' or 'ones', got {kind!r}")


def mask_grid(mask_mod: Optional[MaskMod] = None, score_mod: Optional[ScoreMod] = None, *, q_len: int,
              kv_len: Optional[int] = None, b: int = 0, h: int = 0, kind: Optional[str] = None,
              max_cells: int = 256, samples: int = 16, exact: Optional[bool] = None, qk: str = "random",
              head_dim: int = 64, seed: int = 0) -> MaskGrid:
    """Per-cell values of a mask (allowed fraction) or of a score_mod (mean modified score over allowed entries).

    Args:
        mask_mod, score_mod: torch FlexAttention-style mods; at least one is needed.
        q_len, kv_len: sequence lengths (``kv_len`` defaults to ``q_len``).
        b, h: the batch and head the mods are evaluated for.
        kind: ``"mask"`` or ``"score"``; defaults to ``"score"`` when a score_mod is given.
        max_cells: at most this many cells per axis; longer axes are aggregated into power-of-two wide cells.
        samples: indices evaluated per cell axis when sampling.
        exact: evaluate every entry (``True``), sample (``False``), or decide by grid size (``None``).
        qk: scores fed to score_mod are ``q @ k.T / sqrt(head_dim)`` for ``"random"`` or ``"ones"`` rows.
    """
    kv_len = q_len if kv_len is None else kv_len
    for name, value in (("q_len", q_len), ("kv_len", kv_len), ("max_cells", max_cells), ("samples", samples),
                        ("head_dim", head_dim)):
        check_positive_int(name, value)
    if mask_mod is None and score_mod is None:
        raise FlexlabValueError("mask_grid needs a mask_mod or a score_mod (both were None)")
    check_mask_mod(mask_mod)
    check_score_mod(score_mod)
    kind = kind or ("score" if score_mod is not None else "mask")
    if kind not in ("mask", "score"):
        raise FlexlabValueError(f"kind must be 'mask' or 'score', got {kind!r}")
    if kind == "score" and score_mod is None:
        raise FlexlabValueError("kind='score' needs a score_mod")
    if exact is None:
        exact = q_len * kv_len <= EXACT_BUDGET
    per_cell = None if exact else samples
    qa, ka = axis_cells(q_len, max_cells, per_cell), axis_cells(kv_len, max_cells, per_cell)

    q_rows = k_rows = None
    if kind == "score":
        q_rows = _qk_rows(qk, q_len, head_dim, seed)[qa.sample_idx]
        k_rows = _qk_rows(qk, kv_len, head_dim, seed + 1)[ka.sample_idx]
    total = torch.zeros(qa.n_cells, ka.n_cells, dtype=torch.float64)
    count = torch.zeros(qa.n_cells, ka.n_cells, dtype=torch.float64)
    n_kv = ka.sample_idx.numel()
    rows_per_chunk = max(1, CHUNK_ELEMENTS // n_kv)
    with torch.no_grad():
        for r0 in range(0, qa.sample_idx.numel(), rows_per_chunk):
            q_idx = qa.sample_idx[r0:r0 + rows_per_chunk]
            allowed = (torch.ones(q_idx.numel(), n_kv, dtype=torch.bool) if mask_mod is None
                       else evaluate_mod(mask_mod, b, h, q_idx, ka.sample_idx).to(torch.bool))
            if kind == "mask":
                vals, weight = allowed.to(torch.float64), torch.ones_like(allowed, dtype=torch.float64)
            else:
                score = (q_rows[r0:r0 + rows_per_chunk] @ k_rows.T) / math.sqrt(head_dim)
                mod = evaluate_mod(score_mod, b, h, q_idx, ka.sample_idx, score).to(torch.float64)
                weight = allowed.to(torch.float64)
                vals = torch.where(allowed, mod, torch.zeros((), dtype=torch.float64))
            cells_q = qa.sample_cell[r0:r0 + rows_per_chunk]
            for acc, x in ((total, vals), (count, weight)):
                by_col = torch.zeros(x.shape[0], ka.n_cells, dtype=torch.float64).index_add_(1, ka.sample_cell, x)
                acc.index_add_(0, cells_q, by_col)
    values = total / count                     # 0/0 -> NaN for score cells with no allowed entry
    if kind == "mask":
        values = torch.nan_to_num(values, nan=0.0)
    return MaskGrid(values, qa, ka, kind, b, h)


def _mod_name(fn: Optional[Callable]) -> str:
    return mod_name(fn) if fn is not None else "none"


def _heatmap(grid: MaskGrid, name: str, coloraxis: Optional[str] = None):
    import plotly.graph_objects as go

    z = grid.values.numpy()
    x, y = grid.kv.starts.numpy(), grid.q.starts.numpy()
    value_label = "allowed" if grid.kind == "mask" else "score"
    if grid.aggregated:
        import numpy as np
        qs, qe = grid.q.starts.numpy(), grid.q.ends.numpy() - 1
        ks, ke = grid.kv.starts.numpy(), grid.kv.ends.numpy() - 1
        custom = np.stack(np.broadcast_arrays(qs[:, None], qe[:, None], ks[None, :], ke[None, :]), axis=-1)
        hover = (f"q %{{customdata[0]}}–%{{customdata[1]}}<br>kv %{{customdata[2]}}–%{{customdata[3]}}"
                 f"<br>mean {value_label} %{{z:.4g}}<extra>{name}</extra>")
        extra = dict(customdata=custom)
    else:
        hover = f"q %{{y}}<br>kv %{{x}}<br>{value_label} %{{z:.4g}}<extra>{name}</extra>"
        extra = {}
    kw = dict(coloraxis=coloraxis) if coloraxis else dict(
        colorscale="Blues" if grid.kind == "mask" else "Viridis", zmin=0.0 if grid.kind == "mask" else None,
        zmax=1.0 if grid.kind == "mask" else None)
    return go.Heatmap(z=z, x=x, y=y, name=name, hovertemplate=hover, xgap=0, ygap=0, **kw, **extra)


def _style_axes(fig, grid: MaskGrid, row=None, col=None):
    small = 48
    xa = dict(title_text="kv index")
    ya = dict(title_text="q index", autorange="reversed")
    if grid.kv.n_cells <= small and not grid.aggregated:
        xa.update(tickmode="array", tickvals=grid.kv.starts.tolist())
    if grid.q.n_cells <= small and not grid.aggregated:
        ya.update(tickmode="array", tickvals=grid.q.starts.tolist())
    fig.update_xaxes(**xa, row=row, col=col)
    fig.update_yaxes(**ya, row=row, col=col)


def plot_mask(mask_mod: Optional[MaskMod] = None, score_mod: Optional[ScoreMod] = None, *, q_len: int,
              kv_len: Optional[int] = None, b: int = 0, h: int = 0, show: Optional[str] = None,
              max_cells: int = 256, samples: int = 16, exact: Optional[bool] = None, qk: str = "random",
              head_dim: int = 64, title: Optional[str] = None):
    """A plotly figure of the mask and/or the score_mod values for one (b, h).

    ``show`` is ``"mask"``, ``"score"`` or ``"both"`` (side by side); by default whatever mods were given.
    Works outside notebooks (``fig.write_html``); see :func:`mask_grid` for the aggregation rules.
    """
    from plotly.subplots import make_subplots

    if show is None:
        show = "both" if (mask_mod is not None and score_mod is not None) else (
            "score" if score_mod is not None else "mask")
    kinds = {"mask": ["mask"], "score": ["score"], "both": ["mask", "score"]}.get(show)
    if kinds is None:
        raise FlexlabValueError(f"show must be 'mask', 'score' or 'both', got {show!r}")
    opts = dict(q_len=q_len, kv_len=kv_len, b=b, h=h, max_cells=max_cells, samples=samples, exact=exact,
                qk=qk, head_dim=head_dim)
    grids = [mask_grid(mask_mod, score_mod, kind=k, **opts) for k in kinds]
    names = {"mask": f"mask_mod {_mod_name(mask_mod)}", "score": f"score_mod {_mod_name(score_mod)}"}
    fig = make_subplots(rows=1, cols=len(grids), subplot_titles=[names[g.kind] for g in grids],
                        horizontal_spacing=0.2)
    for i, grid in enumerate(grids, start=1):
        trace = _heatmap(grid, names[grid.kind])
        domain_end = fig.get_subplot(1, i).xaxis.domain[1]
        trace.colorbar = dict(x=domain_end + 0.015, len=0.9, thickness=14)
        fig.add_trace(trace, row=1, col=i)
        _style_axes(fig, grid, row=1, col=i)
    g0 = grids[0]
    head = title or f"b={b}, h={h}, {g0.q.length}x{g0.kv.length}"
    fig.update_layout(title=dict(text=f"{head} <span style='font-size:11px'>({g0.describe()})</span>"),
                      height=460, width=460 * len(grids) + 80, margin=dict(t=110))
    fig.layout.meta = dict(flexlab="mask_plot", exact=[g.exact for g in grids],
                           cells=[[g.q.cell, g.kv.cell] for g in grids])
    return fig


def compare_mods(mod_a: Callable, mod_b: Callable, *, q_len: int, kv_len: Optional[int] = None,
                 kind: str = "mask", names: tuple[str, str] | None = None, b: int = 0, h: int = 0,
                 max_cells: int = 256, samples: int = 16, exact: Optional[bool] = None, qk: str = "random",
                 head_dim: int = 64):
    """Side-by-side heatmaps of two mask_mods (``kind="mask"``) or two score_mods (``kind="score"``) plus A - B."""
    from plotly.subplots import make_subplots

    if kind not in ("mask", "score"):
        raise FlexlabValueError(f"kind must be 'mask' or 'score', got {kind!r}")
    names = names or (_mod_name(mod_a), _mod_name(mod_b))
    opts = dict(q_len=q_len, kv_len=kv_len, b=b, h=h, max_cells=max_cells, samples=samples, exact=exact, qk=qk,
                head_dim=head_dim, kind=kind)
    if kind == "mask":
        ga, gb = mask_grid(mod_a, None, **opts), mask_grid(mod_b, None, **opts)
    else:
        ga, gb = mask_grid(None, mod_a, **opts), mask_grid(None, mod_b, **opts)
    diff = MaskGrid(ga.values - gb.values, ga.q, ga.kv, ga.kind, b, h)
    fig = make_subplots(rows=1, cols=3, subplot_titles=[names[0], names[1], f"{names[0]} − {names[1]}"],
                        horizontal_spacing=0.11, shared_yaxes=True)
    fig.add_trace(_heatmap(ga, names[0], coloraxis="coloraxis"), row=1, col=1)
    fig.add_trace(_heatmap(gb, names[1], coloraxis="coloraxis"), row=1, col=2)
    fig.add_trace(_heatmap(diff, "difference", coloraxis="coloraxis2"), row=1, col=3)
    for c, g in ((1, ga), (2, gb), (3, diff)):
        _style_axes(fig, g, row=1, col=c)
    span = float(torch.nan_to_num(diff.values.abs(), nan=0.0).max()) or 1.0
    for c in (2, 3):
        fig.update_yaxes(title_text=None, row=1, col=c)
    bar_x = fig.get_subplot(1, 2).xaxis.domain[1] + 0.01
    fig.update_layout(
        coloraxis=dict(colorscale="Blues" if kind == "mask" else "Viridis",
                       colorbar=dict(x=bar_x, len=0.9, thickness=14)),
        coloraxis2=dict(colorscale="RdBu", cmin=-span, cmax=span, colorbar=dict(x=1.01, len=0.9, thickness=14)),
        title=dict(text=f"b={b}, h={h}, {ga.q.length}x{ga.kv.length} "
                        f"<span style='font-size:11px'>({ga.describe()})</span>"),
        height=440, width=1320, margin=dict(t=110))
    fig.layout.meta = dict(flexlab="compare_mods", exact=ga.exact)
    return fig


def mask_widget(mask_mod: Optional[MaskMod] = None, score_mod: Optional[ScoreMod] = None, *, q_len: int,
                kv_len: Optional[int] = None, B: int = 1, H: int = 1, **plot_kwargs):
    """An ipywidgets box: the heatmap plus b / h sliders that re-evaluate the mods for the chosen batch and head."""
    import plotly.graph_objects as go

    from .bh_sliders import figure_with_bh_sliders

    def redraw(fig, b, h):
        new = plot_mask(mask_mod, score_mod, q_len=q_len, kv_len=kv_len, b=b, h=h, **plot_kwargs)
        with fig.batch_update():
            for old_trace, new_trace in zip(fig.data, new.data):
                old_trace.z = new_trace.z
            fig.layout.title = new.layout.title

    fig = go.FigureWidget(plot_mask(mask_mod, score_mod, q_len=q_len, kv_len=kv_len, **plot_kwargs))
    return figure_with_bh_sliders(fig, B, H, redraw, "flexlab-mask-plot")
