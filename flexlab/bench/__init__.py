"""Benchmark harness: flexlab's kernels against torch FlexAttention (Triton, FLASH), FA4 and SDPA, same inputs.

Run it as ``python -m flexlab.bench`` (see ``--help``). Modules, leaf first: `roof` (the GPU's sustained matmul rate,
which "% of roof" is against), `rows` (what is measured, FLOP counts), `cases` (variants and each peer's spelling of
them), `density` (exact mask density), `check` (float64 reference on a slice), `timing` (wall and kernel clocks),
`peers` (the backends), `runner` (one row at a time), `report` (JSON and tables), `cli`.
"""
from .roof import MATMUL_CEILING_TFLOPS
from .rows import ROW_SETS, Row, attention_flops, select_rows

__all__ = ["Row", "ROW_SETS", "select_rows", "attention_flops", "MATMUL_CEILING_TFLOPS"]
