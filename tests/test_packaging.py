"""The wheel carries what a user needs beyond the Python code: the gallery and the built widget assets."""
from __future__ import annotations

import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    pytest.importorskip("hatchling")
    out = tmp_path_factory.mktemp("wheel")
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                          str(out), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    (whl,) = out.glob("flexlab-*.whl")
    return whl


def test_wheel_contains_gallery_and_widget_assets(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    gallery = [n for n in names if n.startswith("flexlab/_gallery/") and n.endswith(".py")]
    assert len(gallery) == len(list((ROOT / "gallery").glob("*.py")))
    static = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "flexlab/jupyter/static").rglob("*")
                    if p.is_file())
    assert static, "no built widget assets in flexlab/jupyter/static"
    for rel in static:
        assert rel in names, f"{rel} missing from the wheel"


def test_installed_wheel_loads_its_gallery(wheel, tmp_path):
    target = tmp_path / "site"
    res = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                          str(wheel)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    code = ("import flexlab, flexlab.gallery as g; assert flexlab.__file__.startswith(%r), flexlab.__file__; "
            "print(len(g.load_gallery()))" % str(target))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    assert int(run.stdout.strip()) == len(list((ROOT / "gallery").glob("*.py"))) - \
        len(list((ROOT / "gallery").glob("_*.py")))
