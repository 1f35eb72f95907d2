"""The Hopper backward kernels against the float64 reference, on fresh random inputs (GPU only).

Gradients go through flexlab's custom ops (`differentiable_attention`), so the generated score_mod_bwd and
captured-tensor gradients, the Q-direction block sparsity and the GQA sums are all exercised. The reference is torch
autograd through the dense float64 reference backend, which differentiates the user's own Python mods.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

import flexlab  # noqa: E402
from flexlab.autograd import differentiable_attention  # noqa: E402
from flexlab.gallery import load_gallery  # noqa: E402
from flexlab.testing import random_qkv, reference, rel_l2  # noqa: E402

# rel-L2 of dQ, dK, dV and captured-tensor grads vs float64, bf16 inputs: twice the forward's output tolerance, as the
# backward's GEMMs also take P and dS rounded to bf16 (as FA4's and torch's do; `test_gradient_error_no_worse_than_fa4`
# holds the error to 1.5x FA4's own on the same inputs).
GRAD_TOL = 2e-2


def grad_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """rel-L2, with the reference's norm floored at an RMS of 1e-2 per element: where the exact gradient is zero
    (one query row that sees one key has P = 1, so dS = 0) both sides are rounding noise, and noise over noise is no
    measure. Random-input gradients are far above the floor, so elsewhere this is plain rel-L2."""
    a, b = actual.double(), expected.double()
    floor = 1e-2 * b.numel() ** 0.5
    return float((a - b).norm() / max(float(b.norm()), floor))


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs an sm90 GPU (H100/H200)")


def _backward(q, k, v, score_mod, bm, trainable, dout, gqa, deterministic=None):
    for t in (q, k, v, *trainable):
        t.grad = None
    out = differentiable_attention(q, k, v, score_mod, bm, enable_gqa=gqa, deterministic=deterministic)
    out.backward(dout)
    return [t.grad.clone() for t in (q, k, v, *trainable)]


def _reference_grads(q, k, v, score_mod, bm, trainable, dout, gqa):
    for t in trainable:
        t.grad = None
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    out, _ = reference(q64, k64, v64, score_mod, bm, None, gqa)
    out.backward(dout.double())
    return [q64.grad, k64.grad, v64.grad, *[t.grad.clone() for t in trainable]]


@needs_hopper
@pytest.mark.parametrize("name", sorted(load_gallery()))
@pytest.mark.parametrize("S", [1000, pytest.param(4096, marks=pytest.mark.slow)])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("Hkv", [4, 2], ids=["mha", "gqa"])
def test_gallery_gradients_match_float64(name, S, D, Hkv):
    variant = load_gallery()[name]
    if not variant.accepts_lengths(S, S):
        pytest.skip(f"{name} does not accept S={S}: {variant.lengths_rule}")
    mods = variant.build(B=2, H=4, Q_LEN=S, KV_LEN=S, device="cuda")
    trainable = [mods.tensors[t].requires_grad_(True) for t in variant.trainable]
    bm = flexlab.create_block_mask(mods.mask_mod, 2, 4, S, S, device="cuda") if mods.mask_mod else None
    q, k, v = random_qkv(2, 4, S, S, D, torch.bfloat16, "cuda", Hkv=Hkv, requires_grad=True)
    dout = torch.randn(2, 4, S, D, device="cuda", dtype=torch.bfloat16)
    ours = _backward(q, k, v, mods.score_mod, bm, trainable, dout, Hkv != 4)
    ref = _reference_grads(q, k, v, mods.score_mod, bm, trainable, dout, Hkv != 4)
    names = ["dq", "dk", "dv"] + [f"d{t}" for t in variant.trainable]
    for n, a, b in zip(names, ours, ref):
        assert not torch.isnan(a).any(), f"NaN in {n}"
        assert rel_l2(a, b) < GRAD_TOL, f"{n}: rel-L2 {rel_l2(a, b):.2e}"


@needs_hopper
@pytest.mark.parametrize("Sq,Skv", [(1, 1), (127, 127), (129, 129), (200, 333), (333, 200), (1023, 1024)])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_awkward_lengths_dense(Sq, Skv, D):
    q, k, v = random_qkv(1, 2, Sq, Skv, D, torch.bfloat16, "cuda", requires_grad=True)
    dout = torch.randn(1, 2, Sq, D, device="cuda", dtype=torch.bfloat16)
    for n, a, b in zip(("dq", "dk", "dv"), _backward(q, k, v, None, None, [], dout, False),
                       _reference_grads(q, k, v, None, None, [], dout, False)):
        assert not torch.isnan(a).any(), f"NaN in {n}"
        assert grad_error(a, b) < GRAD_TOL, f"{n}: error {grad_error(a, b):.2e}"


@needs_hopper
@pytest.mark.parametrize("sparse", [None, "window", "documents"], ids=["dense", "sliding-window", "documents"])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_deterministic_mode_repeats_bitwise(sparse, D):
    """Also under masks whose KV tiles list a partial Q tile after full ones (the window's far edge, a document's
    end), which deterministic mode walks in Q order; the documents' mask reads a captured tensor (stored bits)."""
    S = 2048
    bm = None
    if sparse == "window":
        bm = flexlab.create_block_mask(lambda b, h, qi, kv: (qi >= kv) & (qi - kv < 700), 1, 1, S, S, device="cuda")
    elif sparse == "documents":
        doc = (torch.arange(S, device="cuda") * 5 // S).to(torch.int32)  # five documents, ends inside tiles
        bm = flexlab.create_block_mask(lambda b, h, qi, kv: (qi >= kv) & (doc[qi] == doc[kv]), 1, 1, S, S,
                                       device="cuda")
    q, k, v = random_qkv(2, 4, S, S, D, torch.bfloat16, "cuda", Hkv=2, requires_grad=True)
    dout = torch.randn(2, 4, S, D, device="cuda", dtype=torch.bfloat16)
    runs = [_backward(q, k, v, None, bm, [], dout, True, deterministic=True) for _ in range(5)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)
    ref = _reference_grads(q, k, v, None, bm, [], dout, True)
    for a, b in zip(runs[0], ref):
        assert rel_l2(a, b) < GRAD_TOL


@needs_hopper
def test_deterministic_mode_repeats_bitwise_through_the_forward_split_tail():
    """Dense keys of at least `SPLIT_TAIL_MIN_MEAN_KV_BLOCKS` blocks run the forward's split tail by default (its
    cut tiles merged by whichever part arrives last): the output, and so the gradients, still repeat bitwise."""
    from flexlab.runtime import launch
    from flexlab.runtime.compile import KernelMods
    Sq, Skv = 2048, 8300
    if not launch.config_for(128, False, KernelMods(), Skv,
                             num_sms=torch.cuda.get_device_properties(0).multi_processor_count).split_tail:
        pytest.skip("the forward runs no split tail at these lengths on this GPU")
    q, k, v = random_qkv(1, 4, Sq, Skv, 128, torch.bfloat16, "cuda", Hkv=2, requires_grad=True)
    dout = torch.randn(1, 4, Sq, 128, device="cuda", dtype=torch.bfloat16)
    outs, runs = [], []
    for _ in range(5):
        for t in (q, k, v):
            t.grad = None
        out = differentiable_attention(q, k, v, None, None, enable_gqa=True, deterministic=True)
        out.backward(dout)
        outs.append(out.detach().clone())
        runs.append([t.grad.clone() for t in (q, k, v)])
    for i in range(1, 5):
        assert torch.equal(outs[i], outs[0]), "the forward output differs between runs"
        for n, a, b in zip(("dq", "dk", "dv"), runs[i], runs[0]):
            assert torch.equal(a, b), f"{n} differs between runs"
    for n, a, b in zip(("dq", "dk", "dv"), runs[0], _reference_grads(q, k, v, None, None, [], dout, True)):
        assert rel_l2(a, b) < GRAD_TOL, n


@needs_hopper
@pytest.mark.parametrize("D,sparse", [(128, None), (64, None), (128, "causal"), (128, "window"), (64, "documents")])
def test_persistent_ctas_match_one_tile_per_cta(D, sparse, monkeypatch):
    """Persistent CTAs (`BwdConfig.persistent_ctas`: KV tiles claimed from a counter, dK and dV staged in the dS
    buffers) compute every KV tile as one CTA per tile does: dK and dV the same bits, dQ (fp32 partials added in
    another order) within rounding, both against float64. Seven CTAs for 2 x 2 x 9 KV tiles, so each runs several,
    of different lengths under the masks; GQA and ragged lengths; the documents' mask reads a captured tensor."""
    from dataclasses import replace

    from flexlab.kernels import bwd_launch
    Sq, Skv = 1000, 1100
    bm = None
    if sparse == "causal":
        bm = flexlab.create_block_mask(lambda b, h, qi, kv: qi >= kv, 1, 1, Sq, Skv, device="cuda")
    elif sparse == "window":
        bm = flexlab.create_block_mask(lambda b, h, qi, kv: (qi - kv).abs() < 300, 1, 1, Sq, Skv, device="cuda")
    elif sparse == "documents":
        doc = (torch.arange(Skv, device="cuda") * 3 // Skv).to(torch.int32)  # ends inside tiles
        bm = flexlab.create_block_mask(lambda b, h, qi, kv: doc[qi] == doc[kv], 1, 1, Sq, Skv, device="cuda")
    q, k, v = random_qkv(2, 8, Sq, Skv, D, torch.bfloat16, "cuda", Hkv=2, requires_grad=True)
    dout = torch.randn(2, 8, Sq, D, device="cuda", dtype=torch.bfloat16)
    default = bwd_launch._config
    grads = {}
    for name, options in (("one_tile_per_cta", dict(persistent_short_tiles=False, split_last_wave=False)),
                          ("persistent", dict(persistent_ctas=7))):
        cfg = replace(default(D, False, False, 128 if bm is not None else None), **options).validate()
        monkeypatch.setattr(bwd_launch, "_config", lambda *args, cfg=cfg: cfg)
        grads[name] = _backward(q, k, v, None, bm, [], dout, True)
    dq, dk, dv = grads["persistent"]
    one_dq, one_dk, one_dv = grads["one_tile_per_cta"]
    assert torch.equal(dk, one_dk) and torch.equal(dv, one_dv)
    assert rel_l2(dq, one_dq) < 1e-4
    for n, a, b in zip(("dq", "dk", "dv"), grads["persistent"], _reference_grads(q, k, v, None, bm, [], dout, True)):
        assert not torch.isnan(a).any(), f"NaN in {n}"
        assert grad_error(a, b) < GRAD_TOL, f"{n}: error {grad_error(a, b):.2e}"


def _option_against_default(field, D, mask_mod, deterministic, monkeypatch):
    """The backward with `BwdConfig.<field>` (or each field of a tuple) flipped against the launcher's setting on
    the same inputs: dK and dV the
    same bits (the same steps in the same order), dQ within rounding (bitwise in deterministic mode, whose order is
    fixed), and both against float64. GQA, ragged lengths (the padded last Q tile), `mask_mod` as a block mask."""
    from dataclasses import replace

    from flexlab.kernels import bwd_launch
    Sq, Skv = 1000, 1100
    bm = flexlab.create_block_mask(mask_mod, 1, 1, Sq, Skv, device="cuda") if mask_mod is not None else None
    q, k, v = random_qkv(2, 8, Sq, Skv, D, torch.bfloat16, "cuda", Hkv=2, requires_grad=True)
    dout = torch.randn(2, 8, Sq, D, device="cuda", dtype=torch.bfloat16)
    default = bwd_launch._config
    grads = {}
    for flip in (False, True):
        def config(*args, flip=flip):
            cfg = default(*args)
            fields = field if isinstance(field, tuple) else (field,)
            return replace(cfg, **{f: getattr(cfg, f) != flip for f in fields}).validate()
        monkeypatch.setattr(bwd_launch, "_config", config)
        bwd_launch._PLANS.clear()  # (planned once per signature, with the configuration of that time)
        grads[flip] = _backward(q, k, v, None, bm, [], dout, True, deterministic=deterministic)
    (dq, dk, dv), (t_dq, t_dk, t_dv) = grads[True], grads[False]
    assert torch.equal(dk, t_dk) and torch.equal(dv, t_dv)
    assert torch.equal(dq, t_dq) if deterministic else rel_l2(dq, t_dq) < 1e-4
    for n, a, b in zip(("dq", "dk", "dv"), grads[True], _reference_grads(q, k, v, None, bm, [], dout, True)):
        assert not torch.isnan(a).any(), f"NaN in {n}"
        assert grad_error(a, b) < GRAD_TOL, f"{n}: error {grad_error(a, b):.2e}"


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _documents(b, h, q_idx, kv_idx):  # documents of 300 tokens: partial blocks on and off the diagonal
    return (q_idx // 300 == kv_idx // 300) & (q_idx >= kv_idx)


def _window(b, h, q_idx, kv_idx):  # a causal window of 200 keys: partial tiles at both of its edges
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 200)


@needs_hopper
@pytest.mark.parametrize("D,mask_mod,deterministic", [(128, _causal, False), (64, _causal, False),
                                                      (128, _window, False), (64, _window, False),
                                                      (128, _window, True), (256, _window, False)])
def test_band_mask_matches_mask_mod(D, mask_mod, deterministic, monkeypatch):
    """`BwdConfig.band_mask` (partial query tiles of a band mask masked per key row from `mask_band_by_key`) against
    evaluating mask_mod per score."""
    _option_against_default("band_mask", D, mask_mod, deterministic, monkeypatch)


@needs_hopper
@pytest.mark.parametrize("D,mask_mod", [(128, _causal), (128, _window), (64, _window)])
def test_early_band_words_match_mask_mod(D, mask_mod, monkeypatch):
    """`band_mask` with `mask_early`: the band's words formed while the S^T GEMM runs, against mask_mod per score."""
    _option_against_default(("band_mask", "mask_early"), D, mask_mod, False, monkeypatch)


@needs_hopper
@pytest.mark.parametrize("D,sparse,deterministic", [(128, False, False), (128, True, False), (64, True, False),
                                                    (128, True, True)])
def test_dq_bulk_reduce_matches_the_tensor_reduce(D, sparse, deterministic, monkeypatch):
    """`BwdConfig.dq_bulk_reduce` (each dQ slab added by a plain bulk reduce) against the TMA tensor reduce."""
    _option_against_default("dq_bulk_reduce", D, _causal if sparse else None, deterministic, monkeypatch)


@needs_hopper
@pytest.mark.parametrize("D,mask_mod,deterministic", [(128, _causal, False), (64, _causal, False),
                                                      (128, _documents, False), (64, _documents, False),
                                                      (64, _documents, True), (128, _documents, True)])
def test_kind_loops_match_one_loop(D, mask_mod, deterministic, monkeypatch):
    """`BwdConfig.kind_loops` (partial and full query tiles walked by a loop each) against one loop that branches."""
    _option_against_default("kind_loops", D, mask_mod, deterministic, monkeypatch)


@needs_hopper
@pytest.mark.parametrize("parts", [2, 3, 5, 8])
@pytest.mark.parametrize("D,score", [(128, None), (64, None), (256, None), (128, "bias")])
def test_split_tail_matches_whole_tiles(D, score, parts, monkeypatch):
    """The cut last wave (`BwdConfig.whole_tiles_only`, then `split_tail`): with the launcher told the GPU has 5 SMs,
    2 x 2 x 9 KV tiles leave 1 for a last wave (2 x 2 x 18 at D=256 leave 2), cut into `parts` CTAs of a second
    kernel that walk shares of its GQA group's query steps; the last part to finish adds the others' dK and dV.
    Against whole tiles (the same sums in another order) and float64; ragged lengths, GQA, and a learnable relative
    bias (its gradient's atomics from every part)."""
    from flexlab.kernels import bwd_config, bwd_launch
    Sq, Skv = 1000, 1100
    bias = torch.randn(8, 65, device="cuda", requires_grad=True)

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, torch.clamp(kv_idx - q_idx, -32, 32) + 32]
    score_mod, trainable = (rel_bias, [bias]) if score == "bias" else (None, [])
    q, k, v = random_qkv(2, 8, Sq, Skv, D, torch.bfloat16, "cuda", Hkv=2, requires_grad=True)
    dout = torch.randn(2, 8, Sq, D, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setattr(bwd_launch, "_sm_count", lambda dev: 5)
    monkeypatch.setattr(bwd_config, "split_parts", lambda tiles, workers, steps: parts)
    bwd_launch._PLANS.clear()  # (plans are cached per signature, not per SM count or cut)
    split = _backward(q, k, v, score_mod, None, trainable, dout, True)
    again = _backward(q, k, v, score_mod, None, trainable, dout, True)
    assert torch.equal(split[1], again[1]) and torch.equal(split[2], again[2]), "dK, dV of cut tiles not repeatable"
    plan = next(reversed(bwd_launch._PLANS.values()))
    tiles = 2 * 2 * -(-Skv // plan.cfg.tile_n)  # (9 tiles of 128 keys per head; 18 of 64 at D=256)
    assert plan.tail is not None and plan.tail[:3] == (tiles - tiles % 5, parts, tiles % 5), "no cut last wave"
    monkeypatch.setattr(bwd_config, "split_parts", lambda tiles, workers, steps: 1)
    bwd_launch._PLANS.clear()
    whole = _backward(q, k, v, score_mod, None, trainable, dout, True)
    assert next(reversed(bwd_launch._PLANS.values())).tail is None
    names = ["dq", "dk", "dv"] + ["dbias"] * len(trainable)
    for n, a, b in zip(names, split, whole):
        assert not torch.isnan(a).any(), f"NaN in {n}"
        assert rel_l2(a, b) < 1e-4, f"{n} against whole tiles: rel-L2 {rel_l2(a, b):.2e}"
    for n, a, b in zip(names, split, _reference_grads(q, k, v, score_mod, None, trainable, dout, True)):
        assert grad_error(a, b) < GRAD_TOL, f"{n}: error {grad_error(a, b):.2e}"


@needs_hopper
@pytest.mark.parametrize("D,how", [(128, "whole"), (64, "whole"), (256, "whole"), (128, "persistent"), (128, "cut"),
                                   (256, "cut")])
def test_rotated_dense_walk_matches_the_plain_walk(D, how, monkeypatch):
    """`BwdConfig.rotate_dense_walk` (KV tile n starts its walk n query tiles below the last and wraps around) sums
    the same query tiles as the plain walk in another order: dQ, dK and dV within fp32 rounding of it, dK and dV the
    same bits from run to run, all against float64. GQA and ragged lengths (the padded last query tile is met
    mid-walk); one CTA per tile, persistent CTAs (7 for 2 x 2 x 9 tiles), and a cut last wave whose parts walk
    shares of the rotated walk."""
    from dataclasses import replace

    from flexlab.kernels import bwd_config, bwd_launch
    Sq, Skv = 1000, 1100
    q, k, v = random_qkv(2, 8, Sq, Skv, D, torch.bfloat16, "cuda", Hkv=2, requires_grad=True)
    dout = torch.randn(2, 8, Sq, D, device="cuda", dtype=torch.bfloat16)
    if how == "cut":  # 5 SMs: the tiles past the whole waves run as 3 parts each
        monkeypatch.setattr(bwd_launch, "_sm_count", lambda dev: 5)
    monkeypatch.setattr(bwd_config, "split_parts", lambda tiles, workers, steps: 3 if how == "cut" else 1)
    options = dict(persistent_ctas=7) if how == "persistent" else {}
    default = bwd_launch._config
    grads = {}
    for rotate in (False, True):
        def config(*args, rotate=rotate):
            return replace(default(*args), rotate_dense_walk=rotate, **options).validate()
        monkeypatch.setattr(bwd_launch, "_config", config)
        bwd_launch._PLANS.clear()  # (planned once per signature, with the configuration of that time)
        grads[rotate] = _backward(q, k, v, None, None, [], dout, True)
        plan = next(reversed(bwd_launch._PLANS.values()))
        assert plan.cfg.rotate_dense_walk == rotate and (plan.tail is not None) == (how == "cut")
    again = _backward(q, k, v, None, None, [], dout, True)
    assert torch.equal(again[1], grads[True][1]) and torch.equal(again[2], grads[True][2]), "dK, dV not repeatable"
    for n, a, b in zip(("dq", "dk", "dv"), grads[True], grads[False]):
        assert not torch.isnan(a).any(), f"NaN in {n}"
        assert rel_l2(a, b) < 1e-4, f"{n} against the plain walk: rel-L2 {rel_l2(a, b):.2e}"
    for n, a, b in zip(("dq", "dk", "dv"), grads[True], _reference_grads(q, k, v, None, None, [], dout, True)):
        assert grad_error(a, b) < GRAD_TOL, f"{n}: error {grad_error(a, b):.2e}"


@needs_hopper
def test_long_dense_keys_cut_the_last_wave_by_default(monkeypatch):
    """B4 H16 S4k at D=128: 2048 KV tiles on the H200's 132 SMs leave 68 for a 16th wave, which the launcher cuts
    (`bwd_config.split_parts`); the gradients equal the whole tiles' within fp32 reordering, and dK and dV repeat
    bitwise run after run (dQ's atomics add in the order they land)."""
    from dataclasses import replace

    from flexlab.kernels import bwd_config, bwd_launch
    if torch.cuda.get_device_properties(0).multi_processor_count != 132:
        pytest.skip("the expected cut is worked out for 132 SMs")
    q, k, v = random_qkv(4, 16, 4096, 4096, 128, torch.bfloat16, "cuda", requires_grad=True)
    dout = torch.randn_like(q)
    assert bwd_config.split_parts(2048, 132, -(-4096 // bwd_config.DENSE_TILE_M)) > 1
    runs = [_backward(q, k, v, None, None, [], dout, False) for _ in range(2)]
    plan = next(reversed(bwd_launch._PLANS.values()))
    assert plan.cfg.whole_tiles_only and plan.tail[:2] == (1980, 3)  # 68 tiles cut in 3
    whole_cfg = replace(bwd_launch._config(128, False, False, None), split_last_wave=False)
    monkeypatch.setattr(bwd_launch, "_config", lambda *args: whole_cfg)
    whole = _backward(q, k, v, None, None, [], dout, False)
    assert next(reversed(bwd_launch._PLANS.values())).tail is None
    for n, a, b, c in zip(("dq", "dk", "dv"), runs[0], runs[1], whole):
        assert not torch.isnan(a).any(), f"NaN in {n}"
        assert rel_l2(a, b) < 1e-4 and rel_l2(a, c) < 1e-4, n  # (fp32 sums in the order parts and tiles land)
    # dK and dV of a cut tile are added in part order whichever part finishes last: the same bits run after run
    assert torch.equal(runs[0][1], runs[1][1]) and torch.equal(runs[0][2], runs[1][2])
    # ... and right: one (batch, head) against float64 (its gradients depend on its own inputs alone)
    q1, k1, v1 = (t.detach()[:1, :1].double().requires_grad_(True) for t in (q, k, v))
    reference(q1, k1, v1)[0].backward(dout[:1, :1].double())
    for n, a, b in zip(("dq", "dk", "dv"), runs[0], (q1.grad, k1.grad, v1.grad)):
        assert rel_l2(a[:1, :1], b) < GRAD_TOL, f"{n}: rel-L2 {rel_l2(a[:1, :1], b):.2e}"


@needs_hopper
def test_deterministic_mode_with_learnable_tensors():
    """Bitwise-repeatable bias gradients: the generated code accumulates through add_aux_grad (exact int64 fixed
    point), and they match float64."""
    from flexlab import _ops
    bias = torch.randn(2, 9, device="cuda", requires_grad=True)

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, torch.clamp(kv_idx - q_idx, -4, 4) + 4]

    q, k, v = random_qkv(1, 2, 1000, 1000, 64, torch.bfloat16, "cuda", requires_grad=True)
    dout = torch.randn(1, 2, 1000, 64, device="cuda", dtype=torch.bfloat16)
    assert "add_aux_grad" in _ops.mod_entry(_ops.register_mods(rel_bias, None)).generated.source
    runs = [_backward(q, k, v, rel_bias, None, [bias], dout, False, deterministic=True) for _ in range(5)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)
    ref = _reference_grads(q, k, v, rel_bias, None, [bias], dout, False)
    for a, b in zip(runs[0], ref):
        assert rel_l2(a, b) < GRAD_TOL


# ------------------------------------------------------------------------------------ through flexlab.flex_attention
@needs_hopper
@pytest.mark.parametrize("backend", ["cute", "auto"])
def test_flex_attention_trains_on_the_cute_kernels(backend):
    """The public API: gradients for Q, K, V and a learnable captured table, with `auto` choosing our kernels."""
    from flexlab.api import _choose_backend
    S, D = 1000, 128
    bias = (0.1 * torch.randn(4, 65, device="cuda")).requires_grad_(True)

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, torch.clamp(kv_idx - q_idx, -32, 32) + 32]

    bm = flexlab.create_block_mask(lambda b, h, qi, kv: qi >= kv, 1, 1, S, S, device="cuda")
    q, k, v = random_qkv(2, 4, S, S, D, torch.bfloat16, "cuda", Hkv=2, requires_grad=True)
    assert _choose_backend("auto", q, k, v, rel_bias, bm, False) == ("cute", True)
    out, lse = flexlab.flex_attention(q, k, v, rel_bias, bm, enable_gqa=True, return_lse=True, backend=backend)
    dout = torch.randn_like(out)
    (out.float() * dout.float()).sum().backward()
    ours = [t.grad.clone() for t in (q, k, v, bias)]
    ref = _reference_grads(q, k, v, rel_bias, bm, [bias], dout, True)
    for n, a, b in zip(("dq", "dk", "dv", "dbias"), ours, ref):
        assert not torch.isnan(a).any(), f"NaN in {n}"
        assert rel_l2(a, b) < GRAD_TOL, f"{n}: rel-L2 {rel_l2(a, b):.2e}"


@needs_hopper
def test_torch_compile_fullgraph_model_on_gpu():
    """A model calling flexlab.flex_attention compiles into one graph (inductor) and matches eager gradients."""
    from torch._dynamo.testing import CompileCounterWithBackend
    bias = (0.1 * torch.randn(4, 33, device="cuda")).requires_grad_(True)

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, torch.clamp(kv_idx - q_idx, -16, 16) + 16]

    proj = torch.nn.Linear(4 * 64, 3 * 4 * 64, device="cuda", dtype=torch.bfloat16)
    bm = flexlab.create_block_mask(lambda b, h, qi, kv: qi >= kv, 1, 1, 512, 512, device="cuda")

    def model(x):
        B, S, _ = x.shape
        q, k, v = proj(x).view(B, S, 3, 4, 64).permute(2, 0, 3, 1, 4)
        return flexlab.flex_attention(q, k, v, rel_bias, bm).float().square().mean()

    x = torch.randn(2, 512, 4 * 64, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    loss = compiled(x)
    loss.backward()
    got = [bias.grad.clone(), proj.weight.grad.clone()]
    assert counter.frame_count == 1
    bias.grad = None
    proj.zero_grad()
    eager = model(x)
    eager.backward()
    assert torch.allclose(loss, eager, rtol=1e-3)
    assert rel_l2(got[0], bias.grad) < 1e-2
    assert rel_l2(got[1], proj.weight.grad) < 1e-2


@needs_hopper
@pytest.mark.parametrize("variant", ["dense", "causal", "sliding_window"])
@pytest.mark.parametrize("S", [1000, 4096])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("Hkv", [4, 2], ids=["mha", "gqa"])
def test_gradient_error_no_worse_than_fa4(variant, S, D, Hkv):
    """Our gradients against float64 always; where flash-attn-4 is installed and runs the same attention, their
    error is at most 1.5x its error."""
    window = 256
    masks = {"dense": None, "causal": lambda b, h, qi, kv: qi >= kv,
             "sliding_window": lambda b, h, qi, kv: (qi >= kv) & (qi - kv < window)}
    fa4_kwargs = {"dense": {}, "causal": {"causal": True}, "sliding_window": {"window_size": (window - 1, 0)}}
    bm = flexlab.create_block_mask(masks[variant], 1, 1, S, S, device="cuda") if masks[variant] else None
    q, k, v = random_qkv(2, 4, S, S, D, torch.bfloat16, "cuda", Hkv=Hkv, requires_grad=True)
    dout = torch.randn(2, 4, S, D, device="cuda", dtype=torch.bfloat16)
    ours = _backward(q, k, v, None, bm, [], dout, Hkv != 4)
    ref = _reference_grads(q, k, v, None, bm, [], dout, Hkv != 4)
    for n, a, b in zip(("dq", "dk", "dv"), ours, ref):
        assert not a.isnan().any() and rel_l2(a, b) < GRAD_TOL, f"{n}: rel-L2 {rel_l2(a, b):.2e}"
    fa4 = pytest.importorskip("flash_attn.cute")  # (a peer to compare with, not a dependency)
    qf, kf, vf = (t.detach().transpose(1, 2).contiguous().requires_grad_(True) for t in (q, k, v))
    try:
        out = fa4.flash_attn_func(qf, kf, vf, **fa4_kwargs[variant])
        out = out[0] if isinstance(out, tuple) else out
        out.backward(dout.transpose(1, 2))
    except Exception as err:  # FA4 has no kernel for this case: nothing to compare with
        pytest.skip(f"flash-attn-4 cannot run it: {type(err).__name__}: {err}")
    theirs = [t.grad.transpose(1, 2) for t in (qf, kf, vf)]
    for n, a, f, b in zip(("dq", "dk", "dv"), ours, theirs, ref):
        e_ours, e_fa4 = rel_l2(a, b), rel_l2(f, b)
        assert e_ours < GRAD_TOL and e_ours <= 1.5 * e_fa4, f"{n}: ours {e_ours:.2e}, FA4 {e_fa4:.2e}"


@needs_hopper
@pytest.mark.parametrize("deterministic", [False, True])
def test_warm_backward_never_waits_for_the_device(deterministic):
    """Once warm, the backward op (as autograd calls it) reads nothing back from the GPU: captured int64 tables are
    narrowed once, block lists and rank tables are cached, and the kernels take torch tensors through TVM-FFI. A
    device-to-host read would stall every training step."""
    from flexlab import _ops
    S = 1000
    doc = torch.arange(S, device="cuda") * 3 // S  # int64: the kernel reads it narrowed to int32
    bias = (0.1 * torch.randn(4, 65, device="cuda")).requires_grad_(True)

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, torch.clamp(kv_idx - q_idx, -32, 32) + 32]

    def document(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    bm = flexlab.create_block_mask(document, 1, 1, S, S, device="cuda")
    masks = [bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices, bm.q_num_blocks,
             bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices]
    key = _ops.register_mods(rel_bias, document)
    entry = _ops.mod_entry(key)
    q, k, v = random_qkv(2, 4, S, S, 128, torch.bfloat16, "cuda", Hkv=2)
    dout = torch.randn(2, 4, S, 128, device="cuda", dtype=torch.bfloat16)
    out, lse = _ops.flex_attention_fwd(q, k, v, entry.aux_tensors, masks, [128, 128], 0.125, key, entry.aux_scalars,
                                       deterministic)

    def bwd():
        return _ops.flex_attention_bwd(dout, q, k, v, out, lse, None, entry.aux_tensors, masks, [128, 128], 0.125, key,
                                       entry.aux_scalars, deterministic)

    first = bwd()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        second = bwd()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    for a, b in zip(first[:3] + tuple(first[3]), second[:3] + tuple(second[3])):
        assert rel_l2(a.float(), b.float()) < 1e-3  # same gradients (up to atomics order when not deterministic)
