"""Debug switch: fill the buffers the kernels are meant to write (O, LSE, dQ, dK, dV and the backward's row
statistics and dQ sums) with NaN before the kernels run.

The CUDA caching allocator hands a call the memory its previous call freed, so a tile a kernel forgets to write can
hold last call's correct values and pass a comparison. With the switch on, an unwritten element reads NaN. The test
suite turns it on (tests/conftest.py); `FLEXLAB_POISON_OUTPUTS=1` turns it on anywhere else. Off, the launch paths
pay one module-attribute test per call.
"""
from __future__ import annotations

import contextlib
import os

import torch

ENABLED: bool = os.environ.get("FLEXLAB_POISON_OUTPUTS", "") == "1"


def fill(*buffers: torch.Tensor | None) -> None:
    """NaN into every floating-point buffer given (None skipped)."""
    for t in buffers:
        if t is not None:
            t.fill_(float("nan"))


@contextlib.contextmanager
def poisoned():
    """The switch on inside the block (the benchmark's checked first call of each backend), as it was after."""
    global ENABLED
    was, ENABLED = ENABLED, True
    try:
        yield
    finally:
        ENABLED = was
