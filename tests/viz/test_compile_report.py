"""ptxas/nvdisasm parsing on real tool output, graceful reports when tools are missing, and our real kernel."""
from __future__ import annotations

import pytest

from flexlab.viz import compile_report as cr
from flexlab.viz.compile_report import (CompileReport, find_tool, parse_ptxas_verbose, report_from_ptx,
                                        sass_groups, sass_opcodes)

# A tiny sm_90a kernel: out[i] = exp2(in[i]) * 3, one global load/store, one MUFU.EX2.
PTX = """
.version 8.0
.target sm_90a
.address_size 64
.visible .entry scale_exp2(.param .u64 p_in, .param .u64 p_out)
{
    .reg .b32 %r<3>;
    .reg .b64 %rd<7>;
    .reg .f32 %f<4>;
    ld.param.u64 %rd1, [p_in];
    ld.param.u64 %rd2, [p_out];
    cvta.to.global.u64 %rd3, %rd1;
    cvta.to.global.u64 %rd4, %rd2;
    mov.u32 %r1, %tid.x;
    mul.wide.u32 %rd5, %r1, 4;
    add.s64 %rd6, %rd3, %rd5;
    ld.global.f32 %f1, [%rd6];
    ex2.approx.f32 %f2, %f1;
    mul.f32 %f3, %f2, 0f40400000;
    add.s64 %rd6, %rd4, %rd5;
    st.global.f32 [%rd6], %f3;
    ret;
}
"""


def test_parse_ptxas_verbose():
    text = ("ptxas info    : Compiling entry function 'k' for 'sm_90a'\n"
            "ptxas info    : Function properties for k\n"
            "    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
            "ptxas info    : Used 168 registers, used 16 barriers, 2048 bytes smem, 400 bytes cmem[0]\n")
    got = parse_ptxas_verbose(text)
    assert got == {"registers": 168, "barriers": 16, "stack_bytes": 16, "spill_store_bytes": 8,
                   "spill_load_bytes": 4, "smem_static_bytes": 2048}


def test_sass_opcodes_and_groups():
    sass = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/              @!P0 MUFU.EX2 R4, R4 ;
        /*0020*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24 ;
        /*0030*/               @P1 HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], R24, gsb0 ;
        /*0040*/                   MUFU.RCP R5, R6 ;
        /*0050*/                   FFMA R1, R2, R3, R4 ;
        /*0060*/                   EXIT ;
    """
    ops = sass_opcodes(sass)
    assert ops["MUFU.EX2"] == 1 and ops["MUFU.RCP"] == 1 and ops["HGMMA.64x128x16.F32.BF16"] == 2
    groups = sass_groups(ops)
    assert groups["tensor core (HGMMA = wgmma)"] == 2 and groups["special function (MUFU: exp2, rcp, tanh, ...)"] == 2
    rep = CompileReport(kernel="k", opcodes=ops)
    assert rep.hgmma == 2 and rep.mufu == {"MUFU.EX2": 1, "MUFU.RCP": 1}


@pytest.mark.skipif(find_tool("ptxas") is None, reason="ptxas is not installed")
def test_real_ptxas_and_nvdisasm_on_a_small_kernel():
    rep = report_from_ptx(PTX, kernel="scale_exp2")
    assert not rep.errors, rep.errors
    assert 1 <= rep.registers <= 32 and rep.spill_store_bytes == 0 and rep.spill_load_bytes == 0
    assert rep.ptx["ex2.approx"] == 1 and rep.ptx["wgmma.mma_async"] == 0 and rep.ptxas_seconds > 0
    if find_tool("nvdisasm") is None:
        assert any("nvidia-cuda-nvdisasm" in m for m in rep.missing)
    else:
        assert rep.mufu == {"MUFU.EX2": 1} and rep.hgmma == 0
        assert rep.opcodes["LDG.E"] + rep.opcodes.get("LDG.E.CONSTANT", 0) >= 1
    html = rep._repr_html_()
    assert "registers / thread" in html and "flexlab-compile-report" in html
    assert "<summary>PTX (" in html and "ex2.approx.f32" in html


def test_broken_ptx_is_reported_not_raised():
    if find_tool("ptxas") is None:
        pytest.skip("ptxas is not installed")
    rep = report_from_ptx(PTX.replace("ex2.approx.f32", "ex9.approx.f32"))
    assert rep.registers is None and rep.errors and "ptxas exited" in rep.errors[0]


def test_missing_tools_are_listed_with_install_hint(monkeypatch):
    monkeypatch.setattr(cr, "find_tool", lambda name: None)
    rep = report_from_ptx(PTX, kernel="k")
    assert rep.registers is None and rep.missing == ["ptxas (install with `pip install nvidia-cuda-nvcc`)"]
    assert "missing: ptxas" in rep._repr_html_()


def test_tool_lookup_prefers_path_then_wheels(monkeypatch, tmp_path):
    monkeypatch.setattr(cr.shutil, "which", lambda name: None)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    fake = tmp_path / "cu13" / "bin"
    fake.mkdir(parents=True)
    tool = fake / "nvdisasm"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.setattr(cr, "_wheel_bin_dirs", lambda: [fake])
    assert find_tool("nvdisasm") == str(tool)
    assert find_tool("ptxas") is None


@pytest.mark.slow
def test_forward_kernel_report_without_gpu():
    pytest.importorskip("cutlass")
    if find_tool("ptxas") is None:
        pytest.skip("ptxas is not installed")

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    rep = cr.forward_kernel_report(None, causal, head_dim=64)
    assert not rep.errors, rep.errors
    assert rep.registers and rep.registers <= 255 and rep.ptx["wgmma.mma_async"] > 0
    assert rep.smem_dynamic_bytes > 0 and rep.compile_seconds > 0
    if find_tool("nvdisasm") is not None:
        assert rep.hgmma > 0 and rep.mufu.get("MUFU.EX2", 0) > 0
    assert cr.forward_kernel_report(None, causal, head_dim=64) is rep        # cached per generated source


def test_gemm_loop_is_the_smallest_backward_branch_span_with_hgmma():
    from flexlab.viz.compile_report import sass_gemm_loop
    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   IMAD R2, R3, 0x4, R2 ;
.L_x_1:
        /*0020*/                   R2UR UR4, R2 ;
        /*0030*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ ;
        /*0040*/                   MUFU.EX2 R5, R5 ;
        /*0050*/              @!P0 BRA `(.L_x_1) ;
        /*0060*/                   FADD R6, R6, R7 ;
        /*0070*/               @P1 BRA `(.L_x_0) ;
.L_x_2:
        /*0080*/                   FMUL R8, R8, R9 ;
        /*0090*/               @P2 BRA `(.L_x_2) ;
        /*00a0*/                   BRA `(.L_x_3) ;
.L_x_3:
        /*00b0*/                   EXIT ;
        /*00c0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R0 ;
        /*00d0*/                   BRA `(.L_x_0) ;
"""
    # (the last two lines: an out-of-line mbarrier retry stub jumping home, an unconditional branch, not a loop)
    loop = sass_gemm_loop(sass)
    assert loop == {"R2UR": 1, "HGMMA.64x64x16.F32.BF16": 1, "MUFU.EX2": 1, "BRA": 1}
    assert sass_gemm_loop(sass.replace("HGMMA.64x64x16.F32.BF16", "FFMA")) == {}  # no tensor-core loop
