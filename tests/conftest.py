"""Shared pytest set-up: GPU tests are skipped where CUDA is missing, browser tests where Chromium is; every buffer a
kernel is meant to write is filled with NaN before it runs (`flexlab.runtime.poison`)."""
from __future__ import annotations

import os
import shutil

os.environ["FLEXLAB_POISON_OUTPUTS"] = "1"  # (before flexlab is imported: subprocesses of the tests inherit it)

import pytest  # noqa: E402
import torch  # noqa: E402

from flexlab.runtime import poison  # noqa: E402

poison.ENABLED = True  # (in case a plugin imported flexlab before this file set the variable)


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
