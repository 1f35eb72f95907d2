"""torch's newer flex_attention arguments, `return_aux` and `kernel_options`, in flexlab's calls (CPU)."""
from __future__ import annotations

import inspect
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

import flexlab
from flexlab import api
from flexlab.testing import TOLERANCES, random_qkv, reference, rel_l2

NEG_INF = float("-inf")


def _truth_max_scores(q, k, score_mod, keep, scale=None):
    """Each row's largest score after score_mod and masking, in float64 from scratch (GQA: k already repeated)."""
    q, k = q.double(), k.double()
    B, H, Sq, D = q.shape
    s = (q @ k.transpose(-1, -2)) * (D ** -0.5 if scale is None else scale)
    if score_mod is not None:
        b, h, qi, ki = (torch.arange(n).view([-1 if d == i else 1 for d in range(4)])
                        for i, n in enumerate((B, H, Sq, k.shape[2])))
        s = score_mod(s, b, h, qi, ki)
    if keep is not None:
        s = s.masked_fill(~keep, NEG_INF)
    return s.amax(dim=-1)


def test_signature_takes_every_torch_argument_in_torchs_order():
    """Code written against torch's flex_attention runs unchanged: the same names, kinds and positions."""
    ours = inspect.signature(flexlab.flex_attention).parameters
    theirs = inspect.signature(torch_flex.flex_attention).parameters
    for name, p in theirs.items():
        assert name in ours, f"torch's argument {name} is missing"
        assert ours[name].kind == p.kind, name
        assert ours[name].default == p.default, name
    positional = [n for n, p in theirs.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert [n for n, p in ours.items() if p.kind == p.POSITIONAL_OR_KEYWORD] == positional
    assert flexlab.AuxRequest is torch_flex.AuxRequest and flexlab.AuxOutput is torch_flex.AuxOutput


@pytest.mark.parametrize("backend", ["reference", "auto"])
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_return_aux_lse_and_max_scores_match_a_float64_truth(backend, gqa):
    """Fresh random inputs, a score_mod, a mask with fully masked rows, lengths off the block grid."""
    B, Hq, Hkv, Sq, Skv, D = 2, 4, 2 if gqa else 4, 150, 200, 32

    def drift(score, b, h, q_idx, kv_idx):
        return score + 0.05 * (q_idx - kv_idx) / (1 + h)

    def causal_with_dead_rows(b, h, q_idx, kv_idx):
        return (q_idx + 50 >= kv_idx) & (q_idx % 7 != 3)

    q, k, v = random_qkv(B, Hq, Sq, Skv, D, torch.float32, Hkv=Hkv)
    bm = flexlab.create_block_mask(causal_with_dead_rows, None, None, Sq, Skv)
    out, aux = flexlab.flex_attention(q, k, v, drift, bm, enable_gqa=gqa, backend=backend,
                                      return_aux=flexlab.AuxRequest(lse=True, max_scores=True))
    assert isinstance(aux, flexlab.AuxOutput)
    truth, truth_lse = reference(q, k, v, drift, bm, enable_gqa=gqa)
    qi, ki = torch.arange(Sq)[:, None], torch.arange(Skv)[None, :]
    keep = causal_with_dead_rows(None, None, qi, ki)
    truth_max = _truth_max_scores(q, k.repeat_interleave(Hq // Hkv, dim=1), drift, keep)
    assert aux.lse.shape == aux.max_scores.shape == (B, Hq, Sq)
    assert aux.max_scores.dtype == torch.float32 and not aux.max_scores.requires_grad
    assert rel_l2(out, truth) < TOLERANCES[torch.float32]
    dead = (torch.arange(Sq) % 7 == 3).expand(B, Hq, Sq)
    assert torch.equal(torch.isinf(aux.max_scores), dead) and (aux.max_scores[dead] == NEG_INF).all()
    assert torch.equal(torch.isinf(aux.lse), dead)
    assert (out[dead.unsqueeze(-1).expand_as(out)] == 0).all()
    assert torch.allclose(aux.max_scores[~dead].double(), truth_max[~dead], atol=1e-5, rtol=1e-5)
    assert torch.allclose(aux.lse[~dead].double(), truth_lse[~dead], atol=1e-5, rtol=1e-5)
    # the largest score lies below the log-sum-exp of its row, by at most log(keys kept)
    gap = (aux.lse - aux.max_scores)[~dead]
    assert (gap >= 0).all() and (gap <= torch.log(torch.tensor(float(Skv)))).all()


def test_return_aux_fields_not_asked_for_are_none_and_match_torch(monkeypatch):
    q, k, v = random_qkv(1, 2, 64, 80, 16)
    out, aux = flexlab.flex_attention(q, k, v, return_aux=flexlab.AuxRequest(lse=True), backend="torch")
    monkeypatch.setattr(torch_flex, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)  # torch's eager path, as is
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t_out, t_aux = torch_flex.flex_attention(q, k, v, return_aux=torch_flex.AuxRequest(lse=True))
    assert aux.max_scores is None and torch.allclose(aux.lse, t_aux.lse) and torch.allclose(out, t_out)
    out, aux = flexlab.flex_attention(q, k, v, return_aux=flexlab.AuxRequest(), backend="reference")
    assert aux == flexlab.AuxOutput(None, None) and isinstance(out, torch.Tensor)


def test_lse_from_return_aux_carries_the_same_gradients_as_return_lse():
    q, k, v = random_qkv(1, 2, 48, 48, 16, torch.float64, requires_grad=True)
    w = torch.randn(1, 2, 48, dtype=torch.float64)

    def loss(**how):
        out, second = flexlab.flex_attention(q, k, v, backend="reference", **how)
        lse = second.lse if "return_aux" in how else second
        return torch.autograd.grad(out.square().sum() + (w * lse).sum(), (q, k, v))

    for a, b in zip(loss(return_aux=flexlab.AuxRequest(lse=True, max_scores=True)), loss(return_lse=True)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("call, error, match", [
    (dict(return_lse=True, return_aux=flexlab.AuxRequest(lse=True)), flexlab.FlexlabError, "not both"),
    (dict(return_aux=(True, False)), TypeError, "return_aux must be .*AuxRequest.*got tuple"),
    (dict(return_aux=flexlab.AuxRequest(lse=1)), TypeError, "return_aux.lse must be True or False"),
    (dict(return_lse=1, return_aux=flexlab.AuxRequest()), TypeError, "return_lse must be True or False"),
    (dict(kernel_options=[("BLOCK_M", 64)]), TypeError, "kernel_options must be a dict"),
    (dict(kernel_options={64: "BLOCK_M"}), TypeError, "kernel_options keys must be strings"),
    (dict(kernel_options={"OUTPUT_LOGSUMEXP": True}), ValueError, "OUTPUT_LOGSUMEXP.*return_aux"),
    (dict(kernel_options={"OUTPUT_MAX": True}), ValueError, "OUTPUT_MAX.*return_aux"),
    (dict(backend="torch", return_aux=flexlab.AuxRequest(max_scores=True)), flexlab.BackendUnavailableError,
     "backend='torch' on CPU cannot return max_scores"),
])
def test_bad_options_are_named(call, error, match):
    q, k, v = random_qkv(1, 1, 16, 16, 16)
    with pytest.raises(error, match=match):
        flexlab.flex_attention(q, k, v, **call)


def test_kernel_options_reach_torchs_kernels_and_are_said_unread_elsewhere(monkeypatch):
    from flexlab.backends import torch_flex as ours
    seen = {}
    real = ours._cpu_flex_attention

    def spy(query, key, value, **kwargs):
        seen.update(kwargs)
        return real(query, key, value, **kwargs)

    monkeypatch.setattr(ours, "_cpu_flex_attention", spy)
    q, k, v = random_qkv(1, 2, 32, 32, 16)
    options = {"BLOCK_M": 64, "fwd_num_warps": 4}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the torch backend reads them: nothing to say
        out = flexlab.flex_attention(q, k, v, None, None, None, False, False, options)  # torch's positions
    assert seen["kernel_options"] == options and rel_l2(out, reference(q, k, v)[0]) < TOLERANCES[torch.float32]
    with pytest.warns(UserWarning, match=r"kernel_options \['BLOCK_M', 'fwd_num_warps'\].*'reference' backend") as w:
        flexlab.flex_attention(q, k, v, kernel_options=options, backend="reference")
    assert w[0].filename == __file__  # points at the caller's line, not into flexlab


def test_on_a_gpu_max_scores_takes_torchs_kernels_and_says_so(monkeypatch):
    """flexlab's kernels write no row maxima: `auto` runs torch's for such a call with a FallbackWarning naming
    max_scores, and backend='cute' refuses it by name (the kernels' own support is not consulted)."""
    monkeypatch.setattr(api, "_cute_plan", lambda *args: ("", False))
    on_gpu = SimpleNamespace(device=torch.device("cuda"))
    with pytest.warns(flexlab.FallbackWarning, match="max_scores"):
        assert api._choose_backend("auto", on_gpu, on_gpu, on_gpu, None, None, False, want_max=True) == (
            "torch", False)
    with pytest.raises(flexlab.BackendUnavailableError, match="backend='cute' cannot run this call: .*max_scores"):
        api._choose_backend("cute", on_gpu, on_gpu, on_gpu, None, None, False, want_max=True)
    assert api._choose_backend("auto", on_gpu, on_gpu, on_gpu, None, None, False) == ("cute", False)


def test_torch_compile_fullgraph_with_return_aux(monkeypatch):
    """`return_aux` traces into the same single graph as `return_lse` (the kernels one custom op; the device check
    is told a CPU is fine, so the custom ops run their CPU formulas), and its LSE is differentiable there too."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from flexlab.backends import cute
    monkeypatch.setattr(cute, "_device_reason", lambda device: "")
    bm = flexlab.create_block_mask(lambda b, h, qi, kv: qi >= kv, 1, 1, 128, 128)
    q, k, v = (torch.randn(1, 2, 128, 64, dtype=torch.bfloat16).requires_grad_(True) for _ in range(3))

    def loss_fn(q, k, v):
        out, aux = flexlab.flex_attention(q, k, v, block_mask=bm, backend="cute",
                                          return_aux=flexlab.AuxRequest(lse=True))
        return out.float().square().mean() + 0.1 * aux.lse.mean()

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    loss = torch.compile(loss_fn, backend=counter, fullgraph=True)(q, k, v)
    loss.backward()
    got = [t.grad.clone() for t in (q, k, v)]
    assert counter.frame_count == 1
    for t in (q, k, v):
        t.grad = None
    eager = loss_fn(q, k, v)
    eager.backward()
    assert torch.allclose(loss, eager)
    for a, t in zip(got, (q, k, v)):
        assert rel_l2(a.float(), t.grad.float()) < 1e-3
