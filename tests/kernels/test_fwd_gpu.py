"""The Hopper forward kernel against the float64 reference, on fresh random inputs (GPU only).

The mods here are hand-written with the code generator's exact contract (see handwritten_mods.py), so these tests
pin the kernel down independently of codegen; tests/backends exercise the generated path.
"""
from __future__ import annotations


import pytest
import torch

pytestmark = pytest.mark.gpu

from flexlab.testing import LSE_ABS_TOL, TOLERANCES, random_qkv, reference, rel_l2  # noqa: E402


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs an sm90 GPU (H100/H200)")


def _run(q, k, v, mods=None, aux_t=(), aux_s=(), block_mask=None, scale=None):
    from flexlab.runtime.compile import KernelMods
    from flexlab.runtime.launch import forward
    return forward(q, k, v, mods or KernelMods(), aux_t, aux_s, block_mask, scale)


def _check(out, lse, q, k, v, score_mod=None, block_mask=None, scale=None, dead_rows=None):
    ref_out, ref_lse = reference(q, k, v, score_mod, block_mask, scale, enable_gqa=q.shape[1] != k.shape[1])
    assert not torch.isnan(out).any(), "NaN in output"
    assert not torch.isnan(lse).any(), "NaN in LSE"
    err = rel_l2(out, ref_out)
    assert err < TOLERANCES[q.dtype], f"rel-L2 {err:.2e}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "LSE -inf pattern differs"
    lse_err = (lse[finite].double() - ref_lse[finite]).abs().max().item()
    assert lse_err < LSE_ABS_TOL, f"LSE max abs error {lse_err:.2e}"
    if dead_rows is not None:
        assert (out[:, :, dead_rows] == 0).all(), "fully masked rows must be exactly 0"
        assert torch.isneginf(lse[:, :, dead_rows]).all()
    return err


@needs_hopper
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("Sq,Skv", [(1, 1), (127, 127), (129, 129), (1000, 1000), (1023, 1024), (200, 333), (333, 200)])
@pytest.mark.parametrize("Hkv", [4, 1])
def test_dense(D, Sq, Skv, Hkv):
    q, k, v = random_qkv(2, 4, Sq, Skv, D, torch.bfloat16, "cuda", Hkv=Hkv)
    out, lse = _run(q, k, v)
    _check(out, lse, q, k, v)


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dtypes_and_strides(dtype):
    # (B, S, H, D) memory viewed as (B, H, S, D): the strides torch gives after a transpose.
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in random_qkv(2, 3, 300, 260, 128, dtype, "cuda"))
    out, lse = _run(q, k, v, scale=0.05)
    _check(out, lse, q, k, v, scale=0.05)


def _mods(score_mod=None, mask_mod=None, tag="", specs=(), kinds=()):
    from flexlab.runtime.compile import KernelMods
    return KernelMods(score_mod, mask_mod, tag, specs, kinds)


@needs_hopper
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("S", [1000, 4096])
def test_causal_block_sparse(D, S):
    from flexlab import create_block_mask
    from handwritten_mods import causal_mask, causal_mask_torch
    q, k, v = random_qkv(1, 4, S, S, D, torch.bfloat16, "cuda", Hkv=2)
    bm = create_block_mask(causal_mask_torch, 1, 1, S, S, device="cuda")
    out, lse = _run(q, k, v, _mods(mask_mod=causal_mask, tag="causal"), block_mask=bm)
    _check(out, lse, q, k, v, block_mask=bm)


@needs_hopper
def test_mask_block_multiple_of_tile():
    from flexlab import create_block_mask
    from handwritten_mods import causal_mask, causal_mask_torch
    q, k, v = random_qkv(1, 2, 1000, 1000, 128, torch.bfloat16, "cuda")
    bm = create_block_mask(causal_mask_torch, 1, 1, 1000, 1000, device="cuda", BLOCK_SIZE=256)
    out, lse = _run(q, k, v, _mods(mask_mod=causal_mask, tag="causal"), block_mask=bm)
    _check(out, lse, q, k, v, block_mask=bm)


@needs_hopper
def test_fully_masked_rows_are_zero():
    from flexlab import create_block_mask
    from handwritten_mods import holes_causal_mask, holes_causal_mask_torch
    q, k, v = random_qkv(2, 2, 700, 700, 128, torch.bfloat16, "cuda")
    bm = create_block_mask(holes_causal_mask_torch, 2, 2, 700, 700, device="cuda")
    out, lse = _run(q, k, v, _mods(mask_mod=holes_causal_mask, tag="holes"), block_mask=bm)
    _check(out, lse, q, k, v, block_mask=bm, dead_rows=torch.arange(0, 700, 7, device="cuda"))


@needs_hopper
def test_document_mask_reads_captured_tensor():
    from flexlab import create_block_mask
    from handwritten_mods import document_mask, document_mask_torch
    S = 1000
    doc = torch.sort(torch.randint(0, 8, (S,), device="cuda")).values.to(torch.int32)
    q, k, v = random_qkv(1, 4, S, S, 64, torch.bfloat16, "cuda")
    bm = create_block_mask(document_mask_torch(doc), 1, 1, S, S, device="cuda")
    out, lse = _run(q, k, v, _mods(mask_mod=document_mask, tag="doc", specs=(("int32", 1),)), (doc,), (), bm)
    _check(out, lse, q, k, v, block_mask=bm)


@needs_hopper
def test_softcap_scalar_is_a_runtime_argument():
    from flexlab.runtime.compile import kernel_cache
    from handwritten_mods import softcap_score, softcap_score_torch
    q, k, v = random_qkv(1, 4, 1000, 1000, 128, torch.bfloat16, "cuda")
    q = q * 4  # large scores so the cap matters
    mods = _mods(score_mod=softcap_score, tag="softcap", kinds=("float",))
    out, lse = _run(q, k, v, mods, (), (20.0,))
    _check(out, lse, q, k, v, score_mod=softcap_score_torch(20.0))
    compiles = kernel_cache().stats.compiles
    out, lse = _run(q, k, v, mods, (), (5.0,))
    _check(out, lse, q, k, v, score_mod=softcap_score_torch(5.0))
    assert kernel_cache().stats.compiles == compiles, "a new captured scalar must not recompile"


@needs_hopper
def test_alibi_causal():
    from flexlab import create_block_mask
    from handwritten_mods import alibi_score, alibi_score_torch, causal_mask, causal_mask_torch
    H, S = 8, 1000
    slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / H) for i in range(H)], device="cuda")
    q, k, v = random_qkv(2, H, S, S, 128, torch.bfloat16, "cuda", Hkv=2)
    bm = create_block_mask(causal_mask_torch, 1, 1, S, S, device="cuda")
    out, lse = _run(q, k, v, _mods(alibi_score, causal_mask, "alibi-causal", (("float32", 1),)), (slopes,), (), bm)
    _check(out, lse, q, k, v, score_mod=alibi_score_torch(slopes), block_mask=bm)




@needs_hopper
@pytest.mark.parametrize("Sq,Skv", [(129, 129), (1000, 1000), (200, 333), (1, 1), (81, 4096), (4096, 160)])
def test_head_dim_256(Sq, Skv):  # (dense: 80-key tiles, so 160 is two whole tiles and 4096 ends in a partial one)
    q, k, v = random_qkv(1, 4, Sq, Skv, 256, torch.bfloat16, "cuda", Hkv=2)
    out, lse = _run(q, k, v)
    _check(out, lse, q, k, v)


@needs_hopper
def test_warm_call_host_overhead_is_small(monkeypatch):
    """Python time of a warm call (launch is asynchronous). The goal is 20 us; the bound leaves room for slow CI hosts.
    Timed as a user's call runs: without the suite's NaN fill of the outputs."""
    import statistics
    import time

    from flexlab.runtime import poison
    monkeypatch.setattr(poison, "ENABLED", False)
    q, k, v = random_qkv(1, 1, 128, 128, 128, torch.bfloat16, "cuda")
    for _ in range(20):
        _run(q, k, v)
    samples = []
    for _ in range(300):
        t0 = time.perf_counter()
        _run(q, k, v)
        samples.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    assert statistics.median(samples) < 60e-6


@needs_hopper
@pytest.mark.parametrize("D", [64, 128])
def test_warm_path_agrees_with_the_full_path(D):
    """A repeated `flexlab.flex_attention` call runs its bound launch (`api._WARM`): the same bits as the full path,
    with and without the LSE; a new captured scalar reaches the kernel; a misaligned view of the same signature and a call wanting gradients
    go back to the full path and stay correct."""
    import flexlab
    import flexlab.api as api
    cap = 20.0

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    q, k, v = random_qkv(1, 4, 1000, 1000, D, torch.bfloat16, "cuda", Hkv=2)
    q = q * 4  # large scores so the cap matters
    bm = flexlab.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 1000, 1000,
                                   device="cuda")

    def call(query):
        return flexlab.flex_attention(query, k, v, softcap, bm, enable_gqa=True, return_lse=True)

    api._WARM.clear()
    full = call(q)
    assert len(api._WARM) == 1, "a forward-only call on the cute backend is remembered"
    warm = call(q)
    assert torch.equal(full[0], warm[0]) and torch.equal(full[1], warm[1])
    _check(*warm, q, k, v, score_mod=softcap, block_mask=bm)
    for _ in range(2):  # without return_lse: the kernel that writes no LSE, full path then warm, same O bits
        out = flexlab.flex_attention(q, k, v, softcap, bm, enable_gqa=True)
        assert torch.equal(out, full[0])
    assert len(api._WARM) == 2
    cap = 5.0
    _check(*call(q), q, k, v, score_mod=softcap, block_mask=bm)
    buf = torch.empty(q.numel() + 8, dtype=q.dtype, device="cuda")
    shifted = buf[4:4 + q.numel()].view_as(q)  # 8 bytes past a 16-byte boundary: TMA cannot read it in place
    shifted.copy_(q)
    _check(*call(shifted), shifted, k, v, score_mod=softcap, block_mask=bm)
    qg = q.detach().requires_grad_(True)
    out, lse = call(qg)
    _check(out.detach(), lse.detach(), q, k, v, score_mod=softcap, block_mask=bm)
    dout = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, qg, dout)
    q64 = q.detach().double().requires_grad_(True)
    ref_out, _ = reference(q64, k, v, softcap, bm, enable_gqa=True)
    (ref_grad,) = torch.autograd.grad(ref_out, q64, dout.double())
    assert not grad.isnan().any() and rel_l2(grad, ref_grad) < 2 * TOLERANCES[q.dtype], "dq of the full path"


@needs_hopper
@pytest.mark.parametrize("persistent", [0, 6])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("Sq,Skv,Hkv", [(1000, 1000, 4), (1023, 777, 1), (128, 4096, 2), (129, 129, 4)])
def test_kv_multicast_cluster_candidate(D, Sq, Skv, Hkv, persistent):
    # FwdConfig.cluster_m=2 (the dense default at D=64 and D=128): pairs of Q tiles share K/V loads;
    # odd tile counts leave the last pair's second CTA past Sq, where it must neither write nor hang its partner.
    # With 6 persistent CTAs, 3 clusters walk every pair of tiles of several heads.
    import dataclasses

    from flexlab.kernels.config import default_config
    from flexlab.runtime.compile import KernelMods
    from flexlab.runtime.launch import forward
    q, k, v = random_qkv(2, 4, Sq, Skv, D, torch.bfloat16, "cuda", Hkv=Hkv)
    cfg = dataclasses.replace(default_config(D), cluster_m=2, persistent_ctas=persistent)
    out, lse = forward(q, k, v, KernelMods(), config=cfg)
    _check(out, lse, q, k, v)


@needs_hopper
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("Sq,Skv,Hkv", [(1000, 1000, 16), (1023, 777, 4), (130, 1024, 2)])
def test_persistent_forward_at_short_keys(masked, Sq, Skv, Hkv):
    # Short tiles (few KV blocks each) run persistent CTAs with dynamic tiles by default. 4 x 16 heads give 128-512
    # tiles, so every CTA loops over several tiles of several heads (longest first under the causal mask).
    from flexlab import create_block_mask
    from flexlab.runtime import launch
    from handwritten_mods import causal_mask, causal_mask_torch
    mods = _mods(mask_mod=causal_mask, tag="causal") if masked else _mods()
    assert launch.config_for(128, masked, mods, Skv, num_sms=132, mean_kv_blocks=4.5).dynamic_tiles
    q, k, v = random_qkv(4, 16, Sq, Skv, 128, torch.bfloat16, "cuda", Hkv=Hkv)
    bm = create_block_mask(causal_mask_torch, 1, 1, Sq, Skv, device="cuda") if masked else None
    out, lse = _run(q, k, v, mods, block_mask=bm)
    _check(out, lse, q, k, v, block_mask=bm)



@needs_hopper
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("ctas,cluster", [(7, 1), (5, 1), (10, 2), (40, 1), (132, 2)])
@pytest.mark.parametrize("B,H,Hkv", [(2, 6, 3), (1, 2, 1)])
def test_split_tail(D, ctas, cluster, B, H, Hkv):
    """`FwdConfig.split_tail`: the tiles after the last whole round are cut into runs of KV blocks, one per worker,
    and the parts of a cut tile merged by the last to arrive. 1000 queries (8 tiles of 128 rows, 6 of 192) over 9
    KV blocks, the last one ragged, with GQA; 2 x 6 heads give the worker counts small and large remainders (one more
    round joins the tail at 5 workers: 96 mod 5 = 1) and fewer tiles than the H200's grid; 1 x 2 heads give fewer
    tiles than half the workers, so a tile is cut into up to four parts. Matches float64 and the one-CTA-per-tile
    kernel, LSE included, over three launches that must each leave every arrival counter at 0 and give the same
    bits."""
    import dataclasses

    from flexlab.kernels.config import default_config
    from flexlab.runtime.compile import KernelMods
    from flexlab.runtime.launch import forward, scheduler_workspace
    base = default_config(D)
    cfg = dataclasses.replace(base, persistent_ctas=ctas, cluster_m=cluster, split_tail=True).validate()
    q, k, v = random_qkv(B, H, 1000, 1100, D, torch.bfloat16, "cuda", Hkv=Hkv)
    ref_out, ref_lse = forward(q, k, v, KernelMods(), config=dataclasses.replace(base, cluster_m=1))
    first = None
    for _ in range(3):
        out, lse = forward(q, k, v, KernelMods(), config=cfg)
        _check(out, lse, q, k, v)
        assert rel_l2(out, ref_out) < 1e-2 and (lse - ref_lse).abs().max().item() < 1e-3
        arrivals, _ = scheduler_workspace(cfg, q.device)
        assert not arrivals.any(), "a split tail left an arrival counter set"
        first = first or (out.clone(), lse.clone())  # parts merged in worker order, whichever arrives last:
        assert torch.equal(out, first[0]) and torch.equal(lse, first[1]), "a launch gave other bits"
    out, none = forward(q, k, v, KernelMods(), config=cfg, with_lse=False)
    assert none is None and rel_l2(out, ref_out) < 1e-2


@needs_hopper
def test_long_dense_keys_run_the_split_tail_by_default():
    """The launcher's default for dense tiles of at least `SPLIT_TAIL_MIN_MEAN_KV_BLOCKS` KV blocks: persistent
    clusters with the split tail. 32 pairs of Q tiles over 65 blocks (the last ragged) on 66 clusters: every pair is
    cut, into two or three parts."""
    from flexlab.runtime import launch
    from flexlab.runtime.compile import KernelMods
    assert launch.config_for(128, False, KernelMods(), 8300, num_sms=132).split_tail
    q, k, v = random_qkv(1, 4, 2048, 8300, 128, torch.bfloat16, "cuda", Hkv=2)
    out, lse = _run(q, k, v)
    _check(out, lse, q, k, v)
    for _ in range(3):  # the same bits on every call, whichever part of a cut pair arrives last
        again, again_lse = _run(q, k, v)
        assert torch.equal(again, out) and torch.equal(again_lse, lse)


@needs_hopper
def test_split_tail_with_a_score_mod():
    """A dense score_mod (soft-cap, a captured scalar) through the split tail: the merge weighs parts by their LSE
    after the score_mod, as the reference does."""
    import dataclasses

    from flexlab.kernels.config import default_config
    from flexlab.runtime.launch import forward
    from handwritten_mods import softcap_score, softcap_score_torch
    mods = _mods(score_mod=softcap_score, tag="softcap", kinds=("float",))
    cfg = dataclasses.replace(default_config(128, False, True), persistent_ctas=7, split_tail=True).validate()
    q, k, v = random_qkv(2, 4, 1000, 1000, 128, torch.bfloat16, "cuda")
    out, lse = forward(q * 4, k, v, mods, (), (20.0,), config=cfg)  # large scores so the cap matters
    _check(out, lse, q * 4, k, v, score_mod=softcap_score_torch(20.0))

@needs_hopper
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("ctas", [7, 132])
def test_dynamic_tile_scheduler(D, masked, ctas):
    # Persistent CTAs that claim tiles from a counter: with 7 CTAs each runs dozens of tiles of many heads. The counter
    # must be back at 0 after every launch (three in a row here), and a second stream must get a counter of its own.
    import dataclasses

    from flexlab import create_block_mask
    from flexlab.kernels.config import default_config
    from flexlab.runtime.launch import forward, tile_counter
    from handwritten_mods import causal_mask, causal_mask_torch
    mods = _mods(mask_mod=causal_mask, tag="causal") if masked else _mods()
    cfg = dataclasses.replace(default_config(D, masked), persistent_ctas=ctas, cluster_m=1, dynamic_tiles=True)
    q, k, v = random_qkv(2, 8, 1000, 1000, D, torch.bfloat16, "cuda", Hkv=2)
    bm = create_block_mask(causal_mask_torch, 1, 1, 1000, 1000, device="cuda") if masked else None
    for _ in range(3):
        out, lse = forward(q, k, v, mods, block_mask=bm, config=cfg)
        _check(out, lse, q, k, v, block_mask=bm)
        assert tile_counter(q.device).item() == 0
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        out2, lse2 = forward(q, k, v, mods, block_mask=bm, config=cfg)
        assert tile_counter(q.device) is not tile_counter(q.device, main)
    main.wait_stream(side)
    _check(out2, lse2, q, k, v, block_mask=bm)


@needs_hopper
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("mask", [None, "causal", "holes"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lazy_rescale(D, mask, dtype):
    """`FwdConfig.lazy_rescale`: a warp keeps its softmax reference max until some row outgrows it by 2^8, and skips
    the O rescale meanwhile. Keys are scaled per chunk of 48 by random amplitudes (0.25 to 8), so maxima jump by
    more than the threshold at some steps and not at others, for some rows of a warp and not others; rows with
    nothing visible yet (the holes mask) must stay exactly 0. Matches float64 and the eager-rescale kernel."""
    import dataclasses

    from flexlab import create_block_mask
    from flexlab.kernels.config import default_config
    from flexlab.runtime.launch import forward
    from handwritten_mods import causal_mask, causal_mask_torch, holes_causal_mask, holes_causal_mask_torch
    S = 1000
    q, k, v = random_qkv(2, 4, S, S, D, dtype, "cuda", Hkv=2)
    gen = torch.Generator(device="cuda").manual_seed(D)
    amp = 2.0 ** (torch.rand(S // 48 + 1, device="cuda", generator=gen) * 5 - 2)
    k = (k.float() * amp.repeat_interleave(48)[:S, None]).to(dtype)
    bm, mods, dead = None, _mods(), None
    if mask == "causal":
        bm = create_block_mask(causal_mask_torch, 1, 1, S, S, device="cuda")
        mods = _mods(mask_mod=causal_mask, tag="causal")
    elif mask == "holes":
        bm = create_block_mask(holes_causal_mask_torch, 1, 1, S, S, device="cuda")
        mods, dead = _mods(mask_mod=holes_causal_mask, tag="holes"), torch.arange(0, S, 7, device="cuda")
    base = default_config(D, bm is not None)
    outs = {}
    for lazy in (False, True):
        out, lse = forward(q, k, v, mods, block_mask=bm, config=dataclasses.replace(base, lazy_rescale=lazy))
        outs[lazy] = (out, lse, _check(out, lse, q, k, v, block_mask=bm, dead_rows=dead))
    assert outs[True][2] <= 1.1 * outs[False][2] + 1e-4, (outs[True][2], outs[False][2])
    assert rel_l2(outs[True][0], outs[False][0]) < TOLERANCES[dtype]
    finite = torch.isfinite(outs[False][1])
    assert (outs[True][1][finite] - outs[False][1][finite]).abs().max().item() < 1e-3


@needs_hopper
@pytest.mark.parametrize("D", [64, 128])
def test_zero_and_negative_scale_take_torch_backend(D):
    """scale=0 and a negative scale never reach the kernels (their softmax starts each row at -inf, exp2(-inf * 0) is
    NaN, and keeps each row's largest raw score, which a negative scale inverts): "auto" runs torch's backend, which
    matches float64, also after the same call signature ran warm through the kernel with a positive scale."""
    import flexlab
    from flexlab import create_block_mask
    from handwritten_mods import causal_mask_torch
    q, k, v = random_qkv(1, 4, 700, 700, D, torch.bfloat16, "cuda")
    bm = create_block_mask(causal_mask_torch, 1, 1, 700, 700, device="cuda")
    for _ in range(2):  # the second call runs warm
        out = flexlab.flex_attention(q, k, v, block_mask=bm, scale=0.1)
    ref_out, _ = reference(q, k, v, None, bm, 0.1)
    assert rel_l2(out, ref_out) < TOLERANCES[q.dtype]
    for scale in (0.0, -0.1):
        with pytest.warns(flexlab.FallbackWarning, match=r"scale=.* flexlab's kernels need scale > 0"):
            out = flexlab.flex_attention(q, k, v, block_mask=bm, scale=scale)
        ref_out, _ = reference(q, k, v, None, bm, scale)
        assert not torch.isnan(out).any()
        assert rel_l2(out, ref_out) < TOLERANCES[q.dtype], scale


@needs_hopper
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("variant,Sq,Skv", [("causal", 777, 1100), ("causal", 6000, 6000),
                                           ("sliding_window", 777, 1100), ("gemma2_local", 1000, 1000)])
def test_band_mask_matches_mask_mod(D, variant, Sq, Skv, monkeypatch):
    """`FwdConfig.band_mask`: partial blocks of a mask the code generator recognises as a band (causal, sliding
    windows, with and without a score_mod) are masked per row from the generated `mask_band`. The same outputs and
    LSE as evaluating mask_mod per score, bitwise, and float64 within tolerance, with the words formed after the QK
    GEMM's wait or, with `mask_early`, while it runs; ragged key lengths, Sq != Skv, GQA, persistent tiles and one CTA
    per tile (D=256 causal at 6000)."""
    import dataclasses

    import flexlab
    import flexlab.api as api
    from flexlab.gallery import load_gallery
    from flexlab.runtime import launch
    mods = load_gallery()[variant].build(B=2, H=4, Q_LEN=Sq, KV_LEN=Skv, device="cuda")
    bm = flexlab.create_block_mask(mods.mask_mod, 1, 1, Sq, Skv, device="cuda")
    q, k, v = random_qkv(2, 4, Sq, Skv, D, torch.bfloat16, "cuda", Hkv=2)
    launcher, outs = launch.scheduled, {}
    for band, early in ((False, False), (True, False), (True, True)):  # (early: the words formed during the GEMM)
        made = {}

        def hook(*a, **kw):
            cfg = launcher(*a, **kw)
            return made.setdefault(cfg, dataclasses.replace(cfg, band_mask=band, mask_early=early))

        monkeypatch.setattr(launch, "scheduled", hook)
        launch._PLANS.clear()
        api._WARM.clear()
        out, lse = flexlab.flex_attention(q, k, v, mods.score_mod, block_mask=bm, enable_gqa=True, return_lse=True,
                                          backend="cute")
        assert made, "the launcher never asked for a configuration"
        outs[band, early] = (out, lse)
    launch._PLANS.clear()
    api._WARM.clear()
    for variant in ((True, False), (True, True)):
        assert torch.equal(outs[variant][0], outs[False, False][0]), variant
        assert torch.equal(outs[variant][1], outs[False, False][1]), variant
    _check(outs[True, True][0], outs[True, True][1], q, k, v, mods.score_mod, block_mask=bm)


@needs_hopper
@pytest.mark.parametrize("variant,Sq,Skv", [("causal", 1000, 1000), ("causal", 777, 1100),
                                           ("sliding_window", 2048, 2000), ("document", 1500, 1500),
                                           ("prefix_lm", 900, 1300), ("alibi", 1000, 1000)])
def test_d256_merged_80_key_tiles(variant, Sq, Skv, monkeypatch):
    """`D256_SPARSE_TILE_N` = 80: a block mask at 128 merged into 80-key tiles (a tile straddling two mask columns is
    full only where both are). Against float64 on ragged lengths, Sq != Skv, GQA, with and without a score_mod."""
    import flexlab
    import flexlab.api as api
    from flexlab.gallery import load_gallery
    from flexlab.kernels import config as policy
    from flexlab.runtime import launch
    monkeypatch.setattr(policy, "D256_SPARSE_TILE_N", 80)
    launch._config.cache_clear()
    launch._PLANS.clear()
    api._WARM.clear()
    try:
        mods = load_gallery()[variant].build(B=2, H=4, Q_LEN=Sq, KV_LEN=Skv, device="cuda")
        mask_mod = mods.mask_mod or (lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
        bm = flexlab.create_block_mask(mask_mod, 1, 1, Sq, Skv, device="cuda")
        q, k, v = random_qkv(2, 4, Sq, Skv, 256, torch.bfloat16, "cuda", Hkv=2)
        out, lse = flexlab.flex_attention(q, k, v, mods.score_mod, block_mask=bm, enable_gqa=True, return_lse=True,
                                          backend="cute")
        planned = [hit[1].config for plans in launch._PLANS.values() for hit in plans[1].values()]
        assert planned and all(cfg.tile_n == 80 for cfg in planned), planned
        _check(out, lse, q, k, v, mods.score_mod, block_mask=bm)
    finally:
        launch._config.cache_clear()
        launch._PLANS.clear()
        api._WARM.clear()


@needs_hopper
@pytest.mark.parametrize("variant,Sq,Skv", [("causal", 4096, 4096), ("causal", 777, 1100),
                                           ("sliding_window", 2000, 2000), ("prefix_lm", 900, 1300),
                                           ("document", 4000, 4000), ("noop", 100, 300)])
@pytest.mark.parametrize("dynamic", [False, True])
def test_d64_padded_rows_in_the_first_tile(variant, Sq, Skv, dynamic):
    """`FwdConfig.ragged_first_tile`: 192-row tiles whose padded rows sit in the first tile, which starts at a
    negative row (TMA zero-fills it on load and drops it on store; the LSE skips it). Against float64 with NaN-filled
    outputs, GQA, Sq != Skv; the documents mask reads a captured tensor, so it runs on stored bits."""
    import flexlab
    from flexlab.backends.cute import _lowered
    from flexlab.gallery import load_gallery
    from flexlab.kernels.config import FwdConfig
    from flexlab.runtime import launch
    mods = load_gallery()[variant].build(B=2, H=4, Q_LEN=Sq, KV_LEN=Skv, device="cuda")
    mask_mod = mods.mask_mod or (lambda b, h, q_idx, kv_idx: q_idx >= 0)
    bm = flexlab.create_block_mask(mask_mod, 1, 1, Sq, Skv, device="cuda")
    low = _lowered(mods.score_mod, mask_mod)
    cfg = FwdConfig(head_dim=64, tile_m=192, tile_n=128, num_stages=3, ragged_first_tile=True,
                    mask_bits=low.stored_masks is not None)
    if dynamic:
        cfg = launch._dynamic(cfg, 132)
    q, k, v = random_qkv(2, 4, Sq, Skv, 64, torch.bfloat16, "cuda", Hkv=2)
    out, lse = launch.forward(q, k, v, low.mods, low.tensors_on(q.device), low.aux_scalars, bm, config=cfg,
                              stored_masks=low.stored_masks)
    _check(out, lse, q, k, v, mods.score_mod, block_mask=bm)


@needs_hopper
@pytest.mark.parametrize("Sq", [4096, 1000])
@pytest.mark.parametrize("ragged_first", [True, False])
def test_launcher_moves_causal_padding_to_the_first_tile(Sq, ragged_first, monkeypatch):
    """The default D=64 causal plan takes `ragged_first_tile` where the lists get shorter
    (`RAGGED_FIRST_MIN_SAVING`); with the knob off the padded rows stay last. Both against float64."""
    import flexlab
    import flexlab.api as api
    from flexlab.kernels import config as policy
    from flexlab.runtime import launch
    monkeypatch.setattr(policy, "RAGGED_FIRST_MIN_SAVING", 0.01 if ragged_first else 1.0)
    launch.forget_plans()
    api._WARM.clear()
    try:
        def causal(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        bm = flexlab.create_block_mask(causal, 1, 1, Sq, Sq, device="cuda")
        q, k, v = random_qkv(2, 4, Sq, Sq, 64, torch.bfloat16, "cuda", Hkv=2)
        out, lse = flexlab.flex_attention(q, k, v, block_mask=bm, enable_gqa=True, return_lse=True, backend="cute")
        planned = [hit[1].config for plans in launch._PLANS.values() for hit in plans[1].values()]
        assert planned and all(cfg.tile_m == 192 and cfg.ragged_first_tile == ragged_first for cfg in planned), planned
        _check(out, lse, q, k, v, block_mask=bm)
    finally:
        launch.forget_plans()
        api._WARM.clear()
