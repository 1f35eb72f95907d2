"""The warm path of `flexlab.flex_attention`: a call signature validated and run forward-only once goes straight to
its bound launch later, and anything that can change between calls of one signature sends it back to the full path
(CPU: the launch is a stub, the decisions are real)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("cutlass")

import flexlab  # noqa: E402
import flexlab.api as api  # noqa: E402
from flexlab.backends import cute as backend  # noqa: E402
from flexlab.errors import FlexlabTypeError, FlexlabValueError  # noqa: E402
from flexlab.kernels.config import FwdConfig  # noqa: E402
from flexlab.runtime import launch  # noqa: E402
from test_backend_captures import _run_on_fake_cuda, _softcap  # noqa: E402


@pytest.fixture(autouse=True)
def _empty_warm_cache():
    api.forget_warm_calls()
    yield
    api.forget_warm_calls()


def _counting_validate(monkeypatch) -> list:
    calls = []
    original = api._validate

    def counting(*args):
        calls.append(args)
        return original(*args)

    monkeypatch.setattr(api, "_validate", counting)
    return calls


def test_repeated_call_is_validated_and_bound_once(monkeypatch):
    score_mod, _ = _softcap()
    validated = _counting_validate(monkeypatch)
    binds = []

    def calls(q):
        for _ in range(3):
            flexlab.flex_attention(q, q, q, score_mod, backend="cute")

    assert _run_on_fake_cuda(monkeypatch, calls, binds) == [(20.0,)] * 3
    assert len(validated) == 1 and binds == [(20.0,)]


def test_a_new_captured_value_rebinds_with_that_value(monkeypatch):
    score_mod, set_cap = _softcap()
    binds = []

    def calls(q):
        flexlab.flex_attention(q, q, q, score_mod, backend="cute")
        flexlab.flex_attention(q, q, q, score_mod, backend="cute")
        set_cap(3.0)
        flexlab.flex_attention(q, q, q, score_mod, backend="cute")
        flexlab.flex_attention(q, q, q, score_mod, backend="cute")

    assert _run_on_fake_cuda(monkeypatch, calls, binds) == [(20.0,), (20.0,), (3.0,), (3.0,)]
    assert binds == [(20.0,), (3.0,)]


def test_bad_input_after_a_warm_call_is_still_refused(monkeypatch):
    errors = []

    def calls(q):
        flexlab.flex_attention(q, q, q, backend="cute")
        for bad in (lambda: flexlab.flex_attention(q, q, q.half(), backend="cute"),
                    lambda: flexlab.flex_attention(q, q, [1.0], backend="cute"),
                    lambda: flexlab.flex_attention(q, q[:, :1], q[:, :1], backend="cute"),
                    lambda: flexlab.flex_attention(q, q, q, scale="0.1", backend="cute")):
            with pytest.raises((FlexlabTypeError, FlexlabValueError)) as info:
                bad()
            errors.append(str(info.value))

    _run_on_fake_cuda(monkeypatch, calls)
    assert "value" in errors[0] and "value" in errors[1] and "enable_gqa" in errors[2] and "scale" in errors[3]


def test_the_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(api, "_WARM_ENTRIES", 3)

    def calls(q):
        for s in range(16, 96, 16):
            x = q[:, :, :s].contiguous()
            flexlab.flex_attention(x, x, x, backend="cute")

    assert len(_run_on_fake_cuda(monkeypatch, calls)) == 5
    assert len(api._WARM) <= 3


def _warm(lowered=None, score_mod=None, in_place=frozenset()):
    warm = backend.WarmForward()
    warm.bound, warm.score_mod, warm.mask_mod, warm.lowered = (lambda q, k, v, scale: "launched"), score_mod, None, \
        lowered
    warm.state = lowered.state if lowered is not None else ()
    warm.in_place = in_place
    return warm


def test_inputs_that_want_gradients_leave_the_warm_path():
    q = torch.randn(1, 2, 64, 64, requires_grad=True)
    x = q.detach()
    warm = _warm()
    assert warm(q, x, x, None) is None and warm(x, x, q, None) is None
    assert warm(x, x, x, None) == "launched"
    with torch.no_grad():
        assert warm(q, q, q, None) == "launched"


def test_a_learnable_captured_tensor_leaves_the_warm_path():
    table = torch.randn(2)

    def learnable(score, b, h, q_idx, kv_idx):
        return score + table[h]

    warm = _warm(backend._lowered(learnable, None), learnable)
    x = torch.randn(1, 2, 64, 64)
    assert warm(x, x, x, None) == "launched"
    table.requires_grad_(True)  # the lowered copy does not change; the user's tensor is read at every call
    assert warm(x, x, x, None) is None
    with torch.no_grad():
        assert warm(x, x, x, None) == "launched"
    with torch.no_grad():
        table += 1.0  # an in-place edit bumps the version: a kernel reading a copy of the table would be stale
        assert warm(x, x, x, None) is None


def test_an_in_place_edit_keeps_a_launch_that_reads_the_capture_in_place():
    """An optimizer step on a learnable bias edits it in place every step: a launch bound to the table's own memory
    stays valid; one bound to a converted copy (int64 ids read as int32) does not."""
    table = torch.randn(2)
    ids = torch.zeros(64, dtype=torch.int64)

    def learnable(score, b, h, q_idx, kv_idx):
        return score + table[h]

    def by_ids(score, b, h, q_idx, kv_idx):
        return torch.where(ids[q_idx] == ids[kv_idx], score, score - 1.0)

    low = backend._lowered(learnable, None)
    assert low.in_place_ids(low.tensors_on(torch.device("cpu"))) == {id(table)}
    warm = _warm(low, learnable, in_place=frozenset({id(table)}))
    x = torch.randn(1, 2, 64, 64)
    with torch.no_grad():
        table += 1.0
        assert warm(x, x, x, None) == "launched"
        table.resize_(4)  # a new layout: the kernel's layout changes, bind again
        assert warm(x, x, x, None) is None

    low = backend._lowered(by_ids, None)
    assert not low.in_place_ids(low.tensors_on(torch.device("cpu")))
    warm = _warm(low, by_ids)
    assert warm(x, x, x, None) == "launched"
    ids[32:] = 1
    assert warm(x, x, x, None) is None


def test_a_swapped_code_object_leaves_the_warm_path():
    def score_mod(score, b, h, q_idx, kv_idx):
        return score * 2.0

    def other(score, b, h, q_idx, kv_idx):
        return score * 3.0

    warm = _warm(backend._lowered(score_mod, None), score_mod)
    x = torch.randn(1, 2, 64, 64)
    assert warm(x, x, x, None) == "launched"
    score_mod.__code__ = other.__code__  # nothing captured changes, only the code
    assert warm(x, x, x, None) is None


def test_bound_launch_declines_a_misaligned_base_and_passes_the_scale():
    seen = []
    bound = launch.BoundForward()
    bound.fn = lambda *args: seen.append(args[5])
    bound.out_shape, bound.lse_shape, bound.dtype, bound.device = (1, 2, 64, 64), (1, 2, 64), torch.bfloat16, "cpu"
    bound.out_like_q = False
    bound.default_scale, bound.qpk, bound.group = 0.125, 1, 2
    bound.sparse = bound.order = bound.block_mask = None
    bound.config = FwdConfig(head_dim=64)
    bound.aux_tensors, bound.aux_scalars = (), ()
    buf = torch.randn(1 * 2 * 64 * 64 + 8, dtype=torch.bfloat16)
    aligned = buf[:-8].view(1, 2, 64, 64)
    shifted = buf[1:-7].view(1, 2, 64, 64)  # 2 bytes past a 16-byte boundary
    assert bound(shifted, aligned, aligned, None) is None and seen == []
    out, lse = bound(aligned, aligned, aligned, None)
    assert out.shape == (1, 2, 64, 64) and lse.shape == (1, 2, 64) and lse.dtype == torch.float32
    bound(aligned, aligned, aligned, 0.5)
    assert seen == [0.125, 0.5]
    bound.out_like_q, bound.lse_shape = True, None  # a kernel that writes no LSE
    out, lse = bound(aligned, aligned, aligned, None)
    assert lse is None and out.shape == aligned.shape and out.dtype == aligned.dtype


def test_bind_declines_strides_tma_cannot_read():
    q = torch.randn(1, 2, 64, 64, dtype=torch.bfloat16)
    assert launch.bind(q.transpose(2, 3), q, q) is None  # D not unit-stride: the full path copies it per call
    assert launch.bind(q, q, q[..., ::2]) is None
