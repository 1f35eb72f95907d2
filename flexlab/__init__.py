"""flexlab: a research toolkit for attention variants with its own CuTeDSL FlexAttention backend."""
from __future__ import annotations

__version__ = "0.1.0"
