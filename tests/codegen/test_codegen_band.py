"""Band masks (`flexlab.codegen.band`): which mask_mods keep a key range per query, and that the range is exact."""
import pytest
import torch

from flexlab.codegen import generate
from flexlab.codegen.band import key_band, query_band
from flexlab.codegen.lower_torch import evaluate
from flexlab.gallery import load_gallery

WINDOW = 37


def _band_matches_mask(gen, q_len=300, kv_len=340, scalars=None):
    """The band's (lo, hi) per query, evaluated with torch, against mask_mod on every (q, kv) pair."""
    band = key_band(gen._graph, gen._traced.mask_root)
    assert band is not None
    q = torch.arange(q_len).view(-1, 1)
    kv = torch.arange(kv_len).view(1, -1)
    env = gen._env(dict(b=0, h=0, q_idx=q, kv_idx=kv), torch.float32, torch.device("cpu"), scalars)
    lo, hi = evaluate(gen._graph, [band.lo, band.hi], env)
    shape = (q_len, kv_len)
    kept = torch.broadcast_to((kv >= lo) & (kv < hi), shape)
    expected = torch.broadcast_to(gen.evaluate_mask_mod(0, 0, q, kv, scalars=scalars), shape)
    assert torch.equal(kept, expected)
    by_key = query_band(gen._graph, gen._traced.mask_root)
    assert (by_key is not None) == ("def mask_band_by_key(" in gen.source)
    if by_key is not None:  # the same band read by key: the queries each key is kept for
        q_lo, q_hi = evaluate(gen._graph, [by_key.lo, by_key.hi], env)
        assert torch.equal(torch.broadcast_to((q >= q_lo) & (q < q_hi), shape), expected)
    return by_key is not None


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)


def offsets(b, h, q_idx, kv_idx):
    # bounds written every way round: kv on either side, negated, scaled queries, <=, >
    return (kv_idx <= q_idx + 3) & (-kv_idx < 40 - q_idx) & (2 * q_idx - kv_idx >= 5) & (kv_idx * 1 > q_idx - 90)


def upper_only(b, h, q_idx, kv_idx):
    return kv_idx < 100


def lower_only(b, h, q_idx, kv_idx):
    return kv_idx - q_idx >= -WINDOW


def mirrored(b, h, q_idx, kv_idx):
    # bounds with -q_idx: read by key, they bound the query the other way round
    return (kv_idx + q_idx >= 50) & (kv_idx < 400 - q_idx) & (kv_idx >= 3)


@pytest.mark.parametrize("mask_mod,by_key,window", [(causal, True, False), (sliding, True, True),
                                                    (offsets, False, True), (upper_only, True, False),
                                                    (lower_only, True, False), (mirrored, True, True)])
def test_band_bounds_equal_the_mask(mask_mod, by_key, window):
    gen = generate(None, mask_mod)
    assert "def mask_band(" in gen.source and "mask_mod.band = mask_band" in gen.source
    # (launchers mask windows, bounded on both sides, per row: `kernels.config.BAND_MASK_MAX_HEAD_DIM`)
    assert f"mask_mod.band_is_window = {window}" in gen.source and gen.module().mask_mod.band_is_window == window
    assert _band_matches_mask(gen) == by_key  # (2 * q_idx in `offsets` has no per-key form)


def test_band_bounds_follow_a_captured_scalar_at_runtime():
    # the window is a runtime argument: the same generated band serves every window
    gen = generate(None, sliding)
    assert list(gen.aux_scalar_names) == ["WINDOW"] and "aux_scalars[0]" in gen.source.split("def mask_band")[1]
    _band_matches_mask(gen)
    _band_matches_mask(gen, scalars=[5])


def _scaled_key(b, h, q_idx, kv_idx):
    return 2 * kv_idx <= q_idx


def _query_only(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx < 200)


def _either(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) | (kv_idx < 4)


def _strided(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & ((q_idx - kv_idx) % 2 == 0)


@pytest.mark.parametrize("mask_mod", [_scaled_key, _query_only, _either, _strided])
def test_masks_that_are_not_bands_keep_mask_mod(mask_mod):
    gen = generate(None, mask_mod)
    assert key_band(gen._graph, gen._traced.mask_root) is None
    assert "mask_band" not in gen.source


@pytest.mark.parametrize("name,is_band", [("causal", True), ("sliding_window", True), ("gemma2_local", True),
                                          ("prefix_lm", False), ("document", False), ("longformer", False),
                                          ("dilated_sliding_window", False), ("chunked_causal", False)])
def test_gallery_bands(name, is_band):
    mods = load_gallery()[name].build(B=1, H=2, Q_LEN=256, KV_LEN=256)
    gen = generate(mods.score_mod, mods.mask_mod)
    assert ("mask_mod.band = mask_band" in gen.source) == is_band
    if is_band:
        _band_matches_mask(gen, 256, 256)
