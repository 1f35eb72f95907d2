"""The cute backend re-reads captured values when they change, without a new kernel (CPU: lowering only)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("cutlass")

from flexlab.backends import cute as backend  # noqa: E402


def _softcap():
    cap = 20.0

    def score_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    def set_cap(value):
        nonlocal cap
        cap = value
    return score_mod, set_cap


def test_new_scalar_value_same_kernel_mods():
    score_mod, set_cap = _softcap()
    first = backend._lowered(score_mod, None)
    assert first.aux_scalars == (20.0,)
    assert backend._lowered(score_mod, None) is first  # nothing changed: no re-trace
    set_cap(5.0)
    second = backend._lowered(score_mod, None)
    assert second.aux_scalars == (5.0,)
    assert second.mods == first.mods and hash(second.mods) == hash(first.mods)  # same compiled kernel


WINDOW = 64  # a module-level number a mod reads as a global


def test_rebound_global_is_seen_and_a_new_code_object_is_reread():
    global WINDOW

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx - kv_idx < WINDOW, score, score - 1.0)

    first = backend._lowered(score_mod, None)
    assert first.aux_scalars == (64,)
    WINDOW = 128
    try:
        second = backend._lowered(score_mod, None)
        assert second.aux_scalars == (128,)

        def other(score, b, h, q_idx, kv_idx):
            return score * 2.0
        score_mod.__code__ = other.__code__  # where to look is worked out again for the new code
        assert backend._lowered(score_mod, None).aux_scalars == ()
    finally:
        WINDOW = 64


def test_in_place_edit_of_captured_tensor_is_seen_without_tracing_again(monkeypatch):
    """An optimizer step on a learnable bias edits it in place every step: the kernel reads the new values, and the
    mods are not traced again (that cost milliseconds of host time per training step)."""
    bias = torch.zeros(8)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h]

    first = backend._lowered(score_mod, None)
    assert torch.equal(first.aux_tensors[0], torch.zeros(8))
    import flexlab.codegen
    monkeypatch.setattr(flexlab.codegen, "generate", lambda *a, **k: pytest.fail("traced again"))
    bias += 1.5
    second = backend._lowered(score_mod, None)
    assert second is first and torch.equal(second.aux_tensors[0], torch.full((8,), 1.5))
    assert second.aux_tensors[0].data_ptr() == bias.data_ptr()  # read in place, no copy


def test_in_place_edit_of_a_converted_capture_refreshes_the_kernel_copy():
    """int64 document ids are read as an int32 copy: an in-place edit must reach that copy."""
    doc = torch.zeros(64, dtype=torch.int64)

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.where(doc[q_idx] == doc[kv_idx], score, score - 1.0)

    first = backend._lowered(score_mod, None)
    assert first.aux_tensors[0].dtype == torch.int32
    doc[32:] = 1
    second = backend._lowered(score_mod, None)
    assert second is first and torch.equal(second.aux_tensors[0], doc.to(torch.int32))


def test_in_place_resize_of_a_capture_traces_again():
    bias = torch.zeros(8)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h]

    first = backend._lowered(score_mod, None)
    bias.resize_(16).zero_()  # same object, new shape: the kernel's layout changes
    second = backend._lowered(score_mod, None)
    assert second is not first and second.aux_tensors[0].shape == (16,)


def test_kernel_key_follows_the_generated_text_not_only_the_graph(monkeypatch):
    """Two generator outputs for one traced graph must never share a compiled kernel (on disk, across versions)."""
    import hashlib

    from flexlab.backends import cute as backend

    def softcap(score, b, h, q_idx, kv_idx):
        return 20.0 * torch.tanh(score / 20.0)

    low = backend._lowered(softcap, None)
    from flexlab.codegen import generate
    g = generate(softcap, None, fastmath=True)
    assert low.mods.source_hash == hashlib.sha256(g.source.encode()).hexdigest()
    assert low.mods.source_hash != g.hash


def _run_on_fake_cuda(monkeypatch, calls, binds: list | None = None) -> list:
    """Run `calls(q)` through flexlab.flex_attention as if on a CUDA device, with the kernel launch replaced by a
    stub; returns the captured scalars each launch received. Warm calls launch through what `launch.bind` returned
    (`binds` collects the scalars bound each time the full path binds a call)."""
    from flexlab.runtime import launch
    seen = []

    def fake_forward(q, k, v, mods=None, aux_tensors=(), aux_scalars=(), block_mask=None, scale=None,
                     with_lse=True, stored_masks=None):
        seen.append(tuple(aux_scalars))
        return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32) if with_lse else None

    class FakeBound:  # what `launch.bind` returns: a launch of the bound inputs
        def __init__(self, mods, aux_tensors, aux_scalars, block_mask, with_lse):
            self.args, self.aux_tensors = (mods, aux_tensors, aux_scalars, block_mask), aux_tensors
            self.with_lse = with_lse

        def __call__(self, q, k, v, scale):
            return fake_forward(q, k, v, *self.args, scale, self.with_lse)

    def fake_bind(q, k, v, mods=None, aux_tensors=(), aux_scalars=(), block_mask=None, with_lse=True,
                  stored_masks=None):
        if binds is not None:
            binds.append(tuple(aux_scalars))
        return FakeBound(mods, aux_tensors, aux_scalars, block_mask, with_lse)

    monkeypatch.setattr(backend, "_device_reason", lambda device: "")
    monkeypatch.setattr(launch, "forward", fake_forward)
    monkeypatch.setattr(launch, "bind", fake_bind)

    class FakeCuda:  # what the Python-side checks read of a CUDA device
        type = "cuda"

    fake_cuda = FakeCuda()
    q = torch.randn(1, 2, 64, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: fake_cuda), raising=False)
    try:
        with torch.no_grad():
            calls(q)
    finally:
        monkeypatch.undo()
    return seen


def test_api_call_passes_the_values_captured_at_that_call(monkeypatch):
    """flex_attention reads a mod's captures once per call (the backend check) and launches with those values: a new
    soft-cap between two calls reaches the second launch."""
    import flexlab

    score_mod, set_cap = _softcap()

    def calls(q):
        flexlab.flex_attention(q, q, q, score_mod, backend="cute")
        set_cap(7.5)
        flexlab.flex_attention(q, q, q, score_mod, backend="cute")

    assert _run_on_fake_cuda(monkeypatch, calls) == [(20.0,), (7.5,)]


def test_a_warm_call_reads_the_captures_once(monkeypatch):
    """Reading what the mods capture is most of a warm call's host time: the backend check, the gradient decision
    and the launch share one read per mod (two for a score_mod plus a mask_mod)."""
    import flexlab

    score_mod, _ = _softcap()
    reads = []
    original = backend._captured_state

    def counting(fn):
        reads.append(fn)
        return original(fn)

    monkeypatch.setattr(backend, "_captured_state", counting)

    def calls(q):
        flexlab.flex_attention(q, q, q, score_mod, backend="cute")  # generates and lowers
        reads.clear()
        flexlab.flex_attention(q, q, q, score_mod, backend="cute")

    _run_on_fake_cuda(monkeypatch, calls)
    assert reads == [score_mod, None]


def test_support_and_captured_grad_agrees_with_its_parts(monkeypatch):
    monkeypatch.setattr(backend, "_device_reason", lambda device: "")
    table = torch.randn(4, requires_grad=True)

    def learnable(score, b, h, q_idx, kv_idx):
        return score + table[h]

    score_mod, _ = _softcap()
    dev = torch.device("cpu")
    for mod in (learnable, score_mod, None):
        both = backend.support_and_captured_grad(dev, torch.bfloat16, 128, 128, mod, None, None)
        assert both == (backend.support_reason(dev, torch.bfloat16, 128, 128, mod, None, None),
                        backend.captured_requires_grad(mod, None))
    assert backend.support_and_captured_grad(dev, torch.bfloat16, 128, 128, learnable, None, None) == ("", True)
    reason, grad = backend.support_and_captured_grad(dev, torch.bfloat16, 96, 96, learnable, None, None)
    assert "head dim 96" in reason and grad is False
    table.requires_grad_(False)  # read at every call, not when the mods were lowered
    assert backend.support_and_captured_grad(dev, torch.bfloat16, 128, 128, learnable, None, None) == ("", False)
    table.requires_grad_(True)
    assert backend.captured_requires_grad(learnable, None)


def test_only_a_learnable_table_requiring_grad_takes_the_differentiable_path(monkeypatch):
    """q, k, v without grad but a captured bias table with it: the call must go through the backward-capable path
    (it used to look at the kernel's detached copies of the captured tensors and run the forward-only kernel, so
    the table silently got no gradient)."""
    import flexlab.api as api
    monkeypatch.setattr(backend, "_device_reason", lambda device: "")
    table = torch.randn(2, requires_grad=True)

    def learnable(score, b, h, q_idx, kv_idx):
        return score + table[h]

    q = torch.randn(1, 2, 64, 64, dtype=torch.bfloat16)
    reason, needs_grad = api._cute_plan(q, q, q, learnable, None)
    assert reason == "" and needs_grad
    with torch.no_grad():
        assert api._cute_plan(q, q, q, learnable, None) == ("", False)


def test_mods_made_afresh_every_call_do_not_pile_up(monkeypatch):
    """A closure defined inside a model's forward is a new function at every call: the per-mod caches keep only the
    newest entries, so such a loop does not hold every mod (and every tensor it captured) it ever ran."""
    monkeypatch.setattr(backend, "MOD_CACHE_ENTRIES", 4)
    monkeypatch.setattr(backend, "_LOWERED", {})
    monkeypatch.setattr(backend, "_READERS", {})
    made = []
    for i in range(10):
        bias = torch.full((4,), float(i))

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + bias[h]

        made.append(score_mod)
        low = backend._lowered(score_mod, None)
        assert torch.equal(low.aux_tensors[0], bias)
    assert len(backend._LOWERED) <= 4 and len(backend._READERS) <= 4
    assert (made[-1], None) in backend._LOWERED and (made[0], None) not in backend._LOWERED
