"""The backward's main loop in SASS (ptxas + nvdisasm, no GPU): the wgmma shared-memory descriptors stay in uniform
registers. Without the warp-uniform stage index ptxas built every descriptor in ordinary registers and copied it
with R2UR (68 R2UR and 27 64-bit carry adds per iteration at D=128, a fifth of the loop)."""
from __future__ import annotations

import pytest

pytest.importorskip("cutlass")


def _loop(D: int, kind: str):
    from bwd_option_report import _mods, compile_ptx, key_for

    from flexlab.kernels.bwd_config import default_bwd_config
    from flexlab.viz.compile_report import report_from_ptx
    g, block_sparse, det = _mods(kind)
    rep = report_from_ptx(compile_ptx(key_for(default_bwd_config(D, det), g, block_sparse, det), g))
    if rep.missing:
        pytest.skip(f"needs {rep.missing}")
    assert not rep.errors, rep.errors
    return rep.loop_opcodes


@pytest.mark.parametrize("D,kind", [(128, "dense"), (128, "mask"), (64, "dense"), (128, "det"), (64, "bias")])
def test_main_loop_keeps_descriptors_in_uniform_registers(D, kind):
    loop = _loop(D, kind)
    hgmma = sum(n for op, n in loop.items() if op.startswith("HGMMA"))
    assert hgmma == (32 if D == 128 else 24), loop  # S, dP, dV, dK, dQ over their K slices
    assert loop.get("R2UR", 0) <= 8, loop
    assert loop.get("IMAD.X", 0) <= 2, loop
