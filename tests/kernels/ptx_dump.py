"""Compile option that keeps a kernel's PTX without writing it into the working directory.

`--keep-ptx` alone dumps every PTX file into the current directory (the repository root under pytest); the tests only
read `compiled.__ptx__`, so the files go to one temporary directory removed when the test process exits.
"""
import atexit
import shutil
import tempfile

_DUMP_DIR = tempfile.mkdtemp(prefix="flexlab-test-ptx-")
atexit.register(shutil.rmtree, _DUMP_DIR, ignore_errors=True)

KEEP_PTX = f" --keep-ptx --dump-dir {_DUMP_DIR}"
