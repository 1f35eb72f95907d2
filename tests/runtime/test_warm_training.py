"""The warm training path of `flexlab.flex_attention`: a signature run once with gradients through flexlab's kernels
goes straight to a bound forward inside the same autograd Function later, and gives the same values and gradients.

CPU: the backend choice is forced to flexlab's differentiable path, whose ops run dense math on CPU (`flexlab._ops`);
the bound forward is that same CPU op, counted, so the decisions and the autograd wiring are real.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("cutlass")

import flexlab  # noqa: E402
import flexlab.api as api  # noqa: E402
from flexlab import _ops  # noqa: E402
from flexlab.backends import cute as backend  # noqa: E402
from flexlab.testing import rel_l2  # noqa: E402


@pytest.fixture(autouse=True)
def _empty_warm_caches():
    api.forget_warm_calls()
    yield
    api.forget_warm_calls()


def _cpu_flexlab(monkeypatch, score_mod) -> dict:
    """Route flex_attention's cute path through the CPU ops; count validations, binds and bound launches."""
    counts = {"validate": 0, "bind": 0, "bound": 0, "deterministic": []}
    validate = api._validate

    def counting_validate(*args):
        counts["validate"] += 1
        return validate(*args)

    def bind_forward(q, k, v, score_mod_, block_mask, with_lse=True):
        assert with_lse, "the training forward must write the LSE"
        counts["bind"] += 1
        low = backend._lowered(score_mod_, None)
        entry = _ops.mod_entry(_ops.register_mods(score_mod_, None))

        def bound(q, k, v, scale):
            counts["bound"] += 1
            return _ops.attention_forward(q, k, v, entry, [], [], scale)

        bound.aux_tensors = low.tensors_on(q.device)
        warm = backend.WarmForward()
        warm.bound, warm.score_mod, warm.mask_mod, warm.lowered = bound, score_mod_, None, low
        warm.state, warm.in_place = low.state, low.in_place_ids(bound.aux_tensors)
        return warm

    backward = _ops.attention_backward

    def recording_backward(*args):
        counts["deterministic"].append(args[-1])
        counts.setdefault("scalars", []).append(list(args[-2]))
        return backward(*args)

    monkeypatch.setattr(api, "_validate", counting_validate)
    monkeypatch.setattr(api, "_choose_backend", lambda *a: ("cute", True))
    monkeypatch.setattr(backend, "bind_forward", bind_forward)
    monkeypatch.setattr(_ops, "attention_backward", recording_backward)
    return counts


def _step(q, k, v, score_mod, dout, leaves, **kw):
    for t in leaves:
        t.grad = None
    out = flexlab.flex_attention(q, k, v, score_mod=score_mod, backend="cute", **kw)
    out.backward(dout)
    return out.detach(), [t.grad.clone() for t in leaves]


def test_warm_training_steps_match_the_full_path(monkeypatch):
    table = torch.randn(48, requires_grad=True)  # fp32: the kernel reads it in place (a float64 one is copied)

    def learnable(score, b, h, q_idx, kv_idx):
        return score + table[kv_idx]

    q, k, v, dout = (torch.randn(1, 2, 48, 32, dtype=torch.float64) for _ in range(4))
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    leaves = [q, k, v, table]
    counts = _cpu_flexlab(monkeypatch, learnable)

    results, tables = [], []
    for step in range(3):
        tables.append(table.detach().clone())
        results.append(_step(q, k, v, learnable, dout, leaves, scale=0.2))
        with torch.no_grad():
            table -= 0.1 * table.grad  # an optimizer step: an in-place edit of a capture read in place
    # validated and bound once; the later steps launched through the bound forward
    assert counts["validate"] == 1 and counts["bind"] == 1 and counts["bound"] == 2

    # each warm step equals a full-path step with the same table values
    api._WARM_TRAIN.clear()
    with torch.no_grad():
        table.copy_(tables[1])  # back to the values of the second step
    assert not torch.equal(results[0][0], results[1][0])  # (the steps did change the table)
    full = _step(q, k, v, learnable, dout, leaves, scale=0.2)
    assert rel_l2(full[0], results[1][0]) < 1e-12
    for a, b in zip(full[1], results[1][1]):
        assert rel_l2(a, b) < 1e-12


def _qkv_dout():
    """float64 q, k, v requiring grad, and an output gradient (B1 H2 S40 D32)."""
    return tuple(torch.randn(1, 2, 40, 32, dtype=torch.float64, requires_grad=i < 3) for i in range(4))


def test_warm_training_reads_the_scale_and_the_deterministic_mode_per_call(monkeypatch):
    def softcap(score, b, h, q_idx, kv_idx):
        return 5.0 * torch.tanh(score / 5.0)

    q, k, v, dout = _qkv_dout()
    counts = _cpu_flexlab(monkeypatch, softcap)
    _step(q, k, v, softcap, dout, [q, k, v], scale=0.3)
    warm = _step(q, k, v, softcap, dout, [q, k, v], scale=0.1, deterministic=True)
    assert counts["bound"] == 1 and counts["deterministic"] == [False, True]
    api._WARM_TRAIN.clear()
    full = _step(q, k, v, softcap, dout, [q, k, v], scale=0.1, deterministic=True)
    assert rel_l2(full[0], warm[0]) < 1e-12 and all(rel_l2(a, b) < 1e-12 for a, b in zip(full[1], warm[1]))


def test_inference_and_new_captures_leave_the_warm_training_path(monkeypatch):
    cap = 5.0

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    q, k, v, dout = _qkv_dout()
    counts = _cpu_flexlab(monkeypatch, softcap)
    _step(q, k, v, softcap, dout, [q, k, v])
    train = api._WARM_TRAIN[next(iter(api._WARM_TRAIN))]
    with torch.no_grad():
        assert train(q, k, v, None, None) is None  # no gradient wanted
    assert train(q.detach(), k.detach(), v.detach(), None, None) is None
    cap = 2.0  # noqa: F841 (read by softcap through its closure): a new captured value goes back to the full path
    assert train(q, k, v, None, None) is None
    assert counts["bound"] == 0


def test_a_shared_entry_regenerated_elsewhere_is_regenerated_for_this_call(monkeypatch):
    """Another call may re-generate the mods' shared registry entry for other captured values; a warm call whose
    captures are back to its bound values must run its backward with those, not the other call's."""
    cap = 5.0

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    q, k, v, dout = _qkv_dout()
    counts = _cpu_flexlab(monkeypatch, softcap)
    _step(q, k, v, softcap, dout, [q, k, v])
    cap = 2.0
    _ops.register_mods(softcap, None)  # what a full-path call with the new value does to the shared entry
    cap = 5.0  # noqa: F841 (read by softcap through its closure)
    _step(q, k, v, softcap, dout, [q, k, v])
    assert counts["bound"] == 1 and counts["scalars"] == [[5.0], [5.0]]
