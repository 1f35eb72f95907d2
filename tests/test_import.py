"""`import flexlab` stays light: no cutlass, plotly or ipywidgets until they are used."""
import subprocess
import sys


def test_import_is_lazy():
    code = ("import sys, flexlab; heavy = [m for m in ('cutlass', 'plotly', 'ipywidgets', 'anywidget') "
            "if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
