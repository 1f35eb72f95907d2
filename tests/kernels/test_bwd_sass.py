"""The backward's main loop in SASS (ptxas + nvdisasm, no GPU): the wgmma shared-memory descriptors stay in uniform
registers. Without the warp-uniform stage index ptxas built every descriptor in ordinary registers and copied it
with R2UR (68 R2UR and 27 64-bit carry adds per iteration at D=128, a fifth of the loop)."""
from __future__ import annotations

import pytest

pytest.importorskip("cutlass")


def _report(D: int, kind: str, with_bits=None, **config):
    """(compile report, configuration) of the backward the launcher runs for `kind` (a block mask at torch's default
    size), with `with_bits` applied to the configuration (`bwd_launch.with_mask_bits`) and then `config` replaced;
    skips without nvdisasm."""
    import dataclasses

    from bwd_option_report import _mods, compile_ptx, key_for

    from flexlab.kernels.bwd_launch import config_for
    from flexlab.viz.compile_report import report_from_ptx
    g, block_sparse, det = _mods(kind)
    cfg = config_for(D, det, g, g is not None and any(g.aux_requires_grad), 128 if block_sparse else None)
    if with_bits is not None:
        cfg = with_bits(cfg)
    cfg = dataclasses.replace(cfg, **config)
    rep = report_from_ptx(compile_ptx(key_for(cfg, g, block_sparse, det), g))
    if rep.missing:
        pytest.skip(f"needs {rep.missing}")
    assert not rep.errors, rep.errors
    return rep, cfg


def _loop(D: int, kind: str):
    rep, cfg = _report(D, kind)
    return rep.loop_opcodes, cfg


def _hgmma_per_step(cfg) -> int:
    """S^T and dP^T (K = head_dim), dV and dK (K = tile_m), dQ (tile_m / 64 row blocks, or one with
    `dq_split_rows`, which gives each warpgroup its own 64 rows; K = tile_n): per warp, in K slices of 16."""
    k = 16
    dq_row_blocks = 1 if cfg.dq_split_rows or cfg.dq_swap_ab else cfg.tile_m // 64  # (transposed: N = tile_m)
    return 2 * cfg.head_dim // k + 2 * cfg.tile_m // k + dq_row_blocks * cfg.tile_n // k


# SASS instructions per iteration of the main loop, measured at the commit that set them, plus ~3%: a change that
# adds per-step work trips this before anyone times it (649 / 534 / 771 / 682 / 1588 before the uniform descriptors,
# the 64-bit dQ stores and the live dS address). D=64 without gradient work steps 128 query rows (708 instructions,
# 354 per 64 rows against 405 with 64-row steps; 637 / 839 dense / mask once each warpgroup formed its own 64 dQ
# rows, 32 HGMMA per step instead of 40). D=128 dense steps 80 rows with dQ transposed (502 instructions, 402 per 64
# rows against 444).
LOOP_BUDGET = {(128, "dense"): 517, (128, "mask"): 645, (64, "dense"): 656, (64, "mask"): 865, (128, "det"): 525,
               (64, "bias"): 1540}


@pytest.mark.parametrize("D,kind", list(LOOP_BUDGET))
def test_main_loop_keeps_descriptors_in_uniform_registers(D, kind):
    loop, cfg = _loop(D, kind)
    hgmma = sum(n for op, n in loop.items() if op.startswith("HGMMA"))
    assert hgmma == _hgmma_per_step(cfg), loop
    assert loop.get("R2UR", 0) <= 8, loop
    assert loop.get("IMAD.X", 0) <= 2, loop
    assert sum(loop.values()) <= LOOP_BUDGET[D, kind], (sum(loop.values()), loop.most_common(12))


def _dp_wait_positions(D: int, kind: str, **config) -> list[tuple[int, int]]:
    """For each step loop of the backward built for `kind` with `config` replaced: (exponentials before the wait for
    dP^T, exponentials in the step)."""
    from flexlab.viz.compile_report import exp2_before
    out = [exp2_before(body, "WARPGROUP.DEPBAR.LE gsb0, 0x0")  # the first full wait: dP^T's
           for body in _loop_bodies(D, kind, **config)]
    assert out
    return out


def test_anchored_wait_forms_p_beside_the_dp_gemm():
    """`BwdConfig.anchored_wait` (a sweep candidate): in the block-mask backward ptxas waits for dP^T before the
    first exponential of P, so P is formed after that GEMM, not beside it (the dense kernel waits after a few); with
    the wait behind an arrive computed from the first probability, it comes after the first exponentials."""
    free = _dp_wait_positions(128, "mask")
    anchored = _dp_wait_positions(128, "mask", anchored_wait=True)
    assert all(before == 0 for before, _ in free), free  # why the option exists
    assert all(1 <= before < total // 2 for before, total in anchored), anchored


@pytest.mark.parametrize("kind,live", [("mask", False), ("dense", False), ("dense", True)])
def test_anchor_exps_and_early_lse2_form_half_of_p_beside_the_dp_gemm(kind, live):
    """FA4's causal step reads its LSE2 rows between the S^T and dP^T issues and forms 16 of its 32 probabilities
    before it waits for dP^T (its dense step 11 of 40; ours 6 without the option). `stats_before_dp` puts our LSE2
    loads there, and `anchor_exps=16` ties the dP^T wait to the first 16 probabilities, so at least those are formed
    beside that GEMM; in the dense step also with the dS store's address kept live (`ds_store_live`)."""
    deep = _dp_wait_positions(128, kind, anchored_wait=True, anchor_exps=16, stats_before_dp=True,
                              ds_store_live=live)
    assert all(16 <= before < total for before, total in deep), deep
    for body in _loop_bodies(128, kind, stats_before_dp=True, ds_store_live=live):
        hgmma = [i for i, ins in enumerate(body) if ins.startswith("HGMMA")]
        lds = [i for i, ins in enumerate(body) if ins.startswith("LDS")]
        # S^T and dP^T take head_dim / 16 HGMMA each: the LSE2 loads (the step's first) come before dP^T's first
        assert len(lds) >= 8 and lds[7] < hgmma[128 // 16], (lds[:8], hgmma[:9])


def test_bits_before_wait_loads_the_stored_mask_bits_ahead_of_the_stage_wait():
    """`bits_before_wait` (on): a partial step's stored mask bits (two LDG per thread) are issued before the wait for
    the step's Q/dO stage, not after the S^T and dP^T issues, where their wait showed in the documents profile."""
    from flexlab.kernels.bwd_launch import with_mask_bits
    for late, early in zip(_loop_bodies(128, "mask", with_bits=with_mask_bits, bits_before_wait=False),
                           _loop_bodies(128, "mask", with_bits=with_mask_bits)):
        def loads_before_wait(body):  # (the block-list walk's loads count in both)
            wait = next(i for i, ins in enumerate(body) if ins.startswith("SYNCS"))
            return sum(ins.startswith("LDG") for ins in body[:wait])
        assert loads_before_wait(early) == loads_before_wait(late) + 2, (loads_before_wait(early),
                                                                         loads_before_wait(late))


def test_live_ds_store_address_leaves_the_thread_index_out_of_the_step():
    """`ds_store_live`: the dS store's address stays in a register, as FA4's does, instead of being rebuilt in every
    step from the thread index (an S2R and a chain of ~25 integer instructions between the dP^T wait and the dV GEMM's
    issue): at least 20 instructions fewer per step, no thread-index read added."""
    for kind in ("dense", "mask"):
        rebuilt, live = _loop_bodies(128, kind), _loop_bodies(128, kind, ds_store_live=True)
        for a, b in zip(rebuilt, live):
            s2r = [sum(ins.startswith("S2R") for ins in body) for body in (a, b)]
            assert s2r[1] <= s2r[0], (kind, s2r)
            assert len(b) <= len(a) - 20, (kind, len(a), len(b))


def test_partial_index_only_reads_one_block_list_per_step():
    """`partial_index_only` (on): the consumers read a step's query-tile index from the partial list alone (full
    steps use none), not from whichever of the two lists the step is in: one global load fewer in the step loop."""
    for a, b in zip(_loop_bodies(128, "mask", partial_index_only=False), _loop_bodies(128, "mask")):
        loads = [sum(ins.startswith("LDG") for ins in body) for body in (a, b)]
        assert loads[1] == loads[0] - 1, loads


def _loop_bodies(D: int, kind: str, with_bits=None, **config) -> list[list[str]]:
    """SASS of each step loop (those with exponentials) of `_report`'s kernel, which must not spill."""
    rep, _ = _report(D, kind, with_bits, **config)
    assert rep.spill_store_bytes == 0, rep.spill_store_bytes
    return [body for body, opcodes in zip(rep.gemm_loop_bodies, rep.gemm_loops) if opcodes.get("MUFU.EX2")]


@pytest.mark.parametrize("D", [128, 64])
def test_whole_tiles_of_a_cut_last_wave_run_the_loops_of_a_kernel_without_a_tail(D):
    """`BwdConfig.whole_tiles_only` (the first of the two kernels of a cut last wave) only guards the CTAs of the cut
    tiles: its step loops are the default kernel's, instruction for instruction. (One kernel that also ran the parts
    decoded its tile from a 1-D index and bounded its steps at run time: its whole tiles were 2-4% slower.)"""
    bodies = []
    for whole_tiles_only in (False, True):
        rep, _ = _report(D, "dense", whole_tiles_only=whole_tiles_only)
        bodies.append([[ins.split()[0] for ins in body] for body in rep.gemm_loop_bodies])
    assert bodies[0] and bodies[0] == bodies[1]


def _sliding_window_reports(D: int, **variants) -> dict:
    """Compile reports of the backward's kernel for a sliding window of 1024 (the launcher's configuration at
    head_dim D under a 128 block mask), one per variant name -> `BwdConfig` fields; skips without nvdisasm."""
    import dataclasses

    from bwd_option_report import compile_ptx, key_for

    from flexlab.codegen import generate
    from flexlab.kernels.bwd_launch import config_for
    from flexlab.viz.compile_report import report_from_ptx

    def sliding(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 1024)

    g = generate(None, sliding, fastmath=True)
    cfg = config_for(D, False, g, False, 128)
    reports = {}
    for name, fields in variants.items():
        rep = report_from_ptx(compile_ptx(key_for(dataclasses.replace(cfg, **fields), g, True, False), g))
        if rep.missing:
            pytest.skip(f"needs {rep.missing}")
        assert not rep.errors and rep.spill_store_bytes == 0 and rep.spill_load_bytes == 0
        reports[name] = rep
    return reports


# SASS instructions per step loop, sliding window of 1024 with the launcher's configuration (`BwdConfig.band_mask`
# off / on, CPU compile when the option landed): D=64 partial-tile loop 942 / 791 (full-tile loop 648 both), D=128
# one loop 622 / 563 and 691 / 631.
@pytest.mark.parametrize("D", [64, 128])
def test_band_mask_tests_each_key_row_once(D):
    """`BwdConfig.band_mask`: a sliding window's partial query tiles take each key row's query range from the
    generated `mask_band_by_key` and keep scores by bit (R2P + FSEL): shorter loops, no other loop changed, no
    spills."""
    reports = _sliding_window_reports(D, off=dict(band_mask=False), on=dict(band_mask=True))
    loops = {band: [(sum(c.values()), c.get("R2P", 0)) for c in reports["on" if band else "off"].gemm_loops]
             for band in (False, True)}
    assert len(loops[False]) == len(loops[True])
    shorter = [off - on for (off, _), (on, _) in zip(loops[False], loops[True])]
    assert max(shorter) >= 50 and min(shorter) >= 0, loops  # loops that hold no partial tile stay as they are
    assert all((r2p > 0) == (cut > 0) for (_, r2p), cut in zip(loops[True], shorter)), loops


@pytest.mark.parametrize("D", [64, 128])
def test_mask_early_forms_the_band_words_while_the_st_gemm_runs(D):
    """`mask_early` with `band_mask`: each key row's word of kept queries is formed before the step waits for S^T.
    Without mask_early, D=128's one loop (a runtime branch on the tile's kind) forms it after the wait, where the
    H200 timed the band slower than mask_mod; D=64's partial-tile loop (`kind_loops`) has no branch, and ptxas
    places the words ahead of the GEMM's issue either way."""
    from flexlab.viz.compile_report import variable_shifts_before_wait
    reports = _sliding_window_reports(D, late=dict(band_mask=True), early=dict(band_mask=True, mask_early=True))
    # (partial tiles come first)
    ahead = {early: variable_shifts_before_wait(reports["early" if early else "late"].gemm_loop_bodies[0])
             for early in (False, True)}
    assert ahead[True][0] >= 4 and ahead[True][1] > 0, ahead
    assert ahead[False][0] == (0 if D == 128 else ahead[True][0]), ahead
