"""Every gallery variant through flexlab's CuTeDSL backend on a Hopper GPU, against the float64 reference."""
from __future__ import annotations

import pytest
import torch

import flexlab
from flexlab.gallery import load_gallery
from flexlab.testing import LSE_ABS_TOL, TOLERANCES, random_qkv, reference, rel_l2

pytestmark = pytest.mark.gpu

VARIANTS = load_gallery()


def _lengths(v):
    return next(ql for ql in [(1000, 1000), (1023, 1024), (256, 1000)] if v.accepts_lengths(*ql))


# bf16 for every variant; fp16 for a few (one kernel compile per variant and dtype, so keep the list short)
CASES = [pytest.param(n, torch.bfloat16, id=f"{n}-bf16") for n in sorted(VARIANTS)] + [
    pytest.param(n, torch.float16, id=f"{n}-fp16") for n in ("causal", "alibi", "document", "padded_causal")]


@pytest.mark.parametrize("name,dtype", CASES)
def test_cute_backend_matches_reference(name, dtype):
    from flexlab.backends import cute

    v = VARIANTS[name]
    B, H, D, (Q, KV) = 2, 4, 128, _lengths(v)
    mods = v.build(B, H, Q, KV, device="cuda")
    q, k, vv = random_qkv(B, H, Q, KV, D, dtype=dtype, device="cuda")
    block_mask = flexlab.create_block_mask(mods.mask_mod, B, H, Q, KV, device="cuda") if mods.mask_mod else None
    ok, reason = cute.is_supported(q, k, vv, mods.score_mod, block_mask, None, False)
    assert ok, f"the cute backend refuses gallery variant {name}: {reason}"  # (every variant runs on Hopper)
    with torch.no_grad():
        out, lse = flexlab.flex_attention(q, k, vv, score_mod=mods.score_mod, block_mask=block_mask,
                                          return_lse=True, backend="cute")
    ref_out, ref_lse = reference(q, k, vv, mods.score_mod, block_mask)
    assert not out.isnan().any() and not lse.isnan().any()
    err = rel_l2(out, ref_out)
    assert err < TOLERANCES[dtype], f"{name}: rel-L2 {err:.2e}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), f"{name}: fully masked rows differ"
    lse_err = (lse[finite].double() - ref_lse[finite]).abs().max().item()
    assert lse_err < LSE_ABS_TOL, f"{name}: LSE max abs error {lse_err:.2e}"
    assert (out[~finite] == 0).all(), f"{name}: fully masked rows must be exactly 0"
