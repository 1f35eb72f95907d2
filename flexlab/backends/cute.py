"""flexlab's own CuTeDSL kernels as a flex_attention backend (Hopper, sm90a)."""
from __future__ import annotations

from ..errors import BackendUnavailableError


def is_supported(q, k, v, score_mod, block_mask, scale, enable_gqa) -> tuple[bool, str]:
    return False, "flexlab's CuTeDSL forward kernel has not landed yet"


def flex_attention_forward(q, k, v, score_mod, block_mask, scale, enable_gqa):
    raise BackendUnavailableError("backend='cute': flexlab's CuTeDSL forward kernel has not landed yet; "
                                  "use backend='torch' or backend='reference'")
