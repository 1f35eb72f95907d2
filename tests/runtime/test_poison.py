"""The NaN fill of the buffers kernels must write (`flexlab.runtime.poison`), on the forward's and the backward's
launch paths, with stand-in kernels that record what they were handed (no GPU)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flexlab.kernels import bwd_launch
from flexlab.runtime import launch, poison


def test_the_suite_runs_with_the_switch_on():
    """tests/conftest.py turns it on, so a tile a GPU test's kernel leaves unwritten reads NaN, not last call's data."""
    assert poison.ENABLED


def test_fill_writes_nan_and_skips_absent_buffers():
    a, b = torch.zeros(3, 4), torch.ones(5, dtype=torch.bfloat16)
    poison.fill(a, None, b)
    assert a.isnan().all() and b.isnan().all()


def test_poisoned_restores_the_switch_after_an_error(monkeypatch):
    monkeypatch.setattr(poison, "ENABLED", False)
    with pytest.raises(RuntimeError):
        with poison.poisoned():
            assert poison.ENABLED
            raise RuntimeError("kernel failed")
    assert poison.ENABLED is False


def _bound_forward(seen):
    bound = launch.BoundForward()
    bound.fn = lambda q, k, v, out, lse, *rest: seen.update(out=out.clone(), lse=lse.clone())
    bound.out_like_q, bound.out_shape, bound.lse_shape = True, (1, 2, 8, 16), (1, 2, 8)
    bound.dtype, bound.device = torch.bfloat16, torch.device("cpu")
    bound.default_scale, bound.qpk, bound.group, bound.sparse, bound.order = 0.25, 1, 2, None, None
    bound.config = SimpleNamespace(dynamic_tiles=False, split_tail=False)
    bound.aux_tensors, bound.aux_scalars, bound.block_mask = (), (), None
    return bound


@pytest.mark.parametrize("enabled", [True, False])
def test_warm_forward_hands_the_kernel_nan_buffers_only_when_on(monkeypatch, enabled):
    monkeypatch.setattr(poison, "ENABLED", enabled)
    seen = {}
    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    out, lse = _bound_forward(seen)(q, q, q, None)
    assert seen["out"].isnan().all() == enabled and seen["lse"].isnan().all() == enabled
    assert out.shape == q.shape and lse.shape == (1, 2, 8)


def test_forward_hands_the_kernel_nan_buffers(monkeypatch):
    monkeypatch.setattr(poison, "ENABLED", True)
    seen = {}

    def kernel(q, k, v, out, lse, *rest):
        seen.update(out=out.clone(), lse=lse.clone())

    key = SimpleNamespace(tvm_ffi=True, config=SimpleNamespace(dynamic_tiles=False, split_tail=False))
    monkeypatch.setattr(launch, "_plan", lambda *args: (kernel, key, None, None))
    q = torch.randn(1, 2, 40, 64, dtype=torch.bfloat16)
    out, lse = launch.forward(q, q, q)
    assert seen["out"].isnan().all() and seen["lse"].isnan().all()
    assert out.shape == q.shape and lse.shape == (1, 2, 40)


def test_backward_hands_its_kernels_nan_buffers(monkeypatch):
    monkeypatch.setattr(poison, "ENABLED", True)
    seen = {}
    kernels = SimpleNamespace(
        grad_dtype=torch.float32,
        pre=lambda out, dout, lse, dlse, dpsum, lse2, dq_accum: seen.update(dpsum=dpsum.clone(), lse2=lse2.clone(),
                                                                           dq_accum=dq_accum.clone()),
        main=lambda q, k, v, dout, lse2, dpsum, dq_accum, dk, dv, *rest: seen.update(dk=dk.clone(), dv=dv.clone()),
        post=lambda dq_accum, dq, scale: seen.update(dq=dq.clone()))
    plan = SimpleNamespace(kernels=kernels, cfg=SimpleNamespace(persistent=False, tile_m=64, num_consumer_wgs=1),
                           sq_pad=64, tail=None, sparse=None, rank=None, tile_order=None)
    monkeypatch.setattr(bwd_launch, "_plan", lambda *args: plan)
    q, k, v, dout, out = (torch.randn(1, 2, 40, 64, dtype=torch.bfloat16) for _ in range(5))
    lse = torch.randn(1, 2, 40)
    entry = SimpleNamespace(generated=None, grad_slots=())
    dq, dk, dv, grads = bwd_launch.backward(dout, q, k, v, out, lse, None, entry, (), None, None, 0.125, (), False)
    assert set(seen) == {"dpsum", "lse2", "dq_accum", "dk", "dv", "dq"}
    assert all(t.isnan().all() for t in seen.values())
    assert seen["lse2"].shape == (1, 2, 64) and seen["dq_accum"].shape == (1, 2, 64, 64)
    assert grads == []
