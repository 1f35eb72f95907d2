"""flexlab: a research toolkit for attention variants with its own CuTeDSL FlexAttention backend.

Public names only. `import flexlab` never imports cutlass, plotly or ipywidgets; the notebook pieces load on use.
"""
from __future__ import annotations

from .api import BACKENDS, flex_attention
from .backends.torch_flex import reset_torch_backend
from .call_options import AuxOutput, AuxRequest
from .errors import (BackendUnavailableError, FallbackWarning, FlexlabError, RecompileLimitError,
                     UnsupportedModError)
from .mask import BlockMask, and_masks, block_states, create_block_mask, create_mask, noop_mask, or_masks

__version__ = "0.1.0"

__all__ = ["flex_attention", "AuxRequest", "AuxOutput", "create_block_mask", "create_mask", "block_states",
           "BlockMask", "and_masks", "or_masks", "noop_mask", "BACKENDS", "reset_torch_backend", "FlexlabError",
           "UnsupportedModError", "BackendUnavailableError", "RecompileLimitError", "FallbackWarning", "Playground",
           "load_ipython_extension", "unload_ipython_extension"]


def __getattr__(name):  # lazy: the widget pulls in ipywidgets/anywidget
    if name == "Playground":
        from .jupyter.playground import Playground
        return Playground
    raise AttributeError(f"module 'flexlab' has no attribute {name!r}")


def load_ipython_extension(ipython):
    """`%load_ext flexlab` registers the `%%flexattn` cell magic."""
    from .jupyter.magic import load_ipython_extension as _load
    _load(ipython)


def unload_ipython_extension(ipython):
    from .jupyter.magic import unload_ipython_extension as _unload
    _unload(ipython)
