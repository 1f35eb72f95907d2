"""The interleaved timing of a row's backends, with the GPU clocks replaced by a fake one (runs on a CPU)."""
from __future__ import annotations

import statistics

import torch

from flexlab.bench import timing


def _drifting_gpu(monkeypatch, slowdown_per_call=0.01):
    """A fake GPU that gets slower with every measurement (clocks falling as it heats), and a log of the order in
    which callables were timed."""
    state = {"n": 0, "order": []}

    def wall(fn, warmup_ms, rep_ms, grad_to_none=None):
        state["n"] += 1
        state["order"].append(fn.__name__)
        return fn() * (1 + slowdown_per_call * state["n"])

    def kernels(fn, calls):
        us = 1e3 * calls * fn() * (1 + slowdown_per_call * state["n"])
        return {f"{fn.__name__}_kernel": us}, us

    monkeypatch.setattr(timing, "wall_ms_cuda", wall)
    monkeypatch.setattr(timing, "_kernel_times_cuda", kernels)
    return state


def _same_speed():
    def a():
        return 1.0

    def b():
        return 1.0

    def c():
        return 1.0
    return {"a": a, "b": b, "c": c}


def test_rounds_rotate_the_order_and_keep_each_rounds_median(monkeypatch):
    state = _drifting_gpu(monkeypatch)
    out = timing.measure_interleaved(_same_speed(), torch.device("cuda"), rounds=3, profile_calls=4)
    assert state["order"] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    for name, t in out.items():
        assert len(t.wall_rounds) == 3 and t.wall_ms == statistics.median(t.wall_rounds)
        assert len(t.kernel_rounds) == 3 and t.kernel_ms == statistics.median(t.kernel_rounds)
        assert t.kernels[0][0] == f"{name}_kernel"
    # Three equally fast backends on a GPU that slows down: interleaved, none of them is favoured by more than the
    # drift of one round; timed one after the other, the first would look 2 rounds' drift faster than the last.
    walls = [t.wall_ms for t in out.values()]
    assert max(walls) / min(walls) < 1.03


def test_one_after_the_other_is_what_a_single_round_does(monkeypatch):
    state = _drifting_gpu(monkeypatch)
    monkeypatch.setattr(timing, "kernel_profile_cuda", lambda fn, calls: (fn(), [(fn.__name__, fn())]))
    out = timing.measure_interleaved(_same_speed(), torch.device("cuda"), rounds=1)
    assert state["order"] == ["a", "b", "c"]
    assert all(not t.wall_rounds for t in out.values())
    assert out["a"].wall_ms < out["c"].wall_ms  # the drift the rounds are there to spread


def test_cpu_times_each_callable_once(monkeypatch):
    calls = []
    monkeypatch.setattr(timing, "wall_ms_host", lambda fn, w, r: calls.append(fn.__name__) or 2.0)
    out = timing.measure_interleaved(_same_speed(), torch.device("cpu"), rounds=5)
    assert calls == ["a", "b", "c"] and all(t.wall_ms == 2.0 and t.kernel_ms is None for t in out.values())


def test_kernel_time_counts_overlapping_kernels_once():
    # kernels back to back, one that started (and waited) while the one before drained, and one nested inside
    # another: 20 + 6 us of busy time, against 36 us of summed durations
    intervals = [(0, 10), (10, 15), (12, 20), (15, 20), (30, 36), (31, 33)]
    assert timing.busy_us(intervals) == 26
    assert timing.busy_us(list(reversed(intervals))) == 26
    assert timing.busy_us([]) == 0
    assert timing.busy_us([(5, 7)]) == 2
