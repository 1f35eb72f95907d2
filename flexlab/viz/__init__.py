"""Notebook-facing views of attention variants: mask heatmaps, block-sparsity inspector, generated source.

Nothing here is imported by ``import flexlab``; plotly is only loaded when a figure is made.
"""
from __future__ import annotations

from .compile_report import CompileReport, find_tool, forward_kernel_report, report_from_ptx
from .mask_plot import compare_mods, mask_grid, mask_widget, plot_mask
from .source_view import SourceView, source_view
from .sparsity import SparsityReport, compare_blocks, inspect_blocks

__all__ = ["compare_mods", "mask_grid", "mask_widget", "plot_mask", "SparsityReport", "compare_blocks",
           "inspect_blocks", "SourceView", "source_view", "CompileReport", "forward_kernel_report",
           "report_from_ptx", "find_tool"]
