"""`import flexlab` stays light: no cutlass, plotly, ipywidgets or torch's Dynamo until they are used."""
import os
import subprocess
import sys

import torch

from flexlab import _ops


def test_import_is_lazy():
    code = ("import sys, flexlab; heavy = [m for m in ('cutlass', 'plotly', 'ipywidgets', 'anywidget', "
            "'torch._dynamo') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_constant_under_compile_marks_like_torch():
    """Our Dynamo-free decorator must leave exactly the mark torch's `assume_constant_result` leaves."""
    def ours():
        return "x"

    def theirs():
        return "x"

    assert _ops.constant_under_compile(ours) is ours
    assert torch._dynamo.assume_constant_result(theirs) is theirs
    assert ours.__dict__ == theirs.__dict__ != {}


def test_constant_under_compile_folds_in_a_compiled_graph():
    calls = []

    @_ops.constant_under_compile
    def scale_for(n: int) -> float:
        calls.append(n)
        with open(os.devnull) as fh:  # file I/O: without the mark, Dynamo refuses it under fullgraph=True
            fh.read()
        return float(n) ** -0.5

    @torch.compile(backend="eager", fullgraph=True)
    def f(x):
        return x * scale_for(4)

    x = torch.randn(3)
    torch.testing.assert_close(f(x), x * 0.5)
    assert calls == [4]  # run once while tracing, then part of the graph
    torch.testing.assert_close(f(x + 1), (x + 1) * 0.5)
    assert calls == [4]
