"""Code generator: a Python score_mod / mask_mod becomes readable CuTeDSL that flexlab's kernels inline.

Pipeline: `frontend` traces the mods on proxies (closures included: captured tensors become kernel inputs, captured
numbers runtime arguments) into the typed IR of `ir`; `derivative` adds the backward; `lower_cute` writes the
CuTeDSL source; `lower_torch` evaluates the same IR with torch for tests. `generate()` ties them together.
Importing this package does not import cutlass.
"""
from __future__ import annotations

from .frontend import SUPPORTED_OPS
from .generated import GENERATOR_VERSION, GeneratedMods, generate

__all__ = ["generate", "GeneratedMods", "SUPPORTED_OPS", "GENERATOR_VERSION"]
