"""Shared pytest set-up: GPU tests are skipped where CUDA is missing, browser tests where Chromium is."""
from __future__ import annotations

import shutil

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    has_chromium = shutil.which("chromium") is not None or shutil.which("chromium-browser") is not None
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "browser" in item.keywords and not has_chromium:
            item.add_marker(pytest.mark.skip(reason="needs Debian's chromium (apt-get install chromium)"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
