"""Partial-block masks stored as bits (`FwdConfig.mask_bits`, `runtime.mask_bits`) on the H200, against the float64
reference and against the same kernel evaluating mask_mod itself (GPU only)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.gpu

from flexlab.testing import LSE_ABS_TOL, TOLERANCES, random_qkv, reference, rel_l2  # noqa: E402


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs an sm90 GPU (H100/H200)")


def _check(out, lse, q, k, v, block_mask):
    ref_out, ref_lse = reference(q, k, v, None, block_mask, None, enable_gqa=q.shape[1] != k.shape[1])
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    err = rel_l2(out, ref_out)
    assert err < TOLERANCES[q.dtype], f"rel-L2 {err:.2e}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "LSE -inf pattern differs"
    lse_err = (lse[finite].double() - ref_lse[finite]).abs().max().item()
    assert lse_err < LSE_ABS_TOL, f"LSE max abs error {lse_err:.2e}"


def _masks(S_kv, device):
    """(name, torch mask_mod, reads b, reads h): captured tensors indexed by the query, the key, the head, the batch."""
    gen = torch.Generator().manual_seed(3)
    doc = torch.sort(torch.randint(0, 9, (S_kv,), generator=gen)).values.to(torch.int32).to(device)
    window = torch.randint(64, 700, (16,), generator=gen).to(torch.int32).to(device)
    shift = torch.randint(0, 300, (4,), generator=gen).to(torch.int32).to(device)

    def document(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    def per_head_window(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= window[h]

    def per_batch_prefix(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + shift[b]) & (doc[kv_idx] % 3 != 1)

    return [("document", document, False, False), ("per_head_window", per_head_window, False, True),
            ("per_batch_prefix", per_batch_prefix, True, False)]


@needs_hopper
@pytest.mark.parametrize("D,tile_m", [(64, 128), (64, 192), (128, 128)])
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("Sq,Skv,Hkv", [(1000, 1000, 8), (777, 1023, 2), (1023, 777, 8)])
def test_stored_bits_match_mask_mod(D, tile_m, dynamic, Sq, Skv, Hkv):
    # tile_m=192 (three consumer warpgroups over merged mask rows): the launcher's D=64 choice once the mask is bits
    # and its tiles are long (`launch.bits_wide_tiles`).
    from flexlab import create_block_mask
    from flexlab.backends.cute import _lowered
    from flexlab.runtime import launch
    q, k, v = random_qkv(2, 8, Sq, Skv, D, torch.bfloat16, "cuda", Hkv=Hkv)
    for name, mask_mod, varies_b, varies_h in _masks(max(Sq, Skv), "cuda"):
        bm = create_block_mask(mask_mod, 2 if varies_b else None, 8 if varies_h else None, Sq, Skv, device="cuda")
        low = _lowered(None, mask_mod)
        assert low.stored_masks is not None, name
        assert (low.stored_masks.varies_b, low.stored_masks.varies_h) == (varies_b, varies_h)
        base = launch.config_for(D, True, low.mods, Skv)
        if tile_m != base.tile_m:
            base = dataclasses.replace(base, tile_m=tile_m, num_stages=3)
        if dynamic:
            base = launch._dynamic(base, 132)
        args = (q, k, v, low.mods, low.tensors_on(q.device), low.aux_scalars, bm)
        out_eval, lse_eval = launch.forward(*args, config=base)
        out_bits, lse_bits = launch.forward(*args, config=dataclasses.replace(base, mask_bits=True),
                                            stored_masks=low.stored_masks)
        _check(out_bits, lse_bits, q, k, v, bm)
        # the same scores are masked either way, so the kernels agree bit for bit
        assert torch.equal(out_bits, out_eval), name
        assert torch.equal(lse_bits, lse_eval), name


@needs_hopper
def test_public_call_stores_bits_and_follows_in_place_edits():
    # A block mask whose blocks are all partial leaves every decision to mask_mod; editing the captured document ids in
    # place must change the result on the next call (the stored bits are rebuilt), on the warm path too.
    from torch.nn.attention.flex_attention import BlockMask

    import flexlab
    from flexlab.backends.cute import _LOWERED
    S = 1000
    doc = torch.sort(torch.randint(0, 6, (S,), device="cuda")).values.to(torch.int32)

    def document(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    n = -(-S // 128)
    kv_num = torch.full((1, 1, n), n, dtype=torch.int32, device="cuda")
    kv_idx = torch.arange(n, dtype=torch.int32, device="cuda").expand(1, 1, n, n).contiguous()
    bm = BlockMask.from_kv_blocks(kv_num, kv_idx, BLOCK_SIZE=128, mask_mod=document, seq_lengths=(S, S))
    q, k, v = random_qkv(2, 4, S, S, 128, torch.bfloat16, "cuda")
    for step in range(3):
        out, lse = flexlab.flex_attention(q, k, v, block_mask=bm, return_lse=True, backend="cute")
        _check(out, lse, q, k, v, bm)
        low = _LOWERED[(None, document)]
        assert low.stored_masks is not None and low.stored_masks._cache, "no bits were stored"
        doc.copy_(torch.sort(torch.randint(0, 6 + step, (S,), device="cuda")).values.to(torch.int32))


@needs_hopper
@pytest.mark.parametrize("Sq,Skv", [(2048, 2048), (1900, 2100)])
def test_public_call_takes_wide_tiles_for_long_d64_documents(Sq, Skv):
    # Documents long enough that a 128-row tile visits more than D64_BITS_TILE192_MIN_MEAN_KV_BLOCKS KV blocks: the
    # default plan reads stored bits with 192-row tiles. Checked against float64 and against the kernel evaluating
    # mask_mod with 128-row tiles.
    import flexlab
    from flexlab.backends.cute import _lowered
    from flexlab.kernels import config as policy
    from flexlab.runtime import launch
    doc = (torch.arange(max(Sq, Skv), device="cuda", dtype=torch.int32) * 2) // max(Sq, Skv)

    def two_documents(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    bm = flexlab.create_block_mask(two_documents, None, None, Sq, Skv, device="cuda")
    q, k, v = random_qkv(2, 4, Sq, Skv, 64, torch.bfloat16, "cuda", Hkv=2)
    low = _lowered(None, two_documents)
    kbm = launch.kernel_block_mask(bm, Sq, 128, 128, Skv)
    assert kbm.mean_kv_blocks >= policy.D64_BITS_TILE192_MIN_MEAN_KV_BLOCKS > 0
    launch._PLANS.clear()  # only this call's plans below (compiled kernels stay cached)
    out, lse = flexlab.flex_attention(q, k, v, block_mask=bm, return_lse=True, enable_gqa=True, backend="cute")
    _check(out, lse, q, k, v, bm)
    # the configurations this call compiled, by name (not the launcher's positional plan key)
    ran = [key.config for (base, compiled, _) in launch._PLANS.values() for _, key in compiled.values()
           if base.head_dim == 64]
    assert any(cfg.mask_bits and cfg.tile_m == 192 for cfg in ran), ran
    base = launch.config_for(64, True, low.mods, Skv)
    out_eval, _ = launch.forward(q, k, v, low.mods, low.tensors_on(q.device), low.aux_scalars, bm, config=base)
    assert rel_l2(out, out_eval) < 1e-2


@needs_hopper
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("Sq,Skv,Hkv", [(1000, 1000, 4), (777, 1023, 2)])
def test_backward_reads_stored_bits(D, Sq, Skv, Hkv, monkeypatch):
    # The training step of masks that read captured tensors: the backward kernel tests stored bits (rows = keys,
    # 64 query columns at D=128, 128 at D=64). Deterministic mode makes the gradients comparable bit for bit with the
    # same kernel evaluating mask_mod itself; both against float64 autograd.
    from flexlab import create_block_mask
    from flexlab._ops import _ENTRIES, _KEYS
    from flexlab.autograd import differentiable_attention
    from flexlab.kernels import bwd_launch
    from test_bwd_gpu import GRAD_TOL, _reference_grads, grad_error
    gqa = Hkv != 8
    q, k, v = random_qkv(2, 8, Sq, Skv, D, torch.bfloat16, "cuda", Hkv=Hkv)
    dout = torch.randn_like(q)
    for name, mask_mod, varies_b, varies_h in _masks(max(Sq, Skv), "cuda"):
        bm = create_block_mask(mask_mod, 2 if varies_b else None, 8 if varies_h else None, Sq, Skv, device="cuda")
        grads = {}
        for mode in ("bits", "inline"):
            if mode == "inline":
                monkeypatch.setattr(bwd_launch, "stored_bits", lambda *args, **kwargs: None)
                monkeypatch.setattr(bwd_launch, "_PLANS", type(bwd_launch._PLANS)())  # plan again, without bits
            qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
            out = differentiable_attention(qq, kk, vv, None, bm, enable_gqa=gqa, deterministic=True)
            out.backward(dout)
            grads[mode] = [t.grad for t in (qq, kk, vv)]
            if mode == "bits":
                store = _ENTRIES[_KEYS[(None, mask_mod)]].stored_masks
                assert store is not None and any(not key[3] for key in store._cache), "the backward stored no bits"
        monkeypatch.undo()
        for got, want in zip(grads["bits"], grads["inline"]):
            assert torch.equal(got, want), name
        ref = _reference_grads(q, k, v, None, bm, [], dout, gqa)
        for got, want, what in zip(grads["bits"], ref, ("dq", "dk", "dv")):
            err = grad_error(got, want)
            assert err < GRAD_TOL, f"{name} {what} rel-L2 {err:.2e}"
