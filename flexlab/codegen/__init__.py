"""Code generator: a Python score_mod / mask_mod becomes readable CuTeDSL that flexlab's kernels inline.

Pipeline: `frontend` traces the mods on proxies (closures included, see `captures`: captured tensors become kernel
inputs, captured numbers runtime arguments) into the typed IR of `ir`, built through `build`; `derivative` adds the
backward; `lower_cute` writes the CuTeDSL source, with `mask_band` where `band` finds a mask that keeps a key range
per query (causal, sliding windows); `lower_torch` evaluates the same IR with torch. `generate()` (in `generated`)
ties them together; `probe` (imports cutlass) is a small sm_90a kernel that runs generated mods on an
accumulator-shaped fragment for compile and GPU checks. Importing this package does not import cutlass.

Example::

    g = generate(score_mod=lambda score, b, h, q_idx, kv_idx: 30.0 * torch.tanh(score / 30.0))
    print(g.source)          # score_mod, mask_mod, score_mod_bwd, score_mod_aux_grad as @cute.jit functions
    mods = g.module()        # executed once per g.hash; a kernel calls mods.score_mod(...) inside its own jit code
"""
from __future__ import annotations

from .frontend import SUPPORTED_OPS
from .generated import GENERATOR_VERSION, GeneratedMods, generate

__all__ = ["generate", "GeneratedMods", "SUPPORTED_OPS", "GENERATOR_VERSION"]
