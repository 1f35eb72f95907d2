"""The backward's speed options (BwdConfig booleans, tile_m=128 at D=64, 3 stages) compile for sm_90a without
spills and keep the synchronisation checks of test_bwd_sync, each turned away from the default (which has
stats_in_smem and kv_tiles_first on).

A few compiles per option (the full matrix is tests/kernels/bwd_option_report.py); which option is faster, and
whether its gradients are right, is decided on the H200 by benchmarks/probes/bwd_perf_sweep.py.
"""
from __future__ import annotations

import re
import shutil

import pytest
import torch

cutlass = pytest.importorskip("cutlass")
needs_ptxas = pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs ptxas (CUDA toolkit) on PATH")


def test_default_options_and_candidates_fit():
    from dataclasses import replace

    from flexlab.kernels.bwd_config import BwdConfig, candidate_bwd_configs, default_bwd_config
    # without a block mask D=128 steps 80 rows with dQ computed transposed, filling shared memory
    dense = default_bwd_config(128)
    assert dense == BwdConfig(head_dim=128, tile_m=80, dq_swap_ab=True) and dense.feasibility_error() is None
    assert dense.smem_bytes() == 231424 and dense.block_mask_error(128, 128)
    assert "dq_swap_ab" in BwdConfig(head_dim=64, dq_swap_ab=True).feasibility_error()  # 64 columns per warpgroup
    assert "multiple of 64" in BwdConfig(head_dim=128, tile_m=80).feasibility_error()  # dQ's M = query rows
    for D in (64, 128):
        cfg = default_bwd_config(D, q_block=128)
        assert cfg == BwdConfig(head_dim=D, tile_m=128 if D == 64 else 64, tile_n=128, num_stages=2,
                                dq_split_rows=D == 64, lpt_order=True, kind_loops=D == 64)
        assert cfg.stats_in_smem and cfg.kv_tiles_first and cfg.dq_warp and cfg.dk_after_dq
        assert not (cfg.early_dv or cfg.mask_early)
        # 64-row steps (a score_mod derivative) have no 64-row dQ halves to split between the warpgroups
        assert not default_bwd_config(D, mod_grads=True).dq_split_rows
        det = default_bwd_config(D, deterministic=True)  # the fixed-order dQ reduction takes the turn order
        assert det.stats_in_smem and det.lpt_order
        det_cands = candidate_bwd_configs(D, deterministic=True)
        assert det_cands["default"] == det and not det_cands["natural_order"].lpt_order
        # the grid-order candidates are the grid's order, not the launcher's table again
        for order in ("kv_tiles_first", "neither"):
            assert not det_cands.get(order, BwdConfig(head_dim=D)).lpt_order
        assert not candidate_bwd_configs(D, q_block=128)["heads_first"].lpt_order
        cands = candidate_bwd_configs(D)
        assert next(iter(cands)) == "default" and cands["default"] == default_bwd_config(D)
        for name, c in cands.items():
            assert c.feasibility_error() is None, name
            if c.tile_m % 64 == 0:  # one BlockMask at torch's default size serves them
                assert c.block_mask_error(128, 128) is None, name
    assert "tile_m must be 128" in BwdConfig(head_dim=64, dq_split_rows=True).feasibility_error()
    # D=256: two warpgroups share 64 key rows; the dQ partials go out by vector reductions, which leaves shared
    # memory for two Q/dO stages; deterministic mode keeps the slab (its dQ warp waits for the turns) and one stage,
    # with the vector reductions in turn a candidate
    d256 = default_bwd_config(256)
    assert d256.split_head_dim and (d256.tile_m, d256.tile_n, d256.num_stages) == (64, 64, 2)
    assert d256.dq_red and not d256.dq_warp and d256.feasibility_error() is None
    assert d256.block_mask_error(128, 128) is None
    det256 = default_bwd_config(256, deterministic=True)
    assert not det256.dq_red and det256.dq_warp and det256.num_stages == 1 and det256.feasibility_error() is None
    assert det256.lpt_order  # the launcher's turn order
    assert "shared memory" in replace(det256, num_stages=2).feasibility_error()
    red = candidate_bwd_configs(256, deterministic=True)["dq_red_stages2"]
    assert (red.dq_red, red.dq_warp, red.num_stages) == (True, False, 2) and red.feasibility_error() is None
    assert "dq_red" in replace(d256, dq_warp=True).feasibility_error()
    assert "dq_bulk_reduce" in replace(d256, dq_bulk_reduce=True).feasibility_error()  # (no slab to add)
    assert "split" in replace(d256, tile_n=128).feasibility_error()
    assert set(candidate_bwd_configs(256)) >= {"default", "dq_slab"}
    # The struct's size: 1 KiB of mbarriers (2 KiB with the LSE2/D rows) then six 32 KiB tiles at D=128.
    assert default_bwd_config(128, q_block=128).smem_bytes() == 2048 + 6 * 32768
    assert BwdConfig(head_dim=128, stats_in_smem=False).smem_bytes() == 1024 + 6 * 32768
    assert BwdConfig(head_dim=128, num_stages=3, stats_in_smem=True).smem_bytes() == 2048 + 7 * 32768
    assert "shared memory" in BwdConfig(head_dim=64, tile_m=128, num_stages=3,
                                        stats_in_smem=True).feasibility_error()


def _compile(cfg, kind):
    from bwd_option_report import _mods, compile_ptx, key_for, ptxas_report
    g, block_sparse, det = _mods(kind)
    ptx = compile_ptx(key_for(cfg, g, block_sparse, det), g)
    return ptx, ptxas_report(ptx)


def _check_sync(ptx, cfg):
    """test_bwd_sync's checks with this configuration's byte counts and barrier plan."""
    from test_bwd_sync import _expect_tx_bytes, _mbarrier_init_counts, check_barrier_plan, divergent_collectives
    assert divergent_collectives(ptx) == []
    stats = 2 * cfg.tile_m * 4 if cfg.stats_in_smem else 0
    q_do = 2 * cfg.tile_m * cfg.head_dim * 2 + stats
    # (`split_qdo_wait`: Q with the LSE2 rows and dO with the D rows, each on its own barrier)
    assert _expect_tx_bytes(ptx) == {2 * cfg.tile_n * cfg.head_dim * 2, q_do // 2 if cfg.split_qdo_wait else q_do}
    # (persistent CTAs: the tile slots are released by every consumer thread and the dQ warp's lanes)
    slots = {128 * cfg.num_consumer_wgs + 32} if cfg.persistent else set()
    assert _mbarrier_init_counts(ptx) == {1, 4 * cfg.num_consumer_wgs} | slots
    check_barrier_plan(ptx, cfg)


def _no_spills(report):
    assert report["spill_stores"] == 0 and report["spill_loads"] == 0, report


CELLS = [  # (name, head dim, options, kernel flavour): each option in a few flavours, and the combinations
    ("stats_from_global-dense", 128, dict(stats_in_smem=False), "dense"),
    # (with dK after dQ, the default, LSE2/D from global memory at D=64 with a mask spills 8 B; the sweep times it so)
    ("stats_from_global-mask-d64", 64, dict(stats_in_smem=False, dk_after_dq=False), "mask"),
    ("dk_before_dq-mask", 128, dict(dk_after_dq=False), "mask"),
    # (128-row steps, as the launcher never runs a score_mod at D=64: with the dQ warp on as well it spills 64 B)
    ("dq_in_consumers-bias-d64", 64, dict(dq_warp=False), "bias"),
    ("heads_first-det", 128, dict(kv_tiles_first=False), "det"),
    ("neither-mask", 128, dict(stats_in_smem=False, kv_tiles_first=False), "mask"),
    ("tile_m128-dq_rows-mask", 64, dict(tile_m=128, dq_split_rows=True), "mask"),
    # With a score_mod, 128-row tiles at D=64 spill (~150 B; 120 B with stats_in_smem) unless combined with the
    # other options (bwd_option_report.py has the whole matrix)
    ("combined-bias-d64", 64, dict(stats_in_smem=True, dk_after_dq=True, kv_tiles_first=True, tile_m=128,
                                   dq_split_rows=True, dq_warp=False), "bias"),
    ("early_dv-dense", 128, dict(early_dv=True), "dense"),
    ("early_dv-mask-d64", 64, dict(early_dv=True), "mask"),
    ("early_dv-det", 128, dict(early_dv=True), "det"),
    ("dq_in_consumers-dense", 128, dict(dq_warp=False), "dense"),
    ("dq_in_consumers-mask-d64", 64, dict(dq_warp=False), "mask"),
    ("dq_in_consumers-det", 128, dict(dq_warp=False), "det"),
    ("early_dv-det_mask", 128, dict(early_dv=True), "det_mask"),
    # (deterministic + block mask at D=128 spills 8 B already with the default 2 stages: not this option's doing)
    ("stages3-mask", 128, dict(num_stages=3), "mask"),
    ("stages3-det", 128, dict(num_stages=3, tile_m=64, dq_swap_ab=False), "det"),  # (80 rows fill smem at 2)
    ("tile_m80-dense", 128, dict(), "dense"),  # the no-mask default: 80-row steps, dQ transposed
    ("tile_m80-det", 128, dict(kv_tiles_first=False), "det"),
    ("combined-det_mask", 128, dict(stats_in_smem=True, dk_after_dq=True, kv_tiles_first=True), "det_mask"),
    ("combined-det_mask-d64", 64, dict(stats_in_smem=True, dk_after_dq=True, kv_tiles_first=True, tile_m=128,
                                       dq_split_rows=True), "det_mask"),
    ("try_wait_first-mask", 128, dict(try_wait_first=True), "mask"),
    ("try_wait_first-dense-d64", 64, dict(try_wait_first=True), "dense"),
    ("anchored_wait-mask", 128, dict(anchored_wait=True), "mask"),
    ("anchored_wait-mask-d64", 64, dict(anchored_wait=True), "mask"),
    # persistent CTAs: dK and dV staged in the dS buffers, in two passes at D=128 and one at D=64
    ("persistent-dense", 128, dict(persistent_ctas=132), "dense"),
    ("persistent-mask", 128, dict(persistent_ctas=132), "mask"),
    ("persistent-mask-d64", 64, dict(persistent_ctas=132), "mask"),
    # the split tail: parts of the last wave's tiles walk shares of the steps, publish dK/dV and the last adds them
    ("split_tail-dense", 128, dict(split_tail=True), "dense"),
    ("split_tail-dense-d64", 64, dict(split_tail=True), "dense"),
    ("split_tail-dense_bias", 128, dict(split_tail=True), "dense_bias"),
    ("whole_tiles_only-dense", 128, dict(whole_tiles_only=True), "dense"),
    ("unchained_whole_tiles_only-dense", 128, dict(whole_tiles_only=True, chained_launch=False), "dense"),
    ("unchained-mask", 64, dict(chained_launch=False), "mask"),
    # the dQ slabs added by plain bulk reduces (no tensor map), issued by the dQ warp, by the consumers, in turn
    ("dq_bulk_reduce-mask", 128, dict(dq_bulk_reduce=True), "mask"),
    ("dq_bulk_reduce-dense", 128, dict(dq_bulk_reduce=True), "dense"),
    ("dq_bulk_reduce_in_consumers-mask-d64", 64, dict(dq_bulk_reduce=True, dq_warp=False), "mask"),
    ("dq_bulk_reduce-det_mask", 128, dict(dq_bulk_reduce=True), "det_mask"),
    ("dq_bulk_reduce-persistent-mask-d64", 64, dict(dq_bulk_reduce=True, persistent_ctas=132), "mask"),
    # a loop per kind of query tile: partial steps, then full steps
    ("kind_loops-mask", 128, dict(kind_loops=True), "mask"),
    ("kind_loops-mask-d64", 64, dict(kind_loops=True), "mask"),
    ("kind_loops-det_mask", 128, dict(kind_loops=True), "det_mask"),
    ("kind_loops-bias", 128, dict(kind_loops=True), "bias"),
    ("kind_loops-persistent-mask-d64", 64, dict(kind_loops=True, persistent_ctas=132), "mask"),
    # Q and dO on barriers of their own, dO waited for before dP^T (the lean plan, score_mod gradients at D=128,
    # keeps one barrier)
    ("split_qdo_wait-mask", 128, dict(split_qdo_wait=True), "mask"),
    ("split_qdo_wait-dense-d64", 64, dict(split_qdo_wait=True), "dense"),
    ("split_qdo_wait-bias-d64", 64, dict(split_qdo_wait=True, tile_m=64, dq_split_rows=False), "bias"),
    ("split_qdo_wait-det_mask", 128, dict(split_qdo_wait=True), "det_mask"),
    ("split_qdo_wait-persistent-mask", 128, dict(split_qdo_wait=True, persistent_ctas=132), "mask"),
    ("split_qdo_wait-stats_from_global-dense", 128, dict(split_qdo_wait=True, stats_in_smem=False), "dense"),
    # each KV tile's walk of the query tiles starts at a tile of its own (dense), also in persistent CTAs and in the
    # parts of a cut last wave
    ("rotate_dense_walk-dense", 128, dict(rotate_dense_walk=True), "dense"),
    ("rotate_dense_walk-dense-d64", 64, dict(rotate_dense_walk=True), "dense"),
    ("rotate_dense_walk-persistent-dense", 128, dict(rotate_dense_walk=True, persistent_ctas=132), "dense"),
    ("rotate_dense_walk-split_tail-dense", 128, dict(rotate_dense_walk=True, split_tail=True), "dense"),
]


@needs_ptxas
@pytest.mark.parametrize("name,D,options,kind", CELLS, ids=[c[0] for c in CELLS])
def test_option_compiles_without_spills(name, D, options, kind):
    from dataclasses import replace

    from flexlab.kernels.bwd_config import default_bwd_config
    # each cell is its options on the one-loop step (the kind_loops cells ask for the D=64 default's two loops)
    cfg = replace(default_bwd_config(D), kind_loops=False)
    if cfg.dq_swap_ab and ("mask" in kind or "bias" in kind):  # (80-row steps: no block mask, no mod gradients)
        cfg = replace(cfg, tile_m=64, dq_swap_ab=False)
    cfg = replace(cfg, **options).validate()
    ptx, report = _compile(cfg, kind)
    _no_spills(report)
    assert "ld.local" not in ptx and "st.local" not in ptx
    _check_sync(ptx, cfg)
    # each dQ slab leaves by one TMA tensor reduce, or (`dq_bulk_reduce`) one plain bulk reduce of its bytes
    bulk = "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32"
    assert ("cp.reduce.async.bulk.tensor" in ptx) != cfg.dq_bulk_reduce
    assert (bulk in ptx) == cfg.dq_bulk_reduce
    if cfg.stats_in_smem:
        # LSE2 and D rows come in by two bulk copies per stage; the consumers read them from shared memory
        assert len(re.findall(r"cp\.async\.bulk\.shared::cluster\.global\.mbarrier", ptx)) == 2
        if kind == "dense" and not cfg.split_tail:  # (a cut tile's last part reads the others' dK and dV)
            assert "ld.global" not in ptx, "no per-thread global loads of LSE2/D left in a dense kernel"
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d)", ptx)
    if cfg.dk_after_dq:  # dQ done with dK in flight (and, outside the lean plan, S^T ready with dP^T in flight)
        lean = "bias" in kind and cfg.head_dim + cfg.tile_m > 128
        assert waits.count("1") >= (1 if lean else 2), waits
    if cfg.early_dv:  # S^T ready with dP^T in flight, then dP^T ready with dV in flight
        assert waits.count("1") >= 2, waits
    if cfg.dq_warp:  # consumers hand partials over without waiting: bar.arrive on DQ_FULL, 160 threads
        assert re.search(r"\bbar\.arrive\s+%?\w+,\s*160;", ptx), "no dQ hand-off arrive"
    if kind.startswith("det"):
        assert "ld.acquire.gpu.global.b32" in ptx and "red.release.gpu.global.add.s32" in ptx
    if cfg.dq_split_rows:
        assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in ptx  # dQ: N = head_dim = 64
    # persistent CTAs claim tiles with one relaxed atomic per tile and stage dK/dV away from K and V; the parts of
    # a cut tile count themselves in with one, between fences that order their published sums
    assert ("atom.global.add.u32" in ptx) == (cfg.persistent or cfg.split_tail)
    assert ("fence.acq_rel.gpu" in ptx) == cfg.split_tail
    # programmatic dependent launch: chained, every kernel waits once for the one before (the parts of a cut last wave
    # at their end, for the whole tiles' kernel), and persistent CTAs, the whole tiles and the parts let the next
    # kernel in early; unchained, only a cut last wave's two kernels use it
    early = cfg.lets_next_in_early or cfg.whole_tiles_only
    assert ptx.count("griddepcontrol.launch_dependents") == int(early)
    assert ptx.count("griddepcontrol.wait") == int(cfg.chained_launch or cfg.split_tail)
    # the Q/dO waits, the consumers' and the producer's, try once without a suspend hint first only with the option
    assert ("mbarrier.try_wait.parity.acquire" in ptx) == cfg.try_wait_first
    if cfg.try_wait_first:
        assert ptx.count("mbarrier.try_wait.parity.acquire") >= 2
    if cfg.rotate_dense_walk:  # each tile's first query tile: its index modulo the count (producer, dQ warp)
        assert len(re.findall(r"\brem\.[su]32", ptx)) >= 2


def test_persistent_ctas_where_kv_tiles_are_short():
    from dataclasses import replace

    from flexlab.kernels.bwd_config import (PERSISTENT_MAX_MEAN_STEPS, BwdConfig, candidate_bwd_configs,
                                            default_bwd_config, runs_persistent)
    cfg = default_bwd_config(128)
    assert cfg.persistent_short_tiles and not cfg.persistent  # the launcher decides per call
    assert runs_persistent(cfg, PERSISTENT_MAX_MEAN_STEPS, False)
    assert not runs_persistent(cfg, PERSISTENT_MAX_MEAN_STEPS + 1, False)
    assert not runs_persistent(cfg, 1, True)  # deterministic turns follow the launch order
    assert not runs_persistent(replace(cfg, persistent_short_tiles=False), 1, False)
    assert not runs_persistent(cfg, 1, False, captured_grads=True)  # their open runs need the registers
    assert not runs_persistent(default_bwd_config(256), 1, False)  # split head dim: no room to stage dK/dV
    persistent = replace(cfg, persistent_ctas=132)
    assert persistent.feasibility_error() is None and persistent.smem_bytes() <= 232448
    # the tile slots fit in the barrier block's 1 KiB
    assert replace(default_bwd_config(64, q_block=128), persistent_ctas=132).smem_bytes() == \
        default_bwd_config(64, q_block=128).smem_bytes()
    for bad in (replace(cfg, persistent_ctas=132, dq_warp=False),  # the dQ warp must be told the tiles
                BwdConfig(head_dim=128, tile_m=48, dq_swap_ab=True, persistent_ctas=132),  # dK does not fit in dS
                replace(default_bwd_config(256), persistent_ctas=132)):
        assert "persistent" in (bad.feasibility_error() or ""), bad
    assert "must be 0" in BwdConfig(head_dim=128, persistent_ctas=-1).feasibility_error()
    cands = candidate_bwd_configs(128, q_block=128)
    assert cands["persistent"].persistent and not cands["one_tile_per_cta"].persistent_short_tiles
    assert "persistent" not in candidate_bwd_configs(128, deterministic=True)


def test_rotated_dense_walk_is_a_dense_option_outside_deterministic_mode():
    from dataclasses import replace

    import cutlass

    from flexlab.kernels.bwd_config import candidate_bwd_configs, default_bwd_config
    from flexlab.kernels.bwd_sm90 import FlexBwdSm90
    for D in (64, 128, 256):
        assert not default_bwd_config(D).rotate_dense_walk  # slower on the row it was built for: off
        assert candidate_bwd_configs(D)["rotate_dense_walk"].rotate_dense_walk
        # block lists keep their order; deterministic mode keeps its fixed dQ order waitless
        assert "rotate_dense_walk" not in candidate_bwd_configs(D, q_block=128)
        assert "rotate_dense_walk" not in candidate_bwd_configs(D, deterministic=True)
    rotated = replace(default_bwd_config(128), rotate_dense_walk=True)
    FlexBwdSm90(rotated, cutlass.BFloat16)
    with pytest.raises(ValueError, match="rotate_dense_walk"):
        FlexBwdSm90(rotated, cutlass.BFloat16, deterministic=True)


def test_precompile_plans_the_backward_launchers_persistence():
    from flexlab.runtime.precompile import backward_persistence

    class Dense:
        generated, grad_slots = None, ()
    # dense D=128 steps 80 query rows: 1024 keys make 13 steps per KV tile (persistent), 4096 make 52 (not)
    assert backward_persistence(Dense, 128, None, [1024], 132) == [132]
    assert backward_persistence(Dense, 128, None, [4096, 16384], 132) == [0]
    assert backward_persistence(Dense, 128, 128, [4096], 132) == [0, 132]  # a mask's tile lengths are unknown
    assert backward_persistence(Dense, 256, 128, [1024], 132) == [0]


def test_dq_row_split_view_maps_rows_to_warpgroup_slabs():
    """With dq_split_rows the (tile_m, head_dim) dQ C tile is a view of per-warpgroup (64, head_dim) slabs: row r goes
    to slab r // 64, row r % 64 (the layout composition `consume` builds), so each TMA box holds 64 whole rows."""
    import cutlass.cute as cute
    found = {}

    @cute.jit
    def probe():
        hd, nwg = 64, 2
        slabs = cute.make_layout((64, hd, nwg))  # (row in slab, column, slab), column-major like tile_to_shape's
        view = cute.composition(slabs, cute.make_layout(((64, nwg), hd), stride=((1, 64 * hd), 64)))
        for r, c in ((0, 0), (63, 5), (64, 0), (100, 63), (127, 17)):
            found[(r, c)] = view((r, c))
            found[("want", r, c)] = slabs((r % 64, c, r // 64))

    cute.compile(probe, options="--gpu-arch sm_90a")
    for r, c in ((0, 0), (63, 5), (64, 0), (100, 63), (127, 17)):
        assert found[(r, c)] == found[("want", r, c)], (r, c)


def test_sweep_reference_matches_autograd():
    """The GPU sweep's float64 gradients (used to judge every option) equal torch autograd: a sliding window, and a
    causal mask with the tanh soft-cap score_mod."""
    from bwd_perf_sweep import _keep, float64_head
    torch.manual_seed(0)
    S, D = 40, 16
    q, k, v, do = (torch.randn(S, D, dtype=torch.float64) for _ in range(4))
    for kind, cap in (("sliding", None), ("causal", 2.0)):
        keep = _keep(kind, S, "cpu")
        o, lse, grads = float64_head(q, k, v, do, 0.3, keep, True, cap)
        qa, ka, va = (t.clone().requires_grad_(True) for t in (q, k, v))
        s = qa @ ka.T * 0.3
        if cap is not None:
            s = cap * torch.tanh(s / cap)
        s = s.masked_fill(~keep, float("-inf"))
        out = torch.softmax(s, dim=-1) @ va
        out.backward(do)
        assert torch.allclose(o, out.detach()) and torch.allclose(lse, torch.logsumexp(s.detach(), -1))
        for ours, ref in zip(grads, (qa.grad, ka.grad, va.grad)):
            assert torch.allclose(ours, ref, atol=1e-10), kind


def test_sweep_lists_every_candidate_and_reports_a_hang(tmp_path):
    """Case list: default first in every row; the watchdog turns a silent case into `timeout` and goes on."""
    import json
    import subprocess
    import sys

    import bwd_perf_sweep
    from bwd_perf_sweep import ROWS, SCORE_MOD_ROWS, case_list

    from flexlab.kernels.bwd_config import candidate_bwd_configs
    cases = case_list()
    for name, D, _, _, kind in ROWS + SCORE_MOD_ROWS:
        mine = [c for c in cases if c.startswith(name + "/") and not c.endswith("/det")]
        mod_grads = kind == "softcap"  # its derivative: the candidates around the 64-row default at D=64
        # (rows without a block mask leave out the CTA order of its tiles; masked rows vary the masked default)
        unmasked = kind in ("dense", "softcap")
        expected = set(candidate_bwd_configs(D, mod_grads=mod_grads, q_block=None if unmasked else 128))
        expected -= {"lpt_order"} if unmasked else set()
        assert mine[0] == f"{name}/default" and {c.split("/")[1] for c in mine} == expected
    from bwd_perf_sweep import DETERMINISTIC_ROWS, DETERMINISTIC_VARIANTS
    det_cases = [c for c in cases if c.endswith("/det")]
    assert det_cases and all(c.split("/")[0] in DETERMINISTIC_ROWS for c in det_cases)
    for c in det_cases:
        row, variant, _ = c.split("/")
        D = next(r[1] for r in ROWS if r[0] == row)
        assert variant in DETERMINISTIC_VARIANTS and variant in candidate_bwd_configs(D, deterministic=True), c
    script = bwd_perf_sweep.__file__  # (benchmarks/probes, on the path through conftest)
    out = tmp_path / "sweep.json"
    res = subprocess.run([sys.executable, str(script), str(out), "--selftest", "--case-timeout", "3"],
                         capture_output=True, text=True, timeout=90)
    assert res.returncode == 0, res.stdout + res.stderr
    status = {r["case"]: r["status"] for r in json.loads(out.read_text())}
    # the hanging configuration's later case is skipped, not waited for again
    assert status == {"selftest/ok": "ok", "selftest/hang": "timeout", "selftest/after": "ok",
                      "selftest/hang/det": "skipped"}, status


def test_bwd_sweep_table_prefers_times_taken_in_turns():
    """A row timed again in turns is compared on those times; a row without them on its one-by-one times, never a
    mix of the two clocks."""
    from bwd_perf_sweep import _attach_interleaved, table

    def rec(row, variant, kernel_ms):
        return {"case": f"{row}/{variant}", "row": row, "variant": variant, "deterministic": False, "status": "ok",
                "wall_ms": kernel_ms, "wall_tflops": 1.0, "kernel_ms": kernel_ms, "kernel_tflops": 1.0,
                "main_ms": kernel_ms, "errors": {"dq": 1e-3}}
    records = [rec("a", "default", 10.0), rec("a", "x", 9.0), rec("b", "default", 4.0), rec("b", "x", 5.0)]
    times = {"a/default": {"wall_ms": 9.5, "kernel_ms": 9.0, "main_ms": 8.9, "kernel_rounds": [9.0] * 5,
                           "wall_rounds": [9.5] * 5},
             "a/x": {"wall_ms": 9.8, "kernel_ms": 10.0, "main_ms": 9.9, "kernel_rounds": [10.0] * 5,
                     "wall_rounds": [9.8] * 5}}
    _attach_interleaved(records, {"row": "a", "times": times})
    assert records[1]["il_main_ms"] == 9.9 and "il_main_ms" not in records[2]
    text = table(records)
    line_a = next(line for line in text.splitlines() if line.startswith("a ") and " x " in line)
    line_b = next(line for line in text.splitlines() if line.startswith("b ") and " x " in line)
    assert " 0.900 " in line_a  # 9.0 / 10.0 in turns, not 10.0 / 9.0 one by one
    assert " 0.800 " in line_b  # 4.0 / 5.0, the only clock row b has
    assert "a                          default" in text.split("fastest")[1]
    _attach_interleaved(records, {"row": "b", "error": "RuntimeError: boom"})
    assert records[3]["interleaved_error"] == "RuntimeError: boom"


@needs_ptxas
@pytest.mark.parametrize("D", [64, 128])
def test_kind_loops_compile_the_full_steps_without_mask_code(D):
    """`BwdConfig.kind_loops`: two step loops where the default has one, and the full-block loop is shorter than the
    default's loop by at least the causal mask's per-score compares and selects (one of each per score of the
    thread: tile_n * tile_m / 256), which only the partial-block loop keeps."""
    from dataclasses import replace

    from flexlab.kernels.bwd_config import default_bwd_config
    from flexlab.viz.compile_report import report_from_ptx

    def step_loops(cfg):
        loops = report_from_ptx(_compile(cfg, "mask")[0]).gemm_loops
        return [sum(c.values()) for c in loops if c.get("MUFU.EX2")]
    base = replace(default_bwd_config(D, q_block=128), kind_loops=False)
    one = step_loops(base)
    two = step_loops(replace(base, kind_loops=True))
    # (the loop over the query heads of a GQA group encloses the step loops: listed after them, and longest)
    assert len(two) == len(one) + 1, (one, two)
    partial, full = two[0], two[1]
    scores = base.tile_n * base.tile_m // 256
    assert full + scores <= min(one), (one, two)
    assert full < partial, (one, two)

