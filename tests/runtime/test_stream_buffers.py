"""The scheduling buffers the launcher hands kernels (`runtime.launch.tile_counter`, `scheduler_workspace`,
`split_tail_buffers`): shared by launches on one stream, never across streams or kinds, one split-tail workspace per
stream for every size, and under CUDA-graph capture a set of its own for every launch, which nothing else keeps (CPU:
the stream handle and the capture state are stubbed)."""
from __future__ import annotations

import dataclasses

import torch

from flexlab.kernels.config import FwdConfig
from flexlab.runtime import launch


def _one_stream(monkeypatch):
    """Stream 11, no buffers yet, not capturing."""
    monkeypatch.setattr(launch, "_current_raw_stream", lambda index: 11)
    monkeypatch.setattr(launch, "_STREAM_BUFFERS", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


def _capturing(monkeypatch):
    """From now on the stream is being captured."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)


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


def test_each_captured_launch_gets_buffers_nothing_keeps(monkeypatch):
    """A graph is replayed later, maybe beside eager launches or another graph: each of its launches gets zeroed
    buffers of its own (allocated in the capture, so from the graph's pool and zeroed by a node of the graph), and the
    launcher keeps no reference to them, so they are freed with the graph."""
    import gc
    import weakref
    _one_stream(monkeypatch)
    cpu = torch.device("cpu")
    eager = launch.tile_counter(cpu)
    split = FwdConfig(head_dim=128, persistent_ctas=132, cluster_m=2, split_tail=True)
    eager_split = launch.scheduler_workspace(split, cpu)
    _capturing(monkeypatch)
    first, second = launch.tile_counter(cpu), launch.tile_counter(cpu)
    assert first is not eager and second is not first and first.tolist() == [0] == second.tolist()
    arrivals, partials = launch.scheduler_workspace(split, cpu)
    assert (arrivals.numel(), partials.numel()) == split.split_tail_workspace() and not arrivals.any()
    assert partials.data_ptr() != eager_split[1].data_ptr() and arrivals.data_ptr() != eager_split[0].data_ptr()
    assert launch.scheduler_workspace(split, cpu)[1].data_ptr() != partials.data_ptr()
    gone = [weakref.ref(t) for t in (first, second, arrivals, partials)]
    del first, second, arrivals, partials
    gc.collect()
    assert all(ref() is None for ref in gone), "the launcher kept a captured launch's buffer"
    assert len(launch._STREAM_BUFFERS) == 2  # the eager counter and split workspace only
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert launch.tile_counter(cpu) is eager


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
