"""Two clocks per measurement: wall-clock per call (what a user waits for) and GPU kernel time per call.

Wall time comes from triton's `do_bench` (median over repetitions, L2 flushed between calls), so it includes the host
work of launching: argument checks, Python dispatch, allocator calls. Kernel time is the time during which some GPU
kernel or memset the profiler sees was running, over the calls, divided by the number of calls: the union of their
intervals, so kernels that overlap (programmatic dependent launch starts a kernel's CTAs while the one before drains,
and they wait there) count once, not once each. The gap between the two clocks is launch overhead, which dominates
at small shapes. The profiler also tells which kernels ran, which is how a silent fall-back to an
unfused path is caught.

A GPU's clock drifts with its temperature and power draw over a benchmark, by a few percent, so backends timed one
after the other are not timed on the same GPU. `measure_interleaved` times every backend of a row in turns (several
short rounds, each in a rotated order) and keeps the median of the rounds for each.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class Timing:
    wall_ms: float
    kernel_ms: float | None = None
    # (name, ms per call) of the kernels that took the most time, largest first.
    kernels: list[tuple[str, float]] = field(default_factory=list)
    # Per-round results of an interleaved measurement (empty for a single measurement): their spread is the noise.
    wall_rounds: list[float] = field(default_factory=list)
    kernel_rounds: list[float] = field(default_factory=list)


def wall_ms_cuda(fn: Callable[[], object], warmup_ms: float, rep_ms: float, grad_to_none=None) -> float:
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none, return_mode="median"))


def kernel_profile_cuda(fn: Callable[[], object], calls: int, top: int = 4) -> tuple[float, list[tuple[str, float]]]:
    """GPU time per call from the profiler (all kernels and memsets, overlaps counted once), and the largest kernels
    by name (each one's own duration, waits included)."""
    per_name, busy_us = _kernel_times_cuda(fn, calls)
    return busy_us / 1e3 / calls, _largest(per_name, calls, top)


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals: the time some kernel was running."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def _largest(per_name: dict[str, float], calls: int, top: int) -> list[tuple[str, float]]:
    """(name, ms per call) of the `top` kernels by time, from µs summed over `calls` calls."""
    largest = sorted(per_name.items(), key=lambda kv: -kv[1])[:top]
    return [(name, us / 1e3 / calls) for name, us in largest]


def _kernel_times_cuda(fn: Callable[[], object], calls: int) -> tuple[dict[str, float], float]:
    """(microseconds of GPU time per kernel name, microseconds during which any of them ran) over `calls` calls."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per_name: dict[str, float] = {}
    intervals = []
    for evt in prof.events():
        if evt.device_type == DeviceType.CUDA:
            per_name[evt.name] = per_name.get(evt.name, 0.0) + evt.time_range.elapsed_us()
            intervals.append((evt.time_range.start, evt.time_range.end))
    return per_name, busy_us(intervals)


def wall_ms_host(fn: Callable[[], object], warmup_ms: float, rep_ms: float) -> float:
    """Median wall time per call on a CPU device (used by tests and CPU runs; no kernel clock there)."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    deadline = time.perf_counter() + warmup_ms / 1e3
    while time.perf_counter() < deadline:
        fn()
    n = max(3, min(100, int(rep_ms / 1e3 / max(first, 1e-6))))
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def measure(fn: Callable[[], object], device: torch.device, warmup_ms: float = 25, rep_ms: float = 100,
            grad_to_none=None, profile_calls: int = 10) -> Timing:
    """Time `fn` (already compiled and warmed up once) with both clocks where the device has them."""
    if device.type != "cuda":
        return Timing(wall_ms=wall_ms_host(fn, warmup_ms, rep_ms))
    wall = wall_ms_cuda(fn, warmup_ms, rep_ms, grad_to_none)
    kernel_ms, kernels = kernel_profile_cuda(fn, profile_calls)
    return Timing(wall_ms=wall, kernel_ms=kernel_ms, kernels=kernels)


def measure_interleaved(fns: dict[str, Callable[[], object]], device: torch.device, warmup_ms: float = 25,
                        rep_ms: float = 100, rounds: int = 5, profile_calls: int = 10, top: int = 4
                        ) -> dict[str, Timing]:
    """Time several callables on one GPU in turns: `rounds` rounds, each timing every callable once (wall clock
    over rep_ms / rounds after warmup_ms, then the profiler over a few calls) in an order rotated by one each round,
    so that no backend always runs first or last, and a clock drifting through the row reaches all of them alike.
    Each clock keeps the median of its rounds. On a CPU, or with one round or one callable, this is `measure` called
    on each in turn."""
    names = list(fns)
    if device.type != "cuda" or rounds <= 1 or len(names) < 2:
        return {n: measure(fns[n], device, warmup_ms, rep_ms, profile_calls=profile_calls) for n in names}
    calls = max(2, -(-profile_calls // rounds))
    walls: dict[str, list[float]] = {n: [] for n in names}
    kernel: dict[str, list[float]] = {n: [] for n in names}
    by_name: dict[str, dict[str, float]] = {n: {} for n in names}
    for r in range(rounds):
        shift = r % len(names)
        for n in names[shift:] + names[:shift]:
            walls[n].append(wall_ms_cuda(fns[n], warmup_ms, rep_ms / rounds))
            times, busy = _kernel_times_cuda(fns[n], calls)
            kernel[n].append(busy / 1e3 / calls)
            for k, us in times.items():
                by_name[n][k] = by_name[n].get(k, 0.0) + us
    return {n: Timing(wall_ms=statistics.median(walls[n]), kernel_ms=statistics.median(kernel[n]),
                      kernels=_largest(by_name[n], calls * rounds, top), wall_rounds=walls[n], kernel_rounds=kernel[n])
            for n in names}
