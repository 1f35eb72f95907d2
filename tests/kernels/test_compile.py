"""Compile-only checks of the Hopper forward kernel (CPU, no GPU): it builds for sm_90a, uses wgmma and TMA, and
ptxas reports no spills. This is the CI guard for register pressure."""
from __future__ import annotations

import dataclasses
import shutil

import pytest

pytest.importorskip("cutlass")
if shutil.which("ptxas") is None:
    pytest.skip("ptxas not on PATH", allow_module_level=True)

from flexlab.kernels.config import default_config  # noqa: E402
from flexlab.runtime.compile import CompileKey, KernelMods, compile_report  # noqa: E402


def _key(D, **kw):
    base = dict(source_hash="", has_score_mod=False, has_mask_mod=False, aux_tensor_specs=(), aux_scalar_kinds=(),
                dtype="bfloat16", arch="sm_90a", block_sparse=False, tile_order=False,
                tvm_ffi=False)
    base.update(kw)
    base.setdefault("config", default_config(D, base["block_sparse"], base["has_score_mod"]))
    return CompileKey(**base)


@pytest.mark.parametrize("D", [64, 128, 256])
def test_dense_kernel_compiles_without_spills(D):
    rep = compile_report(_key(D))
    assert rep.has_wgmma and rep.has_tma
    assert rep.spill_store_bytes == 0 and rep.spill_load_bytes == 0, rep


def test_flex_kernel_with_mods_and_block_sparsity_compiles_without_spills():
    from handwritten_mods import document_mask, softcap_score
    key = _key(128, source_hash="t", has_score_mod=True, has_mask_mod=True, aux_tensor_specs=(("int32", 1),),
               aux_scalar_kinds=("float",), block_sparse=True, tile_order=True, dtype="float16")
    rep = compile_report(key, KernelMods(softcap_score, document_mask, "t", (("int32", 1),), ("float",)))
    assert rep.has_wgmma and rep.spill_store_bytes == 0 and rep.spill_load_bytes == 0, rep


@pytest.mark.parametrize("block_sparse", [False, True])
def test_inference_kernel_writes_no_lse(block_sparse):
    """`writes_lse=False` (an inference call that does not return the LSE) drops the LSE stores and nothing else:
    the only global stores of the forward are the LSE's (O leaves through TMA), so its PTX has none."""
    from flexlab.runtime.compile import forward_ptx
    key = _key(128, block_sparse=block_sparse, tile_order=block_sparse)
    with_lse, without = forward_ptx(key), forward_ptx(dataclasses.replace(key, writes_lse=False))
    assert "st.global" in with_lse and "st.global" not in without
    assert without.count("wgmma.mma_async") == with_lse.count("wgmma.mma_async")
    assert without.count("cp.async.bulk.tensor") == with_lse.count("cp.async.bulk.tensor")


# SASS instructions per iteration of the dense forward's main loop (two GEMMs, the online softmax and the O
# rescale of one K/V tile), measured when this test was written, plus ~3%. The wgmma descriptors stay in uniform
# registers (the backward once lost a fifth of its loop to copying them: tests/kernels/test_bwd_sass.py). With lazy
# rescaling (D=128) the budget is for the usual iteration, which jumps over the O rescale's head_dim / 2 multiplies
# (406 instructions when written).
FWD_LOOP_BUDGET = {64: 427, 128: 418}


@pytest.mark.parametrize("D", sorted(FWD_LOOP_BUDGET))
def test_dense_main_loop_stays_within_its_instruction_budget(D):
    from flexlab.runtime.compile import forward_ptx
    from flexlab.viz.compile_report import report_from_ptx
    key = _key(D)
    rep = report_from_ptx(forward_ptx(key))
    if rep.missing:
        pytest.skip(f"needs {rep.missing}")
    loop = rep.loop_opcodes
    assert sum(n for op, n in loop.items() if op.startswith("MUFU.EX2")) >= 64, loop  # one exp2 per score
    skipped = D // 2 if key.config.lazy_rescale else 0
    # (around the branch that skips the O rescale ptxas moves one 64-bit descriptor through regular registers: +3)
    assert loop.get("R2UR", 0) <= (5 if skipped else 2), loop
    assert loop.get("FMUL", 0) >= skipped, loop
    assert sum(loop.values()) - skipped <= FWD_LOOP_BUDGET[D], (sum(loop.values()), loop.most_common(12))
