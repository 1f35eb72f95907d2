"""The mask heatmap shows exactly the mask torch would build, and aggregates long sequences without an S×S array."""
from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

pytest.importorskip("plotly")

from flexlab.viz.mask_plot import axis_cells, compare_mods, mask_grid, mask_widget, plot_mask  # noqa: E402
from flexlab.viz.sparsity import measure_build  # noqa: E402


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 37)


def head_dependent(b, h, q_idx, kv_idx):
    return (q_idx + kv_idx + 3 * h + b) % 4 != 0


def stacked(b, h, q_idx, kv_idx):
    # Stacking the indices needs them as true scalars: broadcast index vectors would not stack.
    return torch.stack([q_idx, kv_idx]).sum(0) % 3 == 0


def rel_bias(score, b, h, q_idx, kv_idx):
    return score + 0.25 * (kv_idx - q_idx) - h


@pytest.mark.parametrize("mod", [causal, sliding, head_dependent, stacked])
@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (37, 53), (129, 64)])
def test_small_figure_equals_create_mask(mod, q_len, kv_len):
    b, h = 1, 2
    fig = plot_mask(mod, q_len=q_len, kv_len=kv_len, b=b, h=h)
    dense = create_mask(mod, 2, 3, q_len, kv_len, device="cpu")[b, h]
    z = torch.tensor(fig.data[0].z)
    assert z.shape == (q_len, kv_len)
    assert torch.equal(z.bool(), dense)
    assert list(fig.data[0].x) == list(range(kv_len)) and list(fig.data[0].y) == list(range(q_len))
    assert "q %{y}" in fig.data[0].hovertemplate and "kv %{x}" in fig.data[0].hovertemplate


def test_tick_labels_at_small_sizes():
    fig = plot_mask(causal, q_len=8, kv_len=12)
    assert list(fig.layout.xaxis.tickvals) == list(range(12))
    assert list(fig.layout.yaxis.tickvals) == list(range(8))
    assert fig.layout.yaxis.autorange == "reversed"


def test_score_values_match_dense_math_and_mask_blanks():
    q_len, kv_len, d = 24, 40, 16
    grid = mask_grid(causal, rel_bias, q_len=q_len, kv_len=kv_len, h=1, head_dim=d, qk="random", seed=3)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(q_len, d, generator=g)
    g = torch.Generator().manual_seed(4)
    k = torch.randn(kv_len, d, generator=g)
    qi, ki = torch.arange(q_len)[:, None], torch.arange(kv_len)[None, :]
    expected = rel_bias((q @ k.T) / math.sqrt(d), 0, 1, qi, ki).double()
    allowed = qi >= ki
    assert torch.isnan(grid.values[~allowed]).all()
    torch.testing.assert_close(grid.values[allowed], expected[allowed], rtol=1e-5, atol=1e-5)


def test_ones_qk_gives_constant_scores():
    grid = mask_grid(None, lambda s, b, h, q, kv: s, q_len=5, kv_len=7, qk="ones", head_dim=16)
    torch.testing.assert_close(grid.values, torch.full((5, 7), 4.0, dtype=torch.float64))


def test_aggregated_cells_equal_block_means():
    q_len, kv_len = 1000, 777                          # ragged last cells on both axes
    grid = mask_grid(sliding, q_len=q_len, kv_len=kv_len, max_cells=32, exact=True)
    assert grid.aggregated and grid.exact and (grid.q.cell, grid.kv.cell) == (32, 32)
    dense = create_mask(sliding, 1, 1, q_len, kv_len, device="cpu")[0, 0].double()
    for i in range(grid.q.n_cells):
        for j in range(grid.kv.n_cells):
            block = dense[i * 32:(i + 1) * 32, j * 32:(j + 1) * 32]
            assert grid.values[i, j].item() == pytest.approx(block.mean().item(), abs=1e-12)
    fig = plot_mask(sliding, q_len=q_len, kv_len=kv_len, max_cells=32, exact=True)
    assert torch.equal(torch.tensor(fig.data[0].z), grid.values)
    first = fig.data[0].customdata[0][0]
    assert list(first) == [0, 31, 0, 31] and "mean allowed" in fig.data[0].hovertemplate


def test_sampled_cells_approximate_exact_means():
    exact = mask_grid(sliding, q_len=2048, max_cells=32, exact=True)
    sampled = mask_grid(sliding, q_len=2048, max_cells=32, exact=False, samples=16)
    assert not sampled.exact and sampled.values.shape == exact.values.shape
    assert (sampled.values - exact.values).abs().max() < 0.1
    assert (sampled.values == 0).eq(exact.values == 0).float().mean() > 0.97


def test_axis_cells_cover_every_sample_once():
    ax = axis_cells(1000, 7, samples=4)
    assert ax.cell == 256 and ax.n_cells == 4 and int(ax.ends[-1]) == 1000
    assert torch.all(ax.sample_idx[1:] > ax.sample_idx[:-1])
    assert torch.equal(ax.sample_cell, ax.sample_idx // 256)


def test_128k_runs_in_small_memory():
    grid, cost = measure_build(lambda: mask_grid(causal, q_len=131072, kv_len=131072, max_cells=256))
    assert grid.values.shape == (256, 256) and grid.q.cell == 512 and not grid.exact
    # A dense bool mask would be 16 GiB; the grid walk stays far below 1 GiB.
    assert cost.peak_host_bytes < 512 * 2**20, cost
    below = torch.ones(256, 256, dtype=torch.bool).tril(-1)
    assert torch.all(grid.values[below] == 1) and torch.all(grid.values[below.T] == 0)
    assert 0.45 < grid.values.diagonal().mean() < 0.6


def test_compare_mods_has_both_and_difference():
    fig = compare_mods(causal, sliding, q_len=64, kv_len=64)
    za, zb, zd = (torch.tensor(t.z) for t in fig.data)
    assert torch.equal(za.bool(), create_mask(causal, 1, 1, 64, 64, device="cpu")[0, 0])
    assert torch.equal(zb.bool(), create_mask(sliding, 1, 1, 64, 64, device="cpu")[0, 0])
    assert torch.equal(zd, za - zb)


def test_both_panels_when_both_mods_given():
    fig = plot_mask(causal, rel_bias, q_len=16)
    assert len(fig.data) == 2 and "mask_mod causal" in fig.layout.annotations[0].text


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="mask_mod or a score_mod"):
        mask_grid(q_len=4)
    with pytest.raises(ValueError, match="show must be"):
        plot_mask(causal, q_len=4, show="blocks")
    with pytest.raises(ValueError, match="q_len must be a positive int, got 0"):
        mask_grid(causal, q_len=0)


def test_widget_sliders_redraw_for_chosen_head():
    pytest.importorskip("ipywidgets")
    box = mask_widget(head_dependent, q_len=12, kv_len=12, B=2, H=4)
    box.h_slider.value = 3
    box.b_slider.value = 1
    z = torch.tensor(box.figure.data[0].z)
    assert torch.equal(z.bool(), create_mask(head_dependent, 2, 4, 12, 12, device="cpu")[1, 3])
    assert "flexlab-mask-plot" in box._dom_classes
