"""Precompilation builds what the launcher will ask for (no GPU: compiling needs none).

The forward's choice of kernel depends on the key length (D=128 stage count, the dynamic persistent kernel for short
tiles)
and on whether the caller wants the LSE; the planned keys are checked against the launcher's own planning, and one
small run is checked to leave every kernel on disk, forward and backward, so that a later process compiles nothing.
"""
from __future__ import annotations

import shutil

import pytest
import torch

cutlass = pytest.importorskip("cutlass")


def _launcher_keys(monkeypatch, score_mod, mask_mod, head_dim: int, seqlens, num_sms: int) -> set:
    """The forward keys `launch._plan` builds for (1, 4, S, head_dim) CPU inputs, kernels not compiled."""
    import flexlab
    from flexlab.backends.cute import kernel_mods
    from flexlab.runtime import launch

    seen = set()
    monkeypatch.setattr(launch, "_FAST", {})
    monkeypatch.setattr(launch, "_PLANS", {})
    monkeypatch.setattr(launch, "_sm_count", lambda device: num_sms)
    monkeypatch.setattr(launch, "forward_kernel", lambda key, mods: seen.add(key) or object())
    mods = kernel_mods(score_mod, mask_mod)
    for seqlen in seqlens:
        q = torch.empty(1, 4, seqlen, head_dim, dtype=torch.bfloat16)
        bm = None
        if mask_mod is not None:
            bm = flexlab.create_block_mask(mask_mod, None, None, seqlen, seqlen, device="cpu")
        for writes_lse in (True, False):
            launch._plan(q, q, mods, bm, None, "sm_90a", writes_lse)
    return seen


@pytest.mark.parametrize("head_dim,masked", [(128, False), (128, True), (64, False), (64, True)])
def test_planned_forward_keys_are_the_launchers(monkeypatch, head_dim, masked):
    from flexlab.runtime.precompile import forward_keys

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    mask_mod = causal if masked else None
    seqlens = (1000, 4096, 16384)
    _, planned = forward_keys(None, mask_mod, head_dim, torch.bfloat16, seqlens, 132)
    launched = _launcher_keys(monkeypatch, None, mask_mod, head_dim, seqlens, 132)
    # under a block mask both tile schedulers are planned (the launcher picks one from the mask's density)
    assert set(planned) == launched if not masked else launched <= set(planned)
    assert {k.writes_lse for k in planned} == {True, False}
    if head_dim == 64 and masked:  # 192-row tiles: causal walks get shorter with the padded rows first
        assert {k.config.ragged_first_tile for k in launched} == {True}
    if head_dim == 128:  # short tiles run the dynamic persistent kernel, one CTA per SM
        # (dense: persistent clusters at 4096, with the split tail at 16384; a mask without a score_mod: dynamic tiles
        # at every length, `launch.dynamic_at_any_length`)
        ctas = {132}
        assert {k.config.persistent_ctas for k in planned} == ctas
        assert {k.config.persistent_ctas for k in launched} == ctas
        assert {k.config.split_tail for k in launched} == ({False, True} if not masked else {False})


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs the CUDA toolkit's ptxas")
def test_precompile_leaves_every_kernel_on_disk(tmp_path, monkeypatch):
    """After `precompile --backward`, the forward keys and the backward's three kernels load from disk."""
    from flexlab.kernels import bwd_launch
    from flexlab.runtime import compile as fwd_compile
    from flexlab.runtime.disk_cache import KernelCache
    from flexlab.runtime.precompile import forward_keys, main

    monkeypatch.setenv("FLEXLAB_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["--variants", "none", "--dims", "64", "--seqlens", "4096", "--sms", "132", "--backward",
                 "--jobs", "1"]) == 0

    fwd_cache = KernelCache()
    mods, keys = forward_keys(None, None, 64, torch.bfloat16, (4096,), 132)
    assert len(keys) == 2  # with and without the LSE
    for key in keys:
        fwd_compile.forward_kernel(key, mods, cache=fwd_cache)
    assert fwd_cache.stats.compiles == 0 and fwd_cache.stats.disk_hits == 2

    monkeypatch.setattr(bwd_launch, "_CACHE", KernelCache())
    monkeypatch.setattr(bwd_launch, "_KERNELS", {})
    bwd_launch.backward_kernels(None, [], torch.bfloat16, 64)
    stats = bwd_launch.bwd_kernel_cache().stats
    assert stats.compiles == 0 and stats.disk_hits == 3  # preprocess, main kernel, postprocess


@pytest.mark.parametrize("head_dim,wide_bound", [(128, 0.0), (64, 0.0), (64, 8.0)])
def test_planned_keys_cover_masks_stored_as_bits(monkeypatch, head_dim, wide_bound):
    """A document mask's partial blocks read stored bits (`FwdConfig.mask_bits`); with the wide-tile knob on, D=64
    takes 192-row tiles where tiles are long. Whatever the launcher builds, precompilation planned."""
    import flexlab
    from flexlab.backends.cute import _lowered
    from flexlab.kernels import config as policy
    from flexlab.runtime import launch
    from flexlab.runtime.precompile import forward_keys
    monkeypatch.setattr(policy, "D64_BITS_TILE192_MIN_MEAN_KV_BLOCKS", wide_bound)
    doc = torch.repeat_interleave(torch.arange(2, dtype=torch.int32), 4096)  # 2 documents of 4096 tokens

    def document(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    low = _lowered(None, document)
    assert low.stored_masks is not None
    seen = set()
    monkeypatch.setattr(launch, "_FAST", {})
    monkeypatch.setattr(launch, "_PLANS", {})
    monkeypatch.setattr(launch, "_sm_count", lambda device: 132)
    monkeypatch.setattr(launch, "forward_kernel", lambda key, mods: seen.add(key) or object())
    for seqlen in (1024, 8192):
        q = torch.empty(1, 4, seqlen, head_dim, dtype=torch.bfloat16)
        bm = flexlab.create_block_mask(document, None, None, seqlen, seqlen, device="cpu")
        for writes_lse in (True, False):
            _, key, sparse, _ = launch._plan(q, q, low.mods, bm, None, "sm_90a", writes_lse, low.stored_masks)
            assert key.config.mask_bits and len(sparse) == 5 and sparse[4].shape[-2:] == (key.config.tile_m, 4)
    _, planned = forward_keys(None, document, head_dim, torch.bfloat16, (1024, 8192), 132)
    assert seen <= set(planned)
    tiles = {k.config.tile_m for k in seen}
    # 8192 tokens: 16.5 KV blocks per 128-row tile on average under this mask; 1024 (inside one document): 4.5
    assert tiles == ({128, 192} if wide_bound else {128}), tiles
