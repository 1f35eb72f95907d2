"""The backward speed sweep must run each candidate configuration, not the first one it met: a CPU check that the
sweep's swap reaches the launcher's kernel lookup even after another configuration was memoised for that head dim."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import bwd_perf_sweep
from flexlab.kernels import bwd_launch
from flexlab.kernels.bwd_config import default_bwd_config


class _Asked(Exception):
    pass


def _config_the_launcher_asks_for(monkeypatch) -> object:
    """Call `bwd_launch.backward` up to its kernel lookup and return the configuration it looked up."""
    def stop(g, grad_slots, kernel_aux, dtype, cfg, *rest):
        raise _Asked(cfg)
    monkeypatch.setattr(bwd_launch, "_kernels", stop)
    q = torch.randn(1, 2, 128, 128, dtype=torch.bfloat16)
    entry = type("Entry", (), {"generated": None, "grad_slots": ()})()
    with pytest.raises(_Asked) as asked:
        bwd_launch.backward(q, q, q, q, q, None, None, entry, (), None, None, 0.1, (), False)
    return asked.value.args[0]


def test_swap_reaches_the_kernel_lookup_after_a_memoised_default(monkeypatch):
    monkeypatch.setattr(bwd_launch, "_config", bwd_launch._config)  # restored after the test
    default = default_bwd_config(128)
    assert _config_the_launcher_asks_for(monkeypatch) == default  # memoises the default for D=128
    candidate = dataclasses.replace(default, kv_tiles_first=not default.kv_tiles_first)
    assert candidate != default
    bwd_perf_sweep.swap_config(bwd_launch, candidate)
    assert _config_the_launcher_asks_for(monkeypatch) == candidate


def test_config_applied_reads_the_warm_kernel_keys(monkeypatch):
    default = default_bwd_config(64)
    other = dataclasses.replace(default, stats_in_smem=not default.stats_in_smem)
    monkeypatch.setattr(bwd_launch, "_KERNELS", {("", torch.bfloat16, default, False, False, False, "sm_90a"): None})
    assert bwd_perf_sweep.config_applied(bwd_launch, default, deterministic=False)
    assert not bwd_perf_sweep.config_applied(bwd_launch, default, deterministic=True)
    assert not bwd_perf_sweep.config_applied(bwd_launch, other, deterministic=False)
