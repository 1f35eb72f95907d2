"""Issue-4 correctness matrix: every gallery variant x S in {1000, 4096} x D in {64, 128} x {MHA, GQA} through
`flex_attention(backend="cute")`, against the float64 reference: rel-L2 < 1e-2, LSE within `LSE_ABS_TOL`, no NaN,
and fully masked rows exactly 0 with LSE -inf. Slow (about a minute with a warm kernel cache)."""
from __future__ import annotations

import pytest
import torch

import flexlab
from flexlab.gallery import load_gallery
from flexlab.testing import LSE_ABS_TOL, random_qkv, reference, rel_l2

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

VARIANTS = load_gallery()


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["MHA", "GQA"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("S", [1000, 4096])
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_matrix(name, S, D, heads):
    H, Hkv = heads
    v = VARIANTS[name]
    if not v.accepts_lengths(S, S):
        pytest.skip(f"{name} does not take S={S}")
    mods = v.build(1, H, S, S, device="cuda")
    q, k, vv = random_qkv(1, H, S, S, D, torch.bfloat16, "cuda", Hkv=Hkv)
    bm = flexlab.create_block_mask(mods.mask_mod, 1, H, S, S, device="cuda") if mods.mask_mod else None
    with torch.no_grad():
        out, lse = flexlab.flex_attention(q, k, vv, score_mod=mods.score_mod, block_mask=bm, enable_gqa=H != Hkv,
                                          return_lse=True, backend="cute")
    ref_out, ref_lse = reference(q, k, vv, mods.score_mod, bm, enable_gqa=H != Hkv)
    assert not out.isnan().any() and not lse.isnan().any()
    err = rel_l2(out, ref_out)
    assert err < 1e-2, f"{name}: rel-L2 {err:.2e}"
    alive = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), alive), f"{name}: fully masked rows differ"
    lse_err = (lse[alive].double() - ref_lse[alive]).abs().max().item()
    assert lse_err < LSE_ABS_TOL, f"{name}: LSE max abs error {lse_err:.2e}"
    assert (out[~alive] == 0).all(), f"{name}: fully masked rows must be exactly 0"
