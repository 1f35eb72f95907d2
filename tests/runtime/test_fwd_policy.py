"""Forward-kernel configuration policy: the defaults stay what was measured, every candidate option and debug
ablation is opt-in, and the knobs a benchmark flips reach the launcher (no GPU needed)."""
from __future__ import annotations

import dataclasses

import pytest

from flexlab.kernels import config as policy
from flexlab.kernels.config import ABLATIONS, FwdConfig, default_config
from flexlab.runtime import launch
from flexlab.runtime.compile import KernelMods


@pytest.fixture
def fresh_policy(monkeypatch):
    """Each test flips knobs on clean memos and leaves the module as it found it."""
    launch.forget_plans()
    yield monkeypatch
    monkeypatch.undo()
    launch.forget_plans()


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("score_mod", [False, True])
def test_launcher_defaults_are_the_measured_configs(fresh_policy, D, sparse, score_mod):
    mods = KernelMods(score_mod=(lambda *a: None) if score_mod else None)
    base = default_config(D, sparse, score_mod)
    for seqlen in (None, 1000, 1024, 1025, 2560, 2688, 16384):
        for mean in (None, 3.5, 20, 20.5, 64):
            cfg = launch.config_for(D, sparse, mods, seqlen, num_sms=132, mean_kv_blocks=mean)
            # dense: the mean follows from the key length when it is known; a block mask's is given (None: unknown)
            if not sparse and seqlen is not None:
                mean = -(-seqlen // base.tile_n)
            # (dense D=64 keeps its K/V multicast clusters at every length; D=128 gives them up for short keys;
            # block-sparse kernels without a score_mod run dynamic tiles at every length up to D=128)
            short = ((mean is not None and mean <= policy.DYNAMIC_MAX_MEAN_KV_BLOCKS
                      and (base.cluster_m == 1 or D == 128))
                     or (sparse and not score_mod and D <= policy.DYNAMIC_ANY_LENGTH_MAX_HEAD_DIM))
            # dense multicast kernels with mid-length tiles: static persistent clusters walking pairs of Q tiles
            # ... and long ones the same with the last round cut by KV blocks (`FwdConfig.split_tail`)
            split = (not short and base.cluster_m == 2 and mean is not None
                     and mean >= policy.SPLIT_TAIL_MIN_MEAN_KV_BLOCKS)
            paired = split or (not short and base.cluster_m == 2 and mean is not None and
                               policy.DYNAMIC_MAX_MEAN_KV_BLOCKS < mean <= policy.PERSISTENT_CLUSTER_MAX_MEAN_KV_BLOCKS)
            want = (132, True) if short else (132, False) if paired else (0, False)
            assert (cfg.persistent_ctas, cfg.dynamic_tiles) == want, (seqlen, mean, cfg)
            assert cfg.split_tail == split, (seqlen, mean, cfg)
            # persistent kernels tie the K release to the first probability (`FwdConfig.anchored_release`); dynamic
            # ones have no cluster partner
            expected = base
            if short:
                expected = dataclasses.replace(base, cluster_m=1, **policy.anchored_options(D, True))
            elif paired:
                expected = dataclasses.replace(base, **policy.anchored_options(D, True))
            assert dataclasses.replace(cfg, persistent_ctas=0, dynamic_tiles=False, split_tail=False) == expected
            assert cfg.feasibility_error() is None and cfg.ablate == () and cfg.exp2_poly == 0
            assert not cfg.rescale_before_pv and not cfg.early_block_index
            assert launch.config_for(D, sparse, mods, seqlen, mean_kv_blocks=mean).persistent_ctas == 0  # no SM count
    assert policy.DYNAMIC_ANY_LENGTH_MAX_HEAD_DIM == 128
    assert default_config(128).num_stages == 2 and default_config(64, block_sparse=True).tile_m == 192
    assert base.anchored_release == (D <= 128 and (sparse or score_mod)) == base.uniform_stage


def test_stage_table_picks_three_stages_for_long_keys(fresh_policy):
    fresh_policy.setattr(policy, "D128_STAGES_FROM_SEQLEN", ((4096, 3),))
    mods = KernelMods()
    assert launch.config_for(128, False, mods, 4096).num_stages == 3
    assert launch.config_for(128, True, mods, 16384).num_stages == 3
    assert launch.config_for(128, False, mods, 1024).num_stages == 2
    assert launch.config_for(64, False, mods, 16384) == default_config(64)
    assert launch.config_for(128, False, mods, 4096).feasibility_error() is None


def test_dynamic_knob_uses_the_sm_count(fresh_policy):
    cfg = launch.config_for(128, True, KernelMods(), 1024, num_sms=132, mean_kv_blocks=4.5)
    assert cfg.persistent_ctas == 132 and cfg.dynamic_tiles and cfg.separate_o
    assert cfg.smem_bytes() <= policy.SMEM_BYTES_SM90
    fresh_policy.setattr(policy, "DYNAMIC_MAX_MEAN_KV_BLOCKS", 0)  # off for short tiles ...
    assert launch.config_for(128, True, KernelMods(), 1024, num_sms=132, mean_kv_blocks=4.5).dynamic_tiles
    fresh_policy.setattr(policy, "DYNAMIC_ANY_LENGTH_MAX_HEAD_DIM", 0)  # ... and for block masks at every length
    assert launch.config_for(128, True, KernelMods(), 1024, num_sms=132, mean_kv_blocks=4.5).persistent_ctas == 0


def test_block_masks_without_a_score_mod_run_dynamic_tiles_at_every_length(fresh_policy):
    causal = KernelMods(mask_mod=lambda *a: None, source_hash="causal")
    alibi = KernelMods(score_mod=lambda *a: None, mask_mod=lambda *a: None, source_hash="alibi")
    for D, mods, want in ((64, causal, True), (128, causal, True), (256, causal, False), (128, alibi, False)):
        cfg = launch.config_for(D, True, mods, 16384, num_sms=132, mean_kv_blocks=64.5)  # causal B1·S16k
        assert cfg.dynamic_tiles == want and cfg.persistent_ctas == (132 if want else 0), (D, mods)
        assert cfg.feasibility_error() is None
    # (dense kernels keep their multicast clusters on long keys)
    assert not launch.config_for(128, False, KernelMods(), 16384, num_sms=132).dynamic_tiles
    assert "persistent_ctas" in dataclasses.replace(default_config(128), dynamic_tiles=True).feasibility_error()


def test_d64_sparse_tile_knob(fresh_policy):
    assert default_config(64, block_sparse=True).tile_m == 192
    fresh_policy.setattr(policy, "D64_SPARSE_TILE_M", 128)
    assert default_config(64, block_sparse=True).tile_m == 128
    fresh_policy.setattr(policy, "D64_SPARSE_TILE_M", 192)
    assert default_config(64, block_sparse=True, has_score_mod=True).tile_m == 128  # 160 registers spill there
    assert default_config(64, block_sparse=True, captured_tensors=True).tile_m == 128  # so does a document mask
    documents = KernelMods(mask_mod=lambda *a: None, source_hash="doc", aux_tensor_specs=(("int32", 1),))
    assert launch.config_for(64, True, documents).tile_m == 128
    assert launch.config_for(64, True, KernelMods(mask_mod=lambda *a: None, source_hash="causal")).tile_m == 192
    from flexlab.backends import cute as backend
    fresh_policy.setattr(backend, "_MASK_REASON", {})
    assert backend._mask_reason((128, 128), 64) == ""  # a mask at torch's 128 still drives 192-row tiles (merged)
    assert "BLOCK_SIZE" in backend._mask_reason((128, 64), 64)
    # 192-row tiles merge any Q block; the 128-row tiles of a score_mod or of a mask reading captured tensors do not
    assert backend._mask_reason((96, 128), 64) == ""
    assert "BLOCK_SIZE" in backend._mask_reason((96, 128), 64, has_score_mod=True)
    assert "BLOCK_SIZE" in backend._mask_reason((96, 128), 64, captured_tensors=True)


def test_wide_tiles_for_stored_mask_bits_are_a_knob(fresh_policy):
    # D=64 kernels reading stored bits take 192-row tiles where tiles visit many KV blocks (measured bound: 6)
    bits128 = dataclasses.replace(default_config(64, True, captured_tensors=True), mask_bits=True)
    assert bits128.tile_m == 128
    assert policy.D64_BITS_TILE192_MIN_MEAN_KV_BLOCKS == 6.0
    assert launch.bits_wide_tiles(bits128, 8.5, False).tile_m == 192
    assert launch.bits_wide_tiles(bits128, 5.9, False) is None
    fresh_policy.setattr(policy, "D64_BITS_TILE192_MIN_MEAN_KV_BLOCKS", 0.0)  # 0: never
    assert launch.bits_wide_tiles(bits128, 17.3, False) is None
    fresh_policy.setattr(policy, "D64_BITS_TILE192_MIN_MEAN_KV_BLOCKS", 8.0)
    wide = launch.bits_wide_tiles(bits128, 17.3, False)
    assert wide == FwdConfig(head_dim=64, tile_m=192, tile_n=128, num_stages=3, mask_bits=True)
    assert wide.feasibility_error() is None
    assert launch.bits_wide_tiles(bits128, 4.0, False) is None  # short tiles: 128 rows measured faster
    assert launch.bits_wide_tiles(bits128, 17.3, True) is None  # a score_mod's registers spill at 192 rows
    bits_d128 = dataclasses.replace(default_config(128, True), mask_bits=True)
    assert launch.bits_wide_tiles(bits_d128, 17.3, False) is None


def test_ablations_are_canonical_and_checked():
    a = FwdConfig(head_dim=128, ablate=("pv", "exp2", "pv"))
    b = FwdConfig(head_dim=128, ablate=frozenset({"exp2", "pv"}))
    assert a == b and repr(a) == repr(b) and a.ablate == ("exp2", "pv")
    assert a != FwdConfig(head_dim=128)
    assert "unknown ablation" in FwdConfig(head_dim=128, ablate=("nope",)).feasibility_error()
    for name in ABLATIONS:
        assert FwdConfig(head_dim=128, ablate=(name,)).feasibility_error() is None


def test_options_are_validated_and_fit():
    base = default_config(128)
    assert "exp2_poly" in dataclasses.replace(base, exp2_poly=9).feasibility_error()
    assert "persistent_ctas" in dataclasses.replace(base, persistent_ctas=-1).feasibility_error()
    three = dataclasses.replace(base, num_stages=3)
    assert three.feasibility_error() is None  # 225 KiB of 227
    assert not dataclasses.replace(three, persistent_ctas=132).separate_o  # no room for O: it reuses Q's buffer
    assert dataclasses.replace(base, persistent_ctas=132).separate_o
    for D in (64, 128, 256):
        cfg = dataclasses.replace(default_config(D), persistent_ctas=132, cluster_m=1)
        assert cfg.feasibility_error() is None, (D, cfg.feasibility_error())
    assert FwdConfig(head_dim=64, tile_m=192, num_stages=3).feasibility_error() is None


def test_the_early_mask_stays_a_candidate():
    """Measured slower on the document rows (forward 0.98x, backward 0.93-0.98x): no default turns it on."""
    from flexlab.kernels.bwd_config import default_bwd_config
    from flexlab.kernels.config import default_config
    for D in (64, 128):
        for sparse in (False, True):
            for score_mod in (False, True):
                assert not default_config(D, sparse, score_mod).mask_early
        assert not default_bwd_config(D).mask_early and not default_bwd_config(D, True).mask_early


def test_kv_multicast_clusters_are_the_dense_default(fresh_policy):
    """1.03-1.07x at D=64 dense on the H200, 1.03-1.04x at D=128: dense defaults pair CTAs, masked ones do not."""
    base = default_config(128)
    assert dataclasses.replace(base, cluster_m=2).feasibility_error() is None
    assert "cluster_m" in dataclasses.replace(base, cluster_m=3).feasibility_error()
    assert dataclasses.replace(base, cluster_m=2, persistent_ctas=132).feasibility_error() is None  # pairs walk
    for bad in (dict(persistent_ctas=131), dict(persistent_ctas=132, dynamic_tiles=True)):  # ... alike, statically
        assert "cluster_m" in dataclasses.replace(base, cluster_m=2, **bad).feasibility_error()
    assert default_config(64).cluster_m == 2
    assert default_config(64, has_score_mod=True).cluster_m == 1
    for D in (64, 128):
        assert default_config(D, block_sparse=True).cluster_m == 1  # a block mask gives paired tiles other KV blocks
    assert default_config(128).cluster_m == 2 and default_config(128, has_score_mod=True).cluster_m == 1
    assert default_config(256).cluster_m == 1
    assert launch.config_for(64, False, KernelMods(), 1024, num_sms=132).cluster_m == 2  # short tiles too
    short = launch.config_for(128, False, KernelMods(), 1024, num_sms=132)  # ... but D=128 short tiles go dynamic
    assert short.dynamic_tiles and short.cluster_m == 1
    mid = launch.config_for(128, False, KernelMods(), 4096, num_sms=132)  # 32 KV blocks: persistent clusters
    assert mid.cluster_m == 2 and mid.persistent_ctas == 132 and not mid.dynamic_tiles
    assert launch.config_for(64, False, KernelMods(), 4096, num_sms=131).persistent_ctas == 130  # an even count
    long = launch.config_for(128, False, KernelMods(), 16384, num_sms=132)  # 128 blocks: ... with the split tail
    assert long.cluster_m == 2 and long.persistent_ctas == 132 and long.split_tail and not long.dynamic_tiles
    fresh_policy.setattr(policy, "SPLIT_TAIL_MIN_MEAN_KV_BLOCKS", 0)  # off: a cluster per pair
    long = launch.config_for(128, False, KernelMods(), 16384, num_sms=132)
    assert long.cluster_m == 2 and long.persistent_ctas == 0 and not long.split_tail
    persistent = launch._dynamic(default_config(64), 132)  # a persistent CTA has no partner: the cluster goes
    assert persistent.persistent_ctas == 132 and persistent.cluster_m == 1 and persistent.feasibility_error() is None


def test_sliding_window_bands_are_masked_per_row_up_to_d128(fresh_policy):
    # measured: sliding windows gain at D=64 and D=128, causal bands (bounded above only) and D=256 do not
    from flexlab.backends import cute as backend
    from flexlab.gallery import load_gallery
    gallery = load_gallery()
    kernel_mods = {name: backend.kernel_mods(None, gallery[name].build(B=1, H=2, Q_LEN=256, KV_LEN=256).mask_mod)
                   for name in ("sliding_window", "causal", "document")}
    for name, mods in kernel_mods.items():
        window = name == "sliding_window"
        assert bool(getattr(mods.mask_mod, "band_is_window", False)) == window, name
        for D in (64, 128, 256):
            cfg = launch.config_for(D, True, mods, 4096, num_sms=132, mean_kv_blocks=9.5)
            assert cfg.band_mask == (window and D <= policy.BAND_MASK_MAX_HEAD_DIM), (name, D)
            assert cfg.feasibility_error() is None
            assert not launch.with_mask_bits(cfg).band_mask  # stored bits replace the band
    fresh_policy.setattr(policy, "BAND_MASK_MAX_HEAD_DIM", 0)  # 0: never
    launch.forget_plans()
    assert not launch.config_for(128, True, kernel_mods["sliding_window"], 4096).band_mask


def test_d256_block_masks_may_take_80_key_tiles(fresh_policy):
    from flexlab.backends import cute as backend
    assert default_config(256, True).tile_n == policy.D256_SPARSE_TILE_N == 64  # until 80 is timed
    fresh_policy.setattr(policy, "D256_SPARSE_TILE_N", 80)
    fresh_policy.setattr(backend, "_MASK_REASON", {})
    cfg = launch.config_for(256, True, KernelMods(mask_mod=lambda *a: None, source_hash="causal"), 4096)
    assert cfg.tile_n == 80 and cfg.feasibility_error() is None
    assert backend._mask_reason((128, 128), 256) == ""  # a mask at torch's 128 merges into 80-key tiles
    assert backend._mask_reason((256, 64), 256) == ""  # (any key block size)


def _memos(module) -> dict:
    return {name: f for name, f in vars(module).items()
            if getattr(f, "__module__", None) == module.__name__ and hasattr(f, "cache_clear")}


def test_forget_plans_drops_every_memo_a_knob_reaches_and_keeps_static_facts(fresh_policy):
    """A knob changed at run time (a probe, a notebook) is seen by the next call: `forget_plans` clears every memo of
    the launchers and the L2 grouping, found by walking the modules, so a memo added later cannot be missed."""
    from flexlab.kernels import bwd_launch
    from flexlab.runtime import schedule
    mods = KernelMods(mask_mod=lambda *a: None, source_hash="causal")
    assert launch.config_for(128, True, mods, 16384, num_sms=132, mean_kv_blocks=64.5).dynamic_tiles
    launch.config_for(128, False, KernelMods(), 16384, num_sms=132, mean_kv_blocks=128.0)
    schedule.heads_per_group(4096, 128, 2, 1, 64)
    bwd_launch.config_for(128, False, None, False)
    launch._static_key_parts()
    bwd_launch.bwd_fingerprint()
    bwd_launch._Q_LISTS["a mask's lists"] = None  # (they memoise the CTA order, which LPT_GROUP_L2_BYTES shapes)
    filled = {n for m in (launch, schedule, bwd_launch) for n, f in _memos(m).items() if f.cache_info().currsize}
    assert {"_config", "_dynamic", "heads_per_group"} <= filled and "_static_key_parts" in filled
    launch.forget_plans()
    bwd_launch.forget_plans()
    for module, kept in ((launch, {"_static_key_parts", "_sm_count"}), (schedule, set()),
                         (bwd_launch, {"bwd_fingerprint"})):
        for name, memo in _memos(module).items():
            assert (memo.cache_info().currsize > 0) == (name in kept and name in filled), (module.__name__, name)
    assert not launch._PLANS and not bwd_launch._PLANS and not bwd_launch._Q_LISTS
    # and a knob flipped now reaches the next plan: long causal tiles without dynamic tiles
    fresh_policy.setattr(policy, "DYNAMIC_ANY_LENGTH_MAX_HEAD_DIM", 0)
    fresh_policy.setattr(policy, "DYNAMIC_MAX_MEAN_KV_BLOCKS", 20)
    launch.forget_plans()
    assert not launch.config_for(128, True, mods, 16384, num_sms=132, mean_kv_blocks=64.5).dynamic_tiles


def test_padded_q_rows_go_first_where_the_lists_get_shorter(fresh_policy):
    # `FwdConfig.ragged_first_tile`, decided per mask (`RAGGED_FIRST_MIN_SAVING`): 192-row tiles over 4096 causal
    # queries visit 363 KV blocks with the padded rows first against 384 with them last.
    import torch

    from flexlab import create_block_mask
    from flexlab.runtime.sparsity import kernel_block_mask

    def causal(b, h, q, kv):
        return q >= kv

    def everything(b, h, q, kv):
        return q >= 0

    tiles = FwdConfig(head_dim=64, tile_m=192, tile_n=128, num_stages=3)
    mods = KernelMods(mask_mod=causal, source_hash="causal")

    def moved(mask_mod, S, cfg=tiles, kernel_mods=mods):
        bm = create_block_mask(mask_mod, 1, 1, S, S)
        q = torch.empty(1, 1, S, 64)
        kbm = kernel_block_mask(bm, S, cfg.tile_m, cfg.tile_n, S)
        return launch._ragged_first(q, kernel_mods, bm, cfg, kbm, None, S, None)

    lists, bits = moved(causal, 4096)
    assert bits is None and int((lists.kv_num + lists.full_num).sum()) == 363
    assert moved(causal, 4032) is None  # 21 whole tiles: nothing to move
    assert moved(everything, 4096) is None  # every tile as long as the others: no shorter walk
    assert moved(causal, 4096, dataclasses.replace(tiles, tile_m=128)) is None  # 128-row tiles split mask rows
    assert moved(causal, 4096, kernel_mods=dataclasses.replace(mods, score_mod=causal)) is None
    captured = dataclasses.replace(mods, aux_tensor_specs=(("int32", 1),))
    assert moved(causal, 4096, kernel_mods=captured) is None  # a gather at rows before 0, unless read as bits
    fresh_policy.setattr(policy, "RAGGED_FIRST_MIN_SAVING", 0.06)  # 21 of 384 visits saved: 5.5%
    assert moved(causal, 4096) is None
    fresh_policy.setattr(policy, "RAGGED_FIRST_MIN_SAVING", 0.05)
    assert moved(causal, 4096) is not None
    fresh_policy.setattr(policy, "RAGGED_FIRST_MIN_SAVING", 1.0)  # never
    assert moved(causal, 4096) is None
    assert FwdConfig(head_dim=64, ragged_first_tile=True, cluster_m=2, persistent_ctas=132).feasibility_error()
