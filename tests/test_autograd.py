"""flexlab's custom ops and their autograd formula.

On CPU the ops run dense math with the backward kernel's algorithm (preprocess D, P from the LSE, dS, the generated
score_mod_bwd and captured-tensor gradients); every gradient is compared with torch autograd through the float64
reference backend, which differentiates the user's own Python mods. torch.compile(fullgraph=True) must trace a model
that calls the ops without graph breaks. GPU tests (marked `gpu`) run the Hopper kernels against the same reference.
"""
from __future__ import annotations

import pytest
import torch

import flexlab
from flexlab import _ops
from flexlab.autograd import differentiable_attention
from flexlab.backends.reference import reference_attention
from flexlab.gallery import load_gallery
from flexlab.testing import random_qkv, rel_l2

TOL_F64 = 1e-5  # the ops keep the LSE in fp32, so float64 inputs agree to ~1e-7, not 1e-12


def _grads(fn, tensors, weights):
    for t in tensors:
        t.grad = None
    outs = fn()
    loss = sum((o.double() * w).sum() for o, w in zip(outs, weights) if w is not None)
    loss.backward()
    return [o.detach() for o in outs], [None if t.grad is None else t.grad.clone() for t in tensors]


def _compare(q, k, v, score_mod=None, block_mask=None, trainable=(), with_lse=False, scale=None):
    gqa = q.shape[1] != k.shape[1]
    leaves = [q, k, v, *trainable]
    weights = None

    def ours():
        out, lse = differentiable_attention(q, k, v, score_mod, block_mask, scale, gqa, return_lse=True)
        return out, lse

    def ref():
        return reference_attention(q, k, v, score_mod, block_mask, scale, gqa, torch.float64)

    with torch.no_grad():
        out0, lse0 = ref()
    weights = [torch.randn_like(out0), torch.randn_like(lse0).masked_fill(~torch.isfinite(lse0), 0.0)
               if with_lse else None]
    (out, lse), g_ours = _grads(ours, leaves, weights)
    (ref_out, ref_lse), g_ref = _grads(ref, leaves, weights)
    assert rel_l2(out, ref_out) < TOL_F64
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert rel_l2(lse[finite], ref_lse[finite]) < TOL_F64, "LSE values"
    names = ["dq", "dk", "dv"] + [f"d(captured {i})" for i in range(len(trainable))]
    for name, a, b in zip(names, g_ours, g_ref):
        assert a is not None, f"{name} missing"
        assert not torch.isnan(a).any(), f"NaN in {name}"
        assert rel_l2(a, b) < TOL_F64, f"{name}: rel-L2 {rel_l2(a, b):.2e}"
    return g_ours


def test_dense_mha_matches_reference():
    q, k, v = random_qkv(2, 3, 70, 90, 16, torch.float64, requires_grad=True)
    _compare(q, k, v)


def test_gqa_causal_block_mask_unequal_lengths():
    q, k, v = random_qkv(1, 4, 100, 130, 16, torch.float64, Hkv=2, requires_grad=True)
    bm = flexlab.create_block_mask(lambda b, h, qi, kv: qi + 30 >= kv, 1, 1, 100, 130, BLOCK_SIZE=32)
    _compare(q, k, v, block_mask=bm, scale=0.3)


def test_lse_output_is_differentiable():
    q, k, v = random_qkv(1, 2, 40, 50, 8, torch.float64, requires_grad=True)
    _compare(q, k, v, with_lse=True)


def test_fully_masked_rows_get_zero_gradient_not_nan():
    q, k, v = random_qkv(1, 2, 64, 64, 8, torch.float64, requires_grad=True)
    bm = flexlab.create_block_mask(lambda b, h, qi, kv: (qi < 40) & (kv <= qi), 1, 1, 64, 64, BLOCK_SIZE=16)
    dq, dk, dv = _compare(q, k, v, block_mask=bm)
    assert (dq[:, :, 40:] == 0).all()


def test_learnable_bias_gradient():
    bias = (0.1 * torch.randn(3, 9, dtype=torch.float64)).requires_grad_(True)

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, torch.clamp(kv_idx - q_idx, -4, 4) + 4]

    q, k, v = random_qkv(2, 3, 50, 60, 8, torch.float64, requires_grad=True)
    grads = _compare(q, k, v, score_mod=rel_bias, trainable=[bias], with_lse=True)
    assert grads[3].abs().sum() > 0


def _lengths(variant):
    for sq, skv in ((96, 96), (128, 128), (64, 96), (96, 64)):
        if variant.accepts_lengths(sq, skv):
            return sq, skv
    pytest.skip(f"{variant.name}: none of the small test lengths fits its rule '{variant.lengths_rule}'")


@pytest.mark.parametrize("name", sorted(load_gallery()))
def test_gallery_variant_gradients(name):
    """Every gallery variant: dQ, dK, dV and gradients of its trainable captured tensors, GQA, block size 32."""
    variant = load_gallery()[name]
    sq, skv = _lengths(variant)
    mods = variant.build(B=1, H=4, Q_LEN=sq, KV_LEN=skv)
    trainable = []
    for t_name in variant.trainable:
        t = mods.tensors[t_name]
        if t.dtype != torch.float64:
            t.data = t.data.double()
        trainable.append(t.requires_grad_(True))
    bm = None
    if mods.mask_mod is not None:
        bm = flexlab.create_block_mask(mods.mask_mod, 1, 4, sq, skv, BLOCK_SIZE=32)
    q, k, v = random_qkv(1, 4, sq, skv, 16, torch.float64, Hkv=2, requires_grad=True)
    _compare(q, k, v, score_mod=mods.score_mod, block_mask=bm, trainable=trainable)


def test_unknown_mods_key_is_a_clear_error():
    with pytest.raises(flexlab.FlexlabError, match="no flexlab mods registered"):
        _ops.mod_entry("not-a-key")


def test_same_mods_reuse_one_registry_entry():
    def causal(b, h, qi, kv):
        return qi >= kv

    assert _ops.register_mods(None, causal) == _ops.register_mods(None, causal)
    assert _ops.register_mods(None, causal) != _ops.register_mods(None, lambda b, h, qi, kv: qi >= kv)


def test_optimizer_steps_do_not_regenerate_but_new_scalars_do():
    bias = torch.randn(2, 9, requires_grad=True)
    window = 3

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, torch.clamp(kv_idx - q_idx, -window, window) + 4]

    key = _ops.register_mods(rel_bias, None)
    generated = _ops.mod_entry(key).generated
    with torch.no_grad():
        bias.add_(1.0)  # what an optimizer step does
    assert _ops.mod_entry(_ops.register_mods(rel_bias, None)).generated is generated
    window = 4  # noqa: F841  (read by rel_bias through its closure)
    entry = _ops.mod_entry(_ops.register_mods(rel_bias, None))
    assert entry.generated is not generated and 4.0 in entry.aux_scalars


def test_rebuilt_block_mask_is_reused_for_the_same_tensors():
    bm = flexlab.create_block_mask(lambda b, h, qi, kv: qi >= kv, 1, 1, 256, 256, BLOCK_SIZE=128)
    tensors = [bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices]
    first = _ops.rebuild_block_mask(tensors, [128, 128], bm.mask_mod, 256, 256)
    assert _ops.rebuild_block_mask(tensors, [128, 128], bm.mask_mod, 256, 256) is first
    tensors[0].add_(0)  # an in-place edit bumps the version: the mask must be rebuilt
    assert _ops.rebuild_block_mask(tensors, [128, 128], bm.mask_mod, 256, 256) is not first
    assert _ops.rebuild_block_mask([], [], None, 256, 256) is None


def test_backward_support_is_decided_without_a_gpu():
    from flexlab.autograd import backward_unsupported_reason
    q = torch.empty(1, 2, 256, 128, dtype=torch.bfloat16)
    assert backward_unsupported_reason(q, None) is None
    assert "head dims" in backward_unsupported_reason(torch.empty(1, 2, 256, 96, dtype=torch.bfloat16), None)
    assert "bfloat16" in backward_unsupported_reason(q.float(), None)
    bm = flexlab.create_block_mask(lambda b, h, qi, kv: qi >= kv, 1, 1, 256, 256, BLOCK_SIZE=128)
    assert backward_unsupported_reason(q, bm) is None
    small = flexlab.create_block_mask(lambda b, h, qi, kv: qi >= kv, 1, 1, 256, 256, BLOCK_SIZE=32)
    assert "BLOCK_SIZE" in backward_unsupported_reason(q, small)


def test_opcheck_forward_and_backward_ops():
    """Schema, fake implementation and autograd registration agree with the real implementation."""
    bias = torch.randn(2, 7).requires_grad_(True)

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, torch.clamp(kv_idx - q_idx, -3, 3) + 3]

    key = _ops.register_mods(rel_bias, None)
    entry = _ops.mod_entry(key)
    q, k, v = random_qkv(1, 2, 24, 40, 8, torch.float32, requires_grad=True)
    args = (q, k, v, entry.aux_tensors, [], [], 0.3, key, entry.aux_scalars, False)
    torch.library.opcheck(_ops.flex_attention_fwd, args)
    out, lse = _ops.flex_attention_fwd(*args)
    bwd_args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), None,
                entry.aux_tensors, [], [], 0.3, key, entry.aux_scalars, False)
    torch.library.opcheck(_ops.flex_attention_bwd, bwd_args, test_utils=("test_schema", "test_faketensor"))


def test_eager_path_matches_the_custom_op_formula_and_skips_the_op(monkeypatch):
    """Eager mode runs `EagerAttention` (no custom-op dispatch); its output and every gradient -- Q, K, V, a learnable
    captured table, and a gradient into the LSE -- are bitwise those of the registered custom-op formula."""
    bias = torch.randn(2, 9, dtype=torch.float64).requires_grad_(True)

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, torch.clamp(kv_idx - q_idx, -4, 4) + 4]

    bm = flexlab.create_block_mask(lambda b, h, qi, kv: qi >= kv, 1, 1, 48, 48, device="cpu", BLOCK_SIZE=16)
    q, k, v = random_qkv(2, 2, 48, 48, 16, torch.float64, requires_grad=True)
    dout, dlse = torch.randn(2, 2, 48, 16, dtype=torch.float64), torch.randn(2, 2, 48, dtype=torch.float64)
    key = _ops.register_mods(rel_bias, bm.mask_mod)
    entry = _ops.mod_entry(key)
    masks, sizes = [bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices, bm.q_num_blocks,
                    bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices], [16, 16]

    def run(fn):
        for t in (q, k, v, bias):
            t.grad = None
        out, lse = fn()
        (out * dout).sum().add((lse.masked_fill(~torch.isfinite(lse), 0) * dlse).sum()).backward()
        return [out.detach(), lse.detach(), q.grad, k.grad, v.grad, bias.grad]

    via_op = run(lambda: _ops.flex_attention_fwd(q, k, v, entry.aux_tensors, masks, sizes, 0.25, key,
                                                 entry.aux_scalars, False))
    calls = []
    for name in ("flex_attention_fwd", "flex_attention_bwd"):
        monkeypatch.setattr(_ops, name, lambda *a, _n=name, **kw: calls.append(_n))
    eager = run(lambda: differentiable_attention(q, k, v, rel_bias, bm, 0.25, return_lse=True))
    assert calls == []
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv", "dbias"], eager, via_op):
        assert a is not None and torch.equal(a, b), name


class _TinyBlock(torch.nn.Module):
    def __init__(self, heads: int, dim: int, score_mod):
        super().__init__()
        self.heads, self.dim, self.score_mod = heads, dim, score_mod
        self.qkv = torch.nn.Linear(heads * dim, 3 * heads * dim)

    def forward(self, x, block_mask):
        B, S, _ = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, self.dim).permute(2, 0, 3, 1, 4)
        return differentiable_attention(q, k, v, self.score_mod, block_mask).sum()


def test_torch_compile_fullgraph_no_graph_break():
    from torch._dynamo.testing import CompileCounterWithBackend

    bias = (0.1 * torch.randn(2, 17)).requires_grad_(True)

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, torch.clamp(kv_idx - q_idx, -8, 8) + 8]

    torch._dynamo.reset()
    model = _TinyBlock(2, 8, rel_bias)
    bm = flexlab.create_block_mask(lambda b, h, qi, kv: qi >= kv, 1, 1, 48, 48, BLOCK_SIZE=16)
    x = torch.randn(2, 48, 16)
    counter = CompileCounterWithBackend("aot_eager")  # AOTAutograd with fake tensors; no C++ compiler needed
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    loss = compiled(x, bm)
    loss.backward()
    compiled_grads = [bias.grad.clone(), model.qkv.weight.grad.clone()]
    assert counter.frame_count == 1
    graph_ops = [str(n.target) for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert any("flex_attention_fwd" in op for op in graph_ops), graph_ops

    bias.grad = None
    model.zero_grad()
    eager = model(x, bm)
    eager.backward()
    assert torch.allclose(loss, eager, rtol=1e-5, atol=1e-5)
    assert rel_l2(compiled_grads[0], bias.grad) < 1e-5
    assert rel_l2(compiled_grads[1], model.qkv.weight.grad) < 1e-5
    compiled(x, bm)
    assert counter.frame_count == 1, "a second call must not recompile"


# ----------------------------------------------------------------------------------------------------- GPU (H200)
def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm90 GPU (H100/H200)")
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("Hkv", [4, 2])
def test_cuda_ops_gradients_match_float64_reference(D, Hkv):
    from flexlab.testing import reference
    bias = (0.1 * torch.randn(4, 65, device="cuda")).requires_grad_(True)

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, torch.clamp(kv_idx - q_idx, -32, 32) + 32]

    S = 1000
    bm = flexlab.create_block_mask(lambda b, h, qi, kv: qi >= kv, 1, 1, S, S, device="cuda")
    q, k, v = random_qkv(2, 4, S, S, D, torch.bfloat16, "cuda", Hkv=Hkv, requires_grad=True)
    out = differentiable_attention(q, k, v, rel_bias, bm, enable_gqa=Hkv != 4)
    dout = torch.randn_like(out)
    out.backward(dout)
    ours = [t.grad.clone() for t in (q, k, v, bias)]
    for t in (q, k, v, bias):
        t.grad = None
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref_out, _ = reference(q64, k64, v64, rel_bias, bm, None, Hkv != 4)
    ref_out.backward(dout.double())
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), ours, (q64.grad, k64.grad, v64.grad, bias.grad)):
        assert not torch.isnan(a).any(), name
        assert rel_l2(a, b) < 2e-2, f"{name}: {rel_l2(a, b):.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm90 GPU (H100/H200)")
def test_cuda_deterministic_mode_is_bitwise_repeatable():
    S = 1000
    bm = flexlab.create_block_mask(lambda b, h, qi, kv: (qi >= kv) & (qi - kv < 300), 1, 1, S, S, device="cuda")
    q, k, v = random_qkv(2, 4, S, S, 128, torch.bfloat16, "cuda", Hkv=2, requires_grad=True)
    dout = torch.randn(2, 4, S, 128, device="cuda", dtype=torch.bfloat16)
    runs = []
    for _ in range(5):
        for t in (q, k, v):
            t.grad = None
        differentiable_attention(q, k, v, None, bm, enable_gqa=True, deterministic=True).backward(dout)
        runs.append([t.grad.clone() for t in (q, k, v)])
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))  # ... and right, not only repeated
    reference_attention(q64, k64, v64, None, bm, None, True, torch.float64)[0].backward(dout.double())
    for name, a, b in zip(("dq", "dk", "dv"), runs[0], (q64.grad, k64.grad, v64.grad)):
        assert not torch.isnan(a).any() and rel_l2(a, b) < 2e-2, f"{name}: {rel_l2(a, b):.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm90 GPU (H100/H200)")
def test_cuda_table_only_gradient_through_flex_attention():
    """A learnable bias table that requires grad while q, k, v do not: the cute backend must still run the
    backward kernels and give the table its gradient (only the table is a leaf here)."""
    from flexlab.testing import reference
    S, D = 1000, 128
    table = (0.1 * torch.randn(4, 65, device="cuda")).requires_grad_(True)

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, torch.clamp(kv_idx - q_idx, -32, 32) + 32]

    q, k, v = random_qkv(2, 4, S, S, D, torch.bfloat16, "cuda")
    out = flexlab.flex_attention(q, k, v, rel_bias, backend="cute")
    dout = torch.randn_like(out)
    out.backward(dout)
    assert table.grad is not None, "the table got no gradient"
    ours = table.grad.clone()
    table.grad = None
    ref_out, _ = reference(q.double(), k.double(), v.double(), rel_bias, None, None, False)
    ref_out.backward(dout.double())
    assert not torch.isnan(ours).any()
    assert rel_l2(ours, table.grad) < 2e-2, f"dtable: {rel_l2(ours, table.grad):.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm90 GPU (H100/H200)")
def test_cuda_warm_training_steps_match_the_full_path():
    """A training loop through flexlab.flex_attention: a learnable relative bias (edited in place by an optimizer
    step) and a document mask (stored bits). Steps after the first take the warm path (bound forward, planned
    backward); in deterministic mode each gives bitwise the gradients of a full-path step on the same values, and
    they match the float64 reference."""
    import flexlab.api as api
    from flexlab.testing import reference
    S, D = 1000, 128
    table = (0.1 * torch.randn(4, 65, device="cuda")).requires_grad_(True)
    doc = (torch.arange(S, device="cuda") * 3 // S)

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, torch.clamp(kv_idx - q_idx, -32, 32) + 32]

    def documents(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    bm = flexlab.create_block_mask(documents, 1, 1, S, S, device="cuda")
    q, k, v = random_qkv(2, 4, S, S, D, torch.bfloat16, "cuda", requires_grad=True)
    dout = torch.randn(2, 4, S, D, device="cuda", dtype=torch.bfloat16)
    leaves = (q, k, v, table)

    def step():
        for t in leaves:
            t.grad = None
        out = flexlab.flex_attention(q, k, v, rel_bias, bm, backend="cute", deterministic=True)
        out.backward(dout)
        return out.detach().clone(), [t.grad.clone() for t in leaves]

    api._WARM_TRAIN.clear()
    tables, steps = [], []
    for _ in range(3):
        tables.append(table.detach().clone())
        steps.append(step())
        with torch.no_grad():
            table -= 0.5 * table.grad
    assert len(api._WARM_TRAIN) == 1
    with torch.no_grad():
        table.copy_(tables[2])
    api._WARM_TRAIN.clear()
    full = step()  # the full path on the third step's values
    assert torch.equal(full[0], steps[2][0])
    for a, b in zip(full[1], steps[2][1]):
        assert torch.equal(a, b)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    table.grad = None
    ref_out, _ = reference(q64, k64, v64, rel_bias, bm, None, False)
    ref_out.backward(dout.double())
    for name, a, b in zip(("dq", "dk", "dv", "dtable"), steps[2][1], (q64.grad, k64.grad, v64.grad, table.grad)):
        assert not torch.isnan(a).any(), name
        assert rel_l2(a, b) < 2e-2, f"{name}: {rel_l2(a, b):.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm90 GPU (H100/H200)")
@pytest.mark.parametrize("case", ["dense-long", "bias-causal"])
def test_cuda_graph_replays_a_training_step(case):
    """A forward + backward captured in a CUDA graph (what torch.compile's reduce-overhead mode does) and replayed on
    new inputs gives the eager call's output and gradients. dense-long (B1 H16 S16k D=128) runs the forward's split
    tail and the backward's cut last wave on 132 SMs (arrival counters, partial buffers, the parts' kernel launched
    behind the whole tiles'); bias-causal a block mask and a learnable table's gradient."""
    table = (0.1 * torch.randn(4, 65, device="cuda")).requires_grad_(True)

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, torch.clamp(kv_idx - q_idx, -32, 32) + 32]

    if case == "dense-long":
        shape, score_mod, bm, leaves_extra = (1, 16, 16384, 128), None, None, ()
    else:
        shape, score_mod, leaves_extra = (2, 4, 1000, 128), rel_bias, (table,)
        bm = flexlab.create_block_mask(lambda b, h, qi, kv: qi >= kv, 1, 1, 1000, 1000, device="cuda")
    B, H, S, D = shape
    q, k, v = random_qkv(B, H, S, S, D, torch.bfloat16, "cuda", requires_grad=True)
    dout = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    leaves = (q, k, v, *leaves_extra)

    def step():
        return flexlab.flex_attention(q, k, v, score_mod, bm, backend="cute")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and plan outside the capture
        for _ in range(2):
            step().backward(dout)
    torch.cuda.current_stream().wait_stream(side)
    for t in leaves:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
        out.backward(dout)
    for _ in range(2):  # new values in place, then replay
        with torch.no_grad():
            for t in leaves:
                t.copy_(torch.randn_like(t) * (0.1 if t is table else 1.0))
            dout.copy_(torch.randn_like(dout))
        graph.replay()
        torch.cuda.synchronize()
        replayed = [out.detach().clone()] + [t.grad.clone() for t in leaves]
        fresh = [t.detach().clone().requires_grad_(True) for t in leaves[:3]]
        eager_out = flexlab.flex_attention(*fresh, score_mod, bm, backend="cute")
        eager = [eager_out.detach()] + list(torch.autograd.grad(eager_out, [*fresh, *leaves_extra], dout))
        for name, a, b in zip(("out", "dq", "dk", "dv", "dtable"), replayed, eager):
            assert not torch.isnan(a).any(), name
            assert rel_l2(a, b) < 1e-3, f"{name}: replayed against eager rel-L2 {rel_l2(a, b):.2e}"


def test_torch_compile_fullgraph_through_flex_attention(monkeypatch):
    """`flexlab.flex_attention` itself (argument checks, backend choice, mod lowering) traces into one graph: the
    choice is folded to a constant at trace time and the kernels stay one opaque custom op. The device check is
    told a CPU is fine, so the custom ops run their CPU formulas; everything Dynamo sees is as on a GPU."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from flexlab.backends import cute
    monkeypatch.setattr(cute, "_device_reason", lambda device: "")
    bias = (0.1 * torch.randn(2, 17)).requires_grad_(True)

    def rel_bias(score, b, h, q_idx, kv_idx):  # reads the module `torch` from its globals, as user mods do
        return score + bias[h, torch.clamp(kv_idx - q_idx, -8, 8) + 8]

    bm = flexlab.create_block_mask(lambda b, h, qi, kv: qi >= kv, 1, 1, 160, 160)
    q, k, v = (torch.randn(2, 2, 160, 64, dtype=torch.bfloat16).requires_grad_(True) for _ in range(3))

    def loss_fn(q, k, v):
        return flexlab.flex_attention(q, k, v, rel_bias, bm, backend="cute").float().square().mean()

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    loss = torch.compile(loss_fn, backend=counter, fullgraph=True)(q, k, v)
    loss.backward()
    got = [t.grad.clone() for t in (q, k, v, bias)]
    assert counter.frame_count == 1
    graph_ops = [str(n.target) for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert any("flex_attention_fwd" in op for op in graph_ops), graph_ops
    for t in (q, k, v, bias):
        t.grad = None
    eager = loss_fn(q, k, v)
    eager.backward()
    assert torch.allclose(loss, eager)
    for a, t in zip(got, (q, k, v, bias)):
        assert rel_l2(a.float(), t.grad.float()) < 1e-3


@pytest.mark.parametrize("session_flag", [True, False], ids=["is_compiling-held", "is_compiling-traced-only"])
def test_mods_made_afresh_every_step_do_not_pile_up(monkeypatch, session_flag):
    """A model that defines its score_mod inside forward registers a new pair at every step: the registry keeps the
    newest eager entries only, a backward still finds the entry of a forward whose key was dropped meanwhile, and a
    key that a torch.compile graph holds is never dropped. Some torch versions report `is_compiling()` True only in
    traced code, not in the constant function Dynamo runs eagerly (`session_flag=False` makes this one do so)."""
    import contextlib
    from torch._dynamo.testing import CompileCounterWithBackend
    monkeypatch.setattr(_ops, "EAGER_ENTRIES_KEPT", 3)
    if not session_flag:
        monkeypatch.setattr(torch.compiler, "_compile_session_context", contextlib.nullcontext, raising=False)

    def causal_step(q, k, v):
        def shift(score, b, h, q_idx, kv_idx):
            return score + 0.01 * (q_idx - kv_idx)
        return differentiable_attention(q, k, v, shift).sum()

    torch._dynamo.reset()
    compiled = torch.compile(causal_step, backend=CompileCounterWithBackend("aot_eager"), fullgraph=True)
    q, k, v = random_qkv(1, 2, 32, 32, 16, torch.float32, requires_grad=True)
    before = set(_ops._PINNED)
    expected = compiled(q, k, v)
    pinned = set(_ops._PINNED) - before
    assert len(pinned) == 1, "the key the compiled graph holds is pinned"

    losses = []
    for i in range(8):
        def score_mod(score, b, h, q_idx, kv_idx):
            return score * (1.0 + 0.01 * i)
        losses.append(differentiable_attention(q, k, v, score_mod).sum())
    assert len([key for key in _ops._ENTRIES if key not in _ops._PINNED]) <= 3
    sum(losses).backward()  # the first steps' entries were dropped from the registry, not from their graphs
    assert torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0
    assert pinned <= set(_ops._ENTRIES)
    assert torch.equal(compiled(q, k, v), expected)


def test_block_mask_edited_in_place_before_the_backward_is_an_error():
    """The eager path saves the block-mask tensors for the backward: editing them in between must not silently
    change the lists the backward walks."""
    from flexlab import create_block_mask

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    q, k, v = (torch.randn(1, 2, 256, 64, requires_grad=True) for _ in range(3))
    bm = create_block_mask(causal, None, None, 256, 256, device="cpu")
    out = differentiable_attention(q, k, v, None, bm)
    bm.kv_num_blocks.add_(0)  # bumps the version counter
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
