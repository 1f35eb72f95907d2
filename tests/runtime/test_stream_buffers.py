"""The scheduling buffers the launcher hands kernels (`runtime.launch.tile_counter`, `scheduler_workspace`): shared
by launches on one stream, never across streams or kinds, fresh under CUDA-graph capture (CPU: the stream handle and
the capture state are stubbed)."""
from __future__ import annotations

import dataclasses

import torch

from flexlab.kernels.config import FwdConfig
from flexlab.runtime import launch


def test_buffers_are_shared_per_stream_and_kind(monkeypatch):
    stream = {"handle": 11}
    monkeypatch.setattr(launch, "_current_raw_stream", lambda index: stream["handle"])
    monkeypatch.setattr(launch, "_STREAM_BUFFERS", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    cpu = torch.device("cpu")
    split = FwdConfig(head_dim=128, persistent_ctas=132, cluster_m=2, split_tail=True)
    counter = launch.tile_counter(cpu)
    arrivals, partials = launch.scheduler_workspace(split, cpu)
    assert counter.tolist() == [0] and not arrivals.any()
    assert (arrivals.numel(), partials.numel()) == split.split_tail_workspace()
    assert launch.tile_counter(cpu) is counter and launch.scheduler_workspace(split, cpu)[0] is arrivals
    assert launch.scheduler_workspace(dataclasses.replace(split, split_tail=False, dynamic_tiles=False), cpu) is None
    other = launch.scheduler_workspace(FwdConfig(head_dim=64, tile_m=192, num_stages=3, persistent_ctas=132,
                                                 split_tail=True), cpu)
    assert other[0] is not arrivals  # another size: its own
    stream["handle"] = 12
    assert launch.tile_counter(cpu) is not counter and launch.scheduler_workspace(split, cpu)[0] is not arrivals


def test_capture_gets_its_own_buffers(monkeypatch):
    monkeypatch.setattr(launch, "_current_raw_stream", lambda index: 11)
    monkeypatch.setattr(launch, "_STREAM_BUFFERS", {})
    monkeypatch.setattr(launch, "_GRAPH_BUFFERS", [])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    cpu = torch.device("cpu")
    eager = launch.tile_counter(cpu)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    captured = [launch.tile_counter(cpu), launch.tile_counter(cpu)]
    assert captured[0] is not eager and captured[1] is not captured[0]
    assert all(any(c is g for g in launch._GRAPH_BUFFERS) for c in captured)  # kept for the graph's life
