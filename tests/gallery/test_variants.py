"""Every gallery variant against an independent float64 rewrite of its math, and against torch's own flex_attention.

The rewrites below are deliberately written differently from the mods (dense index grids, loops, other
formulations of the same rule), so a slip in a variant file does not repeat itself here. Captured data tensors
(document ids, tables) are checked against their own independent construction before they are used.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention

import torch.nn.attention.flex_attention as flex_module

import flexlab
from flexlab.gallery import load_gallery
from flexlab.mask import block_states
from flexlab.testing import TOLERANCES, random_qkv, rel_l2

VARIANTS = load_gallery()
B, H, D = 2, 2, 16
CANDIDATE_LENGTHS = [(127, 127), (129, 129), (200, 333), (333, 200), (64, 300), (130, 130)]


def _grid(Q, KV):
    return torch.arange(Q)[:, None], torch.arange(KV)[None, :]


def _causal(Q, KV):
    qi, ki = _grid(Q, KV)
    return qi >= ki


def _pixel(idx, width):
    return idx // width, idx % width


def _natten_window_start(pos, size, kernel):
    """Start of NATTEN's kernel-wide window around `pos` on an axis of `size` cells, kept inside the axis."""
    return torch.clamp(pos - kernel // 2, min=0).clamp(max=size - kernel) if size >= kernel else torch.full_like(
        pos, size - kernel)


# Each entry: (B, H, Q, KV, params, tensors) -> (mask (B|1, H|1, Q, KV) bool or None, score transform or None).
# A score transform gets float64 scores (B, H, Q, KV) and returns modified scores.
def exp_noop(B, H, Q, KV, p, t):
    return None, None


def exp_causal(B, H, Q, KV, p, t):
    return _causal(Q, KV), None


def exp_sliding_window(B, H, Q, KV, p, t):
    qi, ki = _grid(Q, KV)
    return (ki <= qi) & (ki > qi - p["window"]), None


def exp_prefix_lm(B, H, Q, KV, p, t):
    qi, ki = _grid(Q, KV)
    return ~((ki >= p["prefix_length"]) & (ki > qi)), None


def exp_document(B, H, Q, KV, p, t):
    doc = t["document_id"].long()
    assert doc[0] == 0 and bool((doc.diff() >= 0).all()) and bool((doc.diff() <= 1).all())
    assert doc.unique().numel() == min(p["num_documents"], KV)
    return (doc[:, None] == doc[None, :]) & _causal(Q, KV), None


def exp_alibi(B, H, Q, KV, p, t):
    qi, ki = _grid(Q, KV)
    slopes = torch.tensor([2.0 ** (-8.0 * (head + 1) / H) for head in range(H)], dtype=torch.float64)
    bias = -slopes[:, None, None] * (qi - ki).abs().double()
    return None, lambda s: s + bias


def exp_softcap(B, H, Q, KV, p, t):
    return None, lambda s: p["cap"] * torch.tanh(s / p["cap"])


def _t5_bucket(rel, num_buckets, max_distance):
    """T5's bucketing of one relative position (memory - query), bidirectional, written as scalar code."""
    half = num_buckets // 2
    out = half if rel > 0 else 0
    n = abs(rel)
    exact = half // 2
    if n < exact:
        return out + n
    large = exact + int(math.log(n / exact) / math.log(max_distance / exact) * (half - exact))
    return out + min(large, half - 1)


def exp_t5_relative_bias(B, H, Q, KV, p, t):
    expected = [_t5_bucket(r, p["num_buckets"], p["max_distance"]) for r in range(-(Q - 1), KV)]
    assert t["bucket_of_offset"].tolist() == expected
    qi, ki = _grid(Q, KV)
    bucket = torch.tensor(expected)[ki - qi + Q - 1]
    bias = t["bias"].double()[:, bucket]  # (H, Q, KV)
    return None, lambda s: s + bias


def exp_padded_causal(B, H, Q, KV, p, t):
    lengths = t["valid_length"].long()
    assert lengths[0] <= KV and lengths[-1] == max(1, KV - round(p["pad_fraction"] * KV))
    qi, ki = _grid(Q, KV)
    real = torch.stack([(qi < n) & (ki < n) for n in lengths.tolist()])[:, None]
    return real & _causal(Q, KV), None


def exp_dilated_sliding_window(B, H, Q, KV, p, t):
    qi, ki = _grid(Q, KV)
    keep = torch.zeros(Q, KV, dtype=torch.bool)
    for step in range(p["window"]):  # one diagonal per key the window reaches
        keep |= qi - ki == step * p["dilation"]
    return keep, None


def exp_shared_prefix(B, H, Q, KV, p, t):
    seg = t["segment_id"].long()
    prefix = min(p["prefix_length"], KV)
    assert bool((seg[:prefix] == 0).all()) and bool((seg[prefix:] >= 1).all())
    assert bool((seg.diff() >= 0).all()) and int(seg.max()) <= p["num_completions"]
    sees_prompt = (seg[None, :] == 0)
    same = seg[:, None] == seg[None, :]
    return _causal(Q, KV) & (sees_prompt | same), None


def exp_longformer(B, H, Q, KV, p, t):
    qi, ki = _grid(Q, KV)
    g = p["num_global"]
    return ((qi - ki).abs() <= p["window"]) | (qi < g) | (ki < g), None


def exp_bigbird(B, H, Q, KV, p, t):
    bs, g = p["block_size"], p["num_global_blocks"]
    table = t["random_blocks"]
    nq, nk = -(-Q // bs), -(-KV // bs)
    assert table.shape == (nq, nk) and bool((table.sum(1) == min(p["num_random"], nk)).all())
    block_keep = table.clone()
    for i in range(nq):
        for j in range(nk):
            if abs(i - j) <= 1 or i < g or j < g:
                block_keep[i, j] = True
    return block_keep.repeat_interleave(bs, 0)[:Q].repeat_interleave(bs, 1)[:, :KV], None


def exp_attention_sinks(B, H, Q, KV, p, t):
    qi, ki = _grid(Q, KV)
    return (ki <= qi) & ((ki < p["num_sinks"]) | (qi - ki < p["window"])), None


def exp_chunked_causal(B, H, Q, KV, p, t):
    qi, ki = _grid(Q, KV)
    c = p["chunk_size"]
    chunk_start = qi - qi % c
    return (ki <= qi) & (ki >= chunk_start), None


def exp_block_diffusion(B, H, Q, KV, p, t):
    n, bs = KV // 2, p["block_size"]
    pos = torch.arange(KV)
    clean = pos >= n
    block = torch.where(clean, pos - n, pos) // bs
    keep = torch.zeros(Q, KV, dtype=torch.bool)
    for q in range(Q):
        if clean[q]:
            keep[q] = clean & (block <= block[q])
        else:
            keep[q] = (~clean & (block == block[q])) | (clean & (block < block[q]))
    return keep, None


def exp_flamingo_cross(B, H, Q, KV, p, t):
    n = max(1, min(p["num_images"], KV))
    starts = [round((i + 0.25) * Q / n) for i in range(n)]
    latest = []
    for text_pos in range(Q):
        before = [i for i, s in enumerate(starts) if s <= text_pos]
        latest.append(before[-1] if before else -1)
    assert t["image_of_text"].tolist() == latest
    image_of_key = [k * n // KV for k in range(KV)]
    assert t["image_of_key"].tolist() == image_of_key
    keep = torch.tensor(latest)[:, None] == torch.tensor(image_of_key)[None, :]
    assert not bool(keep.any(1).all()), "text before the first image must be a fully masked row"
    return keep, None


def exp_tree_attention(B, H, Q, KV, p, t):
    ctx, k = KV - Q, p["branching"]
    anc = torch.eye(Q, dtype=torch.bool)
    node = torch.arange(Q)
    for _ in range(Q):  # climb one level per round; the root is its own parent
        node = torch.where(node > 0, (node - 1) // k, torch.zeros_like(node))
        anc[torch.arange(Q), node] = True
    assert torch.equal(t["ancestor"], anc)
    keep = torch.ones(Q, KV, dtype=torch.bool)
    keep[:, ctx:] = anc
    return keep, None


def exp_natten_2d(B, H, Q, KV, p, t):
    width, kernel = p["width"], p["kernel"]
    height = -(-KV // width)
    (qr, qc), (kr, kc) = _pixel(torch.arange(Q), width), _pixel(torch.arange(KV), width)
    r0, c0 = _natten_window_start(qr, height, kernel), _natten_window_start(qc, width, kernel)
    in_rows = (kr[None, :] >= r0[:, None]) & (kr[None, :] < r0[:, None] + kernel)
    in_cols = (kc[None, :] >= c0[:, None]) & (kc[None, :] < c0[:, None] + kernel)
    return in_rows & in_cols, None


def exp_natten_2d_dilated(B, H, Q, KV, p, t):
    width, kernel, dil = p["width"], p["kernel"], p["dilation"]
    height = -(-KV // width)
    keep = torch.zeros(Q, KV, dtype=torch.bool)
    kr, kc = _pixel(torch.arange(KV), width)
    for q in range(Q):
        r, c = q // width, q % width
        sub_rows = len(range(r % dil, height, dil))
        sub_cols = len(range(c % dil, width, dil))
        r0 = int(_natten_window_start(torch.tensor(r // dil), sub_rows, kernel))
        c0 = int(_natten_window_start(torch.tensor(c // dil), sub_cols, kernel))
        keep[q] = ((kr % dil == r % dil) & (kc % dil == c % dil) & (kr // dil >= r0) & (kr // dil < r0 + kernel)
                   & (kc // dil >= c0) & (kc // dil < c0 + kernel))
    return keep, None


def exp_sliding_tile(B, H, Q, KV, p, t):
    tile, per_row, window = p["tile"], p["tiles_per_row"], p["window"]
    tile_of = torch.arange(KV) // (tile * tile)
    tile_rows = -(-KV // (tile * tile * per_row))
    tr, tc = tile_of // per_row, tile_of % per_row
    r0, c0 = _natten_window_start(tr, tile_rows, window), _natten_window_start(tc, per_row, window)
    in_rows = (tr[None, :] >= r0[:Q, None]) & (tr[None, :] < r0[:Q, None] + window)
    in_cols = (tc[None, :] >= c0[:Q, None]) & (tc[None, :] < c0[:Q, None] + window)
    return in_rows & in_cols, None


def exp_learnable_relative_bias(B, H, Q, KV, p, t):
    qi, ki = _grid(Q, KV)
    m = p["max_distance"]
    table = t["bias"].double()
    return None, lambda s: s + table[:, (ki - qi).clamp(-m, m) + m]


def exp_per_head_bias(B, H, Q, KV, p, t):
    table = t["bias"].double()
    return None, lambda s: s + table[:, None, :]


def exp_learnable_alibi(B, H, Q, KV, p, t):
    expected = [2.0 ** (-8.0 * (head + 1) / H) for head in range(H)]
    assert torch.allclose(t["slopes"].double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-6)
    qi, ki = _grid(Q, KV)
    distance = (qi - ki).abs().double()
    return None, lambda s: s - t["slopes"].double()[:, None, None] * distance


def _grid_hops_by_bfs(n: int) -> torch.Tensor:
    """Hop counts between the nodes of the row-by-row square grid graph, by breadth-first search from each node."""
    side = math.ceil(math.sqrt(n))
    neighbours = [[] for _ in range(n)]
    for node in range(n):
        r, c = divmod(node, side)
        for dr, dc in ((0, 1), (1, 0), (0, -1), (-1, 0)):
            other = (r + dr) * side + (c + dc)
            if 0 <= r + dr and 0 <= c + dc < side and other < n:
                neighbours[node].append(other)
    hops = torch.full((n, n), -1, dtype=torch.long)
    for start in range(n):
        hops[start, start] = 0
        frontier = [start]
        while frontier:
            nxt = []
            for node in frontier:
                for other in neighbours[node]:
                    if hops[start, other] < 0:
                        hops[start, other] = hops[start, node] + 1
                        nxt.append(other)
            frontier = nxt
    return hops


def exp_graphormer_spatial_bias(B, H, Q, KV, p, t):
    hops = _grid_hops_by_bfs(Q)
    assert (hops >= 0).all()  # the grid is connected, its ragged last row included
    clipped = hops.clamp(max=p["max_distance"])
    assert torch.equal(t["distance"].long(), clipped)
    bias = t["bias"].double()[:, clipped]  # (H, Q, KV)
    return None, lambda s: s + bias


def exp_sandwich(B, H, Q, KV, p, t):
    dim = p["dim"]
    qi, ki = _grid(Q, KV)
    dist = (qi - ki).abs().double()
    bias = torch.zeros(H, Q, KV, dtype=torch.float64)
    for head in range(H):
        compress = 8.0 * (head + 1) / H
        for i in range(1, dim // 2 + 1):
            bias[head] += torch.cos(dist / compress / 10000.0 ** (2.0 * i / dim))
    bias -= dim / 2
    return None, lambda s: s + bias


def exp_image_spans(B, H, Q, KV, p, t):
    span = torch.zeros(KV, dtype=torch.long)
    n, size = p["num_images"], p["image_tokens"]
    stride = KV // max(1, n)
    for k in range(n):
        start = k * stride + stride // 4
        span[start:start + size] = k + 1
    assert torch.equal(t["span_id"].long(), span)
    same_image = (span[:, None] == span[None, :]) & (span[:, None] > 0)
    return _causal(Q, KV) | same_image, None


def exp_gemma2_local(B, H, Q, KV, p, t):
    qi, ki = _grid(Q, KV)
    return (ki <= qi) & (qi - ki < p["window"]), lambda s: p["cap"] * torch.tanh(s / p["cap"])


EXPECTED = {name[len("exp_"):]: fn for name, fn in globals().items() if name.startswith("exp_")}


def _cases():
    """Three awkward length pairs per variant (those its rule accepts), rotating through the candidates."""
    cases = []
    for position, (name, v) in enumerate(VARIANTS.items()):
        start = (2 * position) % len(CANDIDATE_LENGTHS)
        rotated = CANDIDATE_LENGTHS[start:] + CANDIDATE_LENGTHS[:start]
        for q, kv in [ql for ql in rotated if v.accepts_lengths(*ql)][:3]:
            cases.append(pytest.param(name, q, kv, id=f"{name}-{q}x{kv}"))
    return cases


def expected_attention(q, k, v, mask, transform):
    """Dense float64 softmax attention; fully masked rows give 0."""
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if transform is not None:
        s = transform(s)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    alive = torch.isfinite(s).any(-1, keepdim=True)
    p = torch.softmax(torch.where(alive, s, torch.zeros_like(s)), -1) * alive
    return p @ v.double(), alive.squeeze(-1)


def _run(name, Q, KV, dtype=torch.float32, requires_grad=False):
    v = VARIANTS[name]
    mods = v.build(B, H, Q, KV)
    q, k, vv = random_qkv(B, H, Q, KV, D, dtype=dtype, requires_grad=requires_grad)
    return v, mods, (q, k, vv)


def test_every_variant_has_an_independent_expectation():
    assert sorted(EXPECTED) == sorted(VARIANTS)


def test_gallery_size_and_coverage():
    assert len(VARIANTS) >= 24
    kinds = {v.kind for v in VARIANTS.values()}
    assert kinds == {"mask", "score", "both"}
    assert any(not v.accepts_lengths(128, 256) for v in VARIANTS.values())
    assert any(v.example_lengths[0] != v.example_lengths[1] for v in VARIANTS.values())


@pytest.mark.parametrize("name,Q,KV", _cases())
def test_forward_matches_independent_float64(name, Q, KV, monkeypatch):
    # torch's eager flex_attention would send every new closure through dynamo (about a second each); its
    # debug switch runs the same dense math directly.
    monkeypatch.setattr(flex_module, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
    v, mods, (q, k, vv) = _run(name, Q, KV)
    mask, transform = EXPECTED[name](B, H, Q, KV, v.defaults(), mods.tensors)
    expected, alive = expected_attention(q, k, vv, mask, transform)

    block_mask = flexlab.create_block_mask(mods.mask_mod, B, H, Q, KV) if mods.mask_mod else None
    out, lse = flexlab.flex_attention(q, k, vv, score_mod=mods.score_mod, block_mask=block_mask,
                                      return_lse=True, backend="reference")
    assert not out.isnan().any()
    assert rel_l2(out, expected) < TOLERANCES[torch.float32], name
    assert torch.equal(torch.isfinite(lse), alive)  # -inf LSE exactly on the fully masked rows

    # torch's own eager flex_attention with torch's own block mask agrees, and so do the two block masks
    torch_mask = torch_create_block_mask(mods.mask_mod, B, H, Q, KV, device="cpu") if mods.mask_mod else None
    if block_mask is not None:
        assert torch.equal(block_states(block_mask), block_states(torch_mask))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that eager flex_attention is unfused; that is the point here
        theirs = torch_flex_attention(q, k, vv, score_mod=mods.score_mod, block_mask=torch_mask)
    assert rel_l2(theirs, expected) < TOLERANCES[torch.float32], name


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_gradients_match_independent_float64(name):
    v = VARIANTS[name]
    Q, KV = next((q, kv) for q, kv in [(67, 67), (66, 66), (40, 90)] if v.accepts_lengths(q, kv))
    mods = v.build(B, H, Q, KV)
    q, k, vv = random_qkv(B, H, Q, KV, D, dtype=torch.float64, requires_grad=True)
    trainable = {n: mods.tensors[n].requires_grad_(True) for n in v.trainable}
    twins = {n: t.detach().double().clone().requires_grad_(True) for n, t in trainable.items()}

    block_mask = flexlab.create_block_mask(mods.mask_mod, B, H, Q, KV) if mods.mask_mod else None
    out = flexlab.flex_attention(q, k, vv, score_mod=mods.score_mod, block_mask=block_mask, backend="reference")
    cotangent = torch.randn_like(out)
    got = torch.autograd.grad(out, [q, k, vv, *trainable.values()], cotangent)

    mask, transform = EXPECTED[name](B, H, Q, KV, v.defaults(), {**mods.tensors, **twins})
    q2, k2, v2 = (t.detach().clone().requires_grad_(True) for t in (q, k, vv))
    expected, _ = expected_attention(q2, k2, v2, mask, transform)
    want = torch.autograd.grad(expected, [q2, k2, v2, *twins.values()], cotangent)
    for label, g, w in zip(["dq", "dk", "dv", *trainable], got, want):
        assert not g.isnan().any(), f"{name}: {label} has NaN"
        assert rel_l2(g, w) < 1e-6, f"{name}: {label} off by {rel_l2(g, w):.2e}"
    for label, g in zip(trainable, got[3:]):
        assert g.abs().sum() > 0, f"{name}: gradient of captured {label} is identically zero"


def _random_params(v, generator):
    """A parameter draw inside every slider's range, on the slider's step grid."""
    params = {}
    for p in v.params:
        steps = int((p.max - p.min) // p.step)
        k = int(torch.randint(0, steps + 1, (1,), generator=generator))
        value = p.min + k * p.step
        params[p.name] = int(value) if p.is_int else float(value)
    return params


@pytest.mark.parametrize("name", sorted(n for n, v in VARIANTS.items() if v.params))
def test_random_parameters_match_independent_rewrite(name):
    """Mods at random slider positions (edges included) against the rewrite, on the mask and score level."""
    from flexlab.mods import evaluate_mask_mod, evaluate_score_mod, index_grid

    v = VARIANTS[name]
    generator = torch.Generator().manual_seed(sum(map(ord, name)))
    Q, KV = next(ql for ql in [(130, 130), (64, 300)] if v.accepts_lengths(*ql))
    draws = [_random_params(v, generator) for _ in range(6)]
    draws += [{p.name: p.min for p in v.params}, {p.name: p.max for p in v.params}]
    for params in draws:
        mods = v.build(B, H, Q, KV, **params)
        mask, transform = EXPECTED[name](B, H, Q, KV, v.resolve_params(**params), mods.tensors)
        grid = index_grid(B, H, Q, KV, "cpu")
        if mods.mask_mod is not None:
            got = evaluate_mask_mod(mods.mask_mod, *grid)
            assert torch.equal(got, mask.expand_as(got)), f"{name} {params}"
        if mods.score_mod is not None:
            scores = 3 * torch.randn(B, H, Q, KV, dtype=torch.float64, generator=generator)
            got = evaluate_score_mod(mods.score_mod, scores, *grid)
            assert torch.allclose(got, transform(scores), rtol=1e-6, atol=1e-6), f"{name} {params}"


@pytest.mark.parametrize("name", sorted(n for n, v in VARIANTS.items() if v.trainable))
def test_gradcheck_learnable_tables(name):
    """Finite differences agree with autograd through flexlab's API for q, k, v and the learnable table."""
    v = VARIANTS[name]
    Q, KV = next((q, kv) for q, kv in [(9, 11), (9, 9)] if v.accepts_lengths(q, kv))
    mods = v.build(1, 2, Q, KV, **{p.name: p.min for p in v.params})  # smallest tables: fewer finite differences
    tables = [mods.tensors[n] for n in v.trainable]
    for table in tables:  # the mods captured these objects: switch them to float64 in place for gradcheck
        table.data = table.data.double()
        table.requires_grad_(True)
    q, k, vv = random_qkv(1, 2, Q, KV, 4, dtype=torch.float64, requires_grad=True)

    def attention(q, k, vv, *captured):  # captured tensors are perturbed in place; the mods read them
        return flexlab.flex_attention(q, k, vv, score_mod=mods.score_mod, backend="reference")

    assert torch.autograd.gradcheck(attention, (q, k, vv, *tables))
