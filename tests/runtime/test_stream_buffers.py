"""The scheduling buffers the launcher hands kernels (`runtime.launch.tile_counter`, `scheduler_workspace`,
`split_tail_buffers`): shared by launches on one stream, never across streams or kinds, one split-tail workspace per
stream for every size, fresh under CUDA-graph capture (CPU: the stream handle and the capture state are stubbed)."""
from __future__ import annotations

import dataclasses

import torch

from flexlab.kernels.config import FwdConfig
from flexlab.runtime import launch


def _one_stream(monkeypatch):
    """Stream 11, no buffers yet, not capturing."""
    monkeypatch.setattr(launch, "_current_raw_stream", lambda index: 11)
    monkeypatch.setattr(launch, "_STREAM_BUFFERS", {})
    monkeypatch.setattr(launch, "_GRAPH_BUFFERS", [])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


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
    d64 = FwdConfig(head_dim=64, tile_m=192, num_stages=3, persistent_ctas=132, split_tail=True)
    other = launch.scheduler_workspace(d64, cpu)
    assert (other[0].numel(), other[1].numel()) == d64.split_tail_workspace()  # another size: views of its own size
    stream["handle"] = 12
    assert launch.tile_counter(cpu) is not counter and launch.scheduler_workspace(split, cpu)[0] is not arrivals


def test_capture_gets_its_own_buffers(monkeypatch):
    _one_stream(monkeypatch)
    cpu = torch.device("cpu")
    eager = launch.tile_counter(cpu)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    captured = [launch.tile_counter(cpu), launch.tile_counter(cpu)]
    assert captured[0] is not eager and captured[1] is not captured[0]
    assert all(any(c is g for g in launch._GRAPH_BUFFERS) for c in captured)  # kept for the graph's life


def test_one_split_workspace_per_stream_grows_for_every_size(monkeypatch):
    """The backward's cut asks for a size per (batch, heads, length): training over many lengths must hold one
    workspace per stream, as large as the largest asked for, not one per size."""
    _one_stream(monkeypatch)
    cpu = torch.device("cpu")
    counters, partials = launch.split_tail_buffers(cpu, 4, 100)
    assert (counters.numel(), partials.numel()) == (4, 100) and not counters.any()
    assert launch.split_tail_buffers(cpu, 4, 100)[0] is counters  # the same views again: nothing new per call
    small = launch.split_tail_buffers(cpu, 2, 50)
    assert (small[0].numel(), small[1].numel()) == (2, 50)
    assert small[0].data_ptr() == counters.data_ptr() and small[1].data_ptr() == partials.data_ptr()
    for cut in range(1, 40):  # many shapes, each larger than the last
        big = launch.split_tail_buffers(cpu, cut, cut * 1000)
        assert (big[0].numel(), big[1].numel()) == (cut, cut * 1000) and not big[0].any()
    again = launch.split_tail_buffers(cpu, 2, 50)
    assert again[1].data_ptr() == big[1].data_ptr()  # smaller sizes now view the grown pair
    assert len(launch._STREAM_BUFFERS) == 1
    (held,) = launch._STREAM_BUFFERS.values()
    assert (held.counters.numel(), held.partials.numel()) == (39, 39000)


def test_capture_gets_its_own_split_workspace(monkeypatch):
    _one_stream(monkeypatch)
    cpu = torch.device("cpu")
    eager = launch.split_tail_buffers(cpu, 4, 100)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    captured = launch.split_tail_buffers(cpu, 4, 100)
    assert captured[1].data_ptr() != eager[1].data_ptr() and not captured[0].any()
    assert any(held.partials.data_ptr() == captured[1].data_ptr() for held in launch._GRAPH_BUFFERS)
