"""The split tail's partition (`kernels.split_tail.SplitTail`, run here on Python ints as the kernel runs it on
Int32): the units the kernel's loops walk cover every block of the tail once, runs are even, a cut tile's parts are
counted as the kernel counts them, and everything indexes inside the workspace the launcher allocates (CPU only)."""
from __future__ import annotations

import dataclasses
import itertools

import pytest

pytest.importorskip("cutlass")

from flexlab.kernels.config import SPLIT_TAIL_SLOTS, FwdConfig  # noqa: E402
from flexlab.kernels.split_tail import SplitTail  # noqa: E402


def _units(split: SplitTail) -> list[tuple[int, int, int]]:
    """(tail tile, first position, end position) of one worker's run, walked as the kernel's loops walk it."""
    out, it = [], split.begin
    while it < split.end:
        t, first, end = split.unit(it)
        out.append((t, first, end))
        it = (t + 1) * split.blocks
    return out


CASES = list(itertools.product((1, 5, 16, 96, 131, 132, 133, 200, 2048, 1024), (1, 3, 7, 66, 132), (1, 2, 9, 32)))


@pytest.mark.parametrize("num_tiles,workers,blocks", CASES)
def test_every_tail_block_is_computed_once_in_even_runs(num_tiles, workers, blocks):
    splits = [SplitTail(num_tiles, workers, w, blocks) for w in range(workers)]
    whole_end = splits[0].whole_end
    assert whole_end % workers == 0 and 0 <= whole_end <= num_tiles  # whole rounds: one tile per worker each
    tail = num_tiles - whole_end
    covered = {}
    for w, split in enumerate(splits):
        assert split.end - split.begin in (tail * blocks // workers, -(-tail * blocks // workers))  # even runs
        for t, first, end in _units(split):
            assert 0 <= t < tail and 0 <= first < end <= blocks
            for pos in range(first, end):
                assert (t, pos) not in covered
                covered[(t, pos)] = w
    assert len(covered) == tail * blocks
    for t in range(tail):  # the parts the kernel counts for a tile are the workers that computed one
        split = splits[0]
        first, last = split.worker_of(t * blocks), split.worker_of((t + 1) * blocks - 1)
        assert {covered[(t, p)] for p in range(blocks)} == set(range(first, last + 1))


@pytest.mark.parametrize("num_tiles,workers,blocks", [c for c in CASES if c[0] >= c[1]])
def test_with_a_whole_round_a_tile_has_at_most_three_parts(num_tiles, workers, blocks):
    splits = [SplitTail(num_tiles, workers, w, blocks) for w in range(workers)]
    tail = num_tiles - splits[0].whole_end
    assert tail < 2 * workers and (tail == 0 or 2 * tail >= workers)  # each run: half a tile to one and a half
    for t in range(tail):
        assert splits[0].worker_of((t + 1) * blocks - 1) - splits[0].worker_of(t * blocks) < 3


@pytest.mark.parametrize("num_tiles,workers,blocks", CASES)
def test_each_worker_publishes_into_its_own_two_slots(num_tiles, workers, blocks):
    for w in range(workers):
        split = SplitTail(num_tiles, workers, w, blocks)
        cut = [t for t, first, end in _units(split) if end - first < blocks]
        slots = [split.slot_of(w, t) for t in cut]
        assert len(cut) <= SPLIT_TAIL_SLOTS and len(set(slots)) == len(slots) and set(slots) <= {0, 1}


@pytest.mark.parametrize("cluster_m,tile_m,head_dim", [(1, 128, 128), (2, 128, 128), (2, 192, 64), (1, 128, 64)])
def test_the_workspace_holds_every_counter_and_slot(cluster_m, tile_m, head_dim):
    cfg = FwdConfig(head_dim=head_dim, tile_m=tile_m, num_stages=3 if tile_m == 192 else 2, persistent_ctas=132,
                    cluster_m=cluster_m, split_tail=True).validate()
    counters, floats = cfg.split_tail_workspace()
    workers = cfg.persistent_ctas // cluster_m
    threads = 128 * cfg.num_consumer_wgs
    slot = threads * (head_dim // 2 + 2)  # O fragment and two LSE rows per thread (`publish_and_arrive`)
    for num_tiles in (1, 65, 66, 67, 100, 131, 132, 1000, 1024):
        split = SplitTail(num_tiles, workers, 0, 32)
        tail = num_tiles - split.whole_end
        assert tail * cluster_m <= counters  # one counter per tail tile and CTA of a cluster
    assert floats == cfg.persistent_ctas * SPLIT_TAIL_SLOTS * slot


def test_split_tail_needs_a_static_persistent_dense_grid():
    base = FwdConfig(head_dim=128, split_tail=True)
    assert "persistent_ctas" in base.feasibility_error()
    assert dataclasses.replace(base, persistent_ctas=132).feasibility_error() is None
    assert dataclasses.replace(base, persistent_ctas=132, dynamic_tiles=True).feasibility_error()
    assert dataclasses.replace(base, persistent_ctas=132, mask_bits=True).feasibility_error()
