"""What gets benchmarked: one `Row` per (variant, shape, pass), grouped into named row sets.

The default sets are the rows of the performance issues: forward rows at H=16 in bf16 over the common variants, and
forward+backward rows for training. A row knows its own FLOP count once its mask density is known, so every
backend's TFLOP/s on a row is computed from the same number.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

FWD, FWD_BWD = "fwd", "fwd+bwd"
# Backward does 2.5x the forward's matmul work (recompute S, then dP, dS·K, dSᵀ·Q, Pᵀ·dO).
PASS_FLOP_FACTOR = {FWD: 1.0, FWD_BWD: 3.5}

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Row:
    """One benchmark case. `variant` names a case in `flexlab.bench.cases`; `mode` is "fwd" or "fwd+bwd"."""

    variant: str
    B: int
    S: int
    D: int = 128
    H: int = 16
    dtype: str = "bf16"
    mode: str = FWD

    def __post_init__(self):
        if self.mode not in PASS_FLOP_FACTOR:
            raise ValueError(f"Row.mode must be one of {tuple(PASS_FLOP_FACTOR)}, got {self.mode!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"Row.dtype must be one of {tuple(_DTYPES)}, got {self.dtype!r}")
        for name in ("B", "S", "D", "H"):
            if getattr(self, name) < 1:
                raise ValueError(f"Row.{name} must be positive, got {getattr(self, name)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def name(self) -> str:
        return f"{self.mode} {self.variant} B{self.B} S{_short(self.S)} H{self.H} D{self.D} {self.dtype}"

    def flops(self, density: float) -> float:
        """Matmul FLOPs: 4·B·H·S·S·D·density forward (QKᵀ and PV), times 3.5 for forward+backward."""
        return attention_flops(self.B, self.H, self.S, self.S, self.D, density, self.mode)

    def shrunk(self, S: int = 256, H: int = 2, D: int | None = None) -> "Row":
        """A tiny copy of this row for --quick runs and CPU tests (same variant and pass)."""
        return replace(self, B=1, S=min(S, self.S), H=min(H, self.H), D=min(D or self.D, self.D))


def attention_flops(B: int, H: int, Sq: int, Skv: int, D: int, density: float = 1.0, mode: str = FWD) -> float:
    """FLOPs of the two attention matmuls over the kept (q, kv) pairs, for one forward or forward+backward pass."""
    if not 0.0 <= density <= 1.0:
        raise ValueError(f"density must lie in [0, 1], got {density}")
    return 4.0 * B * H * Sq * Skv * D * density * PASS_FLOP_FACTOR[mode]


def _short(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 and n >= 1024 else str(n)


def _fwd_rows() -> list[Row]:
    sizes = [(8, 1024), (4, 4096), (1, 16384)]
    long_sizes = sizes[1:]
    rows = [Row("dense", B, S) for B, S in sizes]
    rows += [Row("causal", B, S) for B, S in sizes]
    for variant in ("sliding_window", "document", "alibi_causal", "softcap_causal"):
        rows += [Row(variant, B, S) for B, S in long_sizes]
    for variant in ("dense", "causal"):
        rows += [Row(variant, B, S, D=64) for B, S in long_sizes]
    return rows


def _bwd_rows() -> list[Row]:
    long_sizes = [(4, 4096), (1, 16384)]
    rows = []
    for variant in ("dense", "causal", "sliding_window", "document", "alibi_causal", "softcap_causal"):
        rows += [Row(variant, B, S, mode=FWD_BWD) for B, S in long_sizes]
    rows += [Row(variant, 1, 16384, D=64, mode=FWD_BWD)
             for variant in ("dense", "causal", "sliding_window", "document")]
    return rows


def _d256_rows() -> list[Row]:
    """Head dim 256 (the wanted size; the default sets stop at 128): forward and forward+backward."""
    rows = []
    for mode in (FWD, FWD_BWD):
        rows += [Row(variant, 4, 4096, D=256, mode=mode) for variant in ("dense", "causal", "sliding_window")]
        rows += [Row("causal", 1, 16384, D=256, mode=mode)]
    return rows


def _validation_rows() -> list[Row]:
    """A handful of rows touching every peer and every kind of mod, for checking a machine quickly."""
    return [Row("causal", 4, 4096), Row("causal", 4, 4096, mode=FWD_BWD), Row("document", 4, 4096),
            Row("softcap_causal", 4, 4096), Row("document", 4, 4096, mode=FWD_BWD), Row("sliding_window", 4, 4096),
            Row("alibi_causal", 4, 4096)]


ROW_SETS: dict[str, list[Row]] = {
    "fwd-default": _fwd_rows(),
    "bwd-default": _bwd_rows(),
    "validate": _validation_rows(),
    "d256": _d256_rows(),
}
ROW_SETS["all"] = ROW_SETS["fwd-default"] + ROW_SETS["bwd-default"]


def select_rows(spec: str, only: str | None = None) -> list[Row]:
    """Rows of the comma-separated set names in `spec`, optionally kept only where `only` (or one of its
    `|`-separated alternatives) is in the row's name.

    Example: ``select_rows("fwd-default", only="causal")``, ``select_rows("bwd-default", only="dense|causal")``.
    """
    rows: list[Row] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if part not in ROW_SETS:
            raise ValueError(f"--rows: unknown row set {part!r}; known sets: {', '.join(ROW_SETS)}")
        rows += [r for r in ROW_SETS[part] if r not in rows]
    if only:
        wanted = [w for w in only.split("|") if w]
        rows = [r for r in rows if any(w in r.name for w in wanted)]
    if not rows:
        raise ValueError(f"--rows {spec!r}" + (f" with --only {only!r}" if only else "") + " selects no rows")
    return rows
