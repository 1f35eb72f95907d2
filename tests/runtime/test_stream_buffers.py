"""The scheduling buffers the launcher hands kernels (`runtime.launch.tile_counter`, `scheduler_workspace`,
`split_tail_buffers`): shared by launches on one stream, never across streams or kinds, one split-tail workspace per
stream for every size, and under CUDA-graph capture a set per capture (CPU: the stream handle and the capture state
are stubbed)."""
from __future__ import annotations

import dataclasses

import torch

from flexlab.kernels.config import FwdConfig
from flexlab.runtime import launch


def _one_stream(monkeypatch):
    """Stream 11, no buffers yet, not capturing."""
    monkeypatch.setattr(launch, "_current_raw_stream", lambda index: 11)
    monkeypatch.setattr(launch, "_STREAM_BUFFERS", {})
    monkeypatch.setattr(launch, "_GRAPH_BUFFERS", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


def _capturing(monkeypatch, capture: dict):
    """From now on the stream is being captured, as capture["id"] (None: a capture the driver does not name)."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(launch, "_capture_id", lambda handle: capture["id"])


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
    """A graph is replayed later, maybe beside eager launches or another graph: its launches share buffers of their
    own, one set per capture; a capture the driver does not name gets one per launch."""
    _one_stream(monkeypatch)
    cpu = torch.device("cpu")
    eager = launch.tile_counter(cpu)
    capture = {"id": 7}
    _capturing(monkeypatch, capture)
    first = launch.tile_counter(cpu)
    assert first is not eager and launch.tile_counter(cpu) is first  # launches of one graph run in stream order
    capture["id"] = 8
    second = launch.tile_counter(cpu)
    assert second is not first and launch.tile_counter(cpu) is second
    capture["id"] = None
    unnamed = [launch.tile_counter(cpu), launch.tile_counter(cpu)]
    assert unnamed[0] is not unnamed[1] and all(u is not first and u is not second for u in unnamed)
    kept = list(launch._GRAPH_BUFFERS.values())  # kept for the graphs' life
    assert all(any(c is k for k in kept) for c in [first, second] + unnamed)
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


def test_capture_gets_its_own_split_workspace(monkeypatch):
    _one_stream(monkeypatch)
    cpu = torch.device("cpu")
    eager = launch.split_tail_buffers(cpu, 4, 100)
    _capturing(monkeypatch, {"id": 3})
    captured = launch.split_tail_buffers(cpu, 4, 100)
    assert captured[1].data_ptr() != eager[1].data_ptr() and not captured[0].any()
    (held,) = launch._GRAPH_BUFFERS.values()
    assert held.partials.data_ptr() == captured[1].data_ptr()
    # grown within the capture: the pair the graph's earlier launches use stays alive with the new one
    grown = launch.split_tail_buffers(cpu, 8, 1000)
    assert grown[1].data_ptr() != captured[1].data_ptr() and not grown[0].any()
    assert [(c.data_ptr(), p.data_ptr()) for c, p in held.retired] == [(captured[0].data_ptr(), captured[1].data_ptr())]
    assert launch.split_tail_buffers(cpu, 4, 100)[1].data_ptr() == grown[1].data_ptr()
