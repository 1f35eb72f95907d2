"""The split tail's partitions (`kernels.split_tail.SplitTail` and the backward's `TailPiece`, run here on Python
ints as the kernels run them on Int32): the units the kernels' loops walk cover every block (or query step) of the
tail once, shares are even, a cut tile's parts are counted as the kernel counts them, and everything indexes inside
the workspace the launcher allocates (CPU only)."""
from __future__ import annotations

import dataclasses
import itertools

import pytest

pytest.importorskip("cutlass")

from flexlab.kernels.config import SPLIT_TAIL_SLOTS, FwdConfig  # noqa: E402
from flexlab.kernels.split_tail import SplitTail, TailPiece  # noqa: E402


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


# ---------------------------------------------------------------------------------------------- the backward's form
def _pieces(num_tiles: int, workers: int, steps: int, parts: int) -> tuple[int, list[TailPiece]]:
    """(whole tiles, every CTA's `TailPiece` of the parts' kernel) as the launcher launches them
    (`bwd_launch._build_plan`): the whole tiles' kernel takes the tiles below the first."""
    whole = num_tiles - num_tiles % workers
    return whole, [TailPiece(b, whole, parts, steps) for b in range((num_tiles - whole) * parts)]


BWD_CASES = list(itertools.product((1, 7, 131, 132, 133, 200, 1024, 2048, 4096), (132, 66), (1, 5, 52, 205),
                                   (2, 3, 5, 8)))


@pytest.mark.parametrize("num_tiles,workers,steps,parts", BWD_CASES)
def test_backward_parts_cover_every_step_of_every_cut_tile_once(num_tiles, workers, steps, parts):
    whole, pieces = _pieces(num_tiles, workers, steps, parts)
    assert num_tiles - whole < workers  # whole waves in the first kernel, less than one wave cut
    seen = {}
    for p in pieces:
        assert whole <= p.tile < num_tiles and 0 <= p.lo <= p.hi <= steps
        for s in range(p.lo, p.hi):
            assert (p.tile, s) not in seen
            seen[p.tile, s] = p
    assert len(seen) == (num_tiles - whole) * steps
    # each cut tile: `parts` CTAs with one counter, slots 0.. of the workspace, each its own
    assert sorted(p.slot(p.part) for p in pieces) == list(range(len(pieces)))
    for p in pieces:
        assert p.t == p.tile - whole and 0 <= p.part < parts
        # the shares are even: no part walks more than one step more than another
        assert steps // parts <= p.hi - p.lo <= -(-steps // parts)


@pytest.mark.parametrize("group,num_m_blocks,parts", [(1, 52, 3), (4, 13, 3), (4, 13, 5), (8, 3, 7), (2, 1, 2)])
def test_backward_parts_split_a_gqa_groups_steps_head_by_head(group, num_m_blocks, parts):
    """The steps count the group's query heads one after another; each head's share is a (first, end) range of its
    query tiles, as `KvSchedule(part=...)` walks it, and together the parts walk each head's tiles once."""
    steps = group * num_m_blocks
    walked = []
    for part in range(parts):
        piece = TailPiece(part, 0, parts, steps)
        for g in range(group):
            first, end = piece.head_steps(g, num_m_blocks)
            assert 0 <= first <= end <= num_m_blocks
            walked += [(g, i) for i in range(first, end)]
    assert sorted(walked) == [(g, i) for g in range(group) for i in range(num_m_blocks)]


def test_backward_cuts_the_last_wave_where_the_parts_end_sooner():
    from flexlab.kernels.bwd_config import (MAX_TAIL_PARTS, MIN_TAIL_PART_STEPS, TAIL_PART_COST_STEPS,
                                            WHOLE_TILE_COST_STEPS, BwdConfig, split_parts)
    # 2048 tiles on 132 SMs leave 68 for a 16th wave: 3 parts of 52 steps end two waves of 18 + 3 later (not 54)
    assert split_parts(2048, 132, 52) == 3
    assert split_parts(2048, 132, 205) == 5
    assert split_parts(2112, 132, 52) == 1  # whole waves: nothing to cut
    assert split_parts(1024, 132, 52) == 1  # 100 tiles left: 2 parts need 2 waves of 29 > 54, 3 parts 3 of 21
    assert split_parts(2048, 132, 5) == 1  # parts under MIN_TAIL_PART_STEPS steps
    for tiles, steps in itertools.product((1, 100, 133, 2048, 4097), (1, 4, 8, 52, 205, 1000)):
        parts = split_parts(tiles, 132, steps)
        assert 1 <= parts <= MAX_TAIL_PARTS
        if parts > 1:  # taken only when it ends the tail sooner than one whole wave
            tail = tiles % 132
            cost = -(-parts * tail // 132) * (-(-steps // parts) + TAIL_PART_COST_STEPS)
            assert cost < steps + WHOLE_TILE_COST_STEPS and -(-steps // parts) >= MIN_TAIL_PART_STEPS
    for ok in (BwdConfig(head_dim=128, split_tail=True), BwdConfig(head_dim=128, whole_tiles_only=True)):
        assert ok.feasibility_error() is None and ok.smem_bytes() == BwdConfig(head_dim=128).smem_bytes()
    for bad in (BwdConfig(head_dim=128, split_tail=True, persistent_ctas=132),
                BwdConfig(head_dim=128, split_tail=True, lpt_order=True),
                BwdConfig(head_dim=128, whole_tiles_only=True, kv_tiles_first=False),
                BwdConfig(head_dim=128, split_tail=True, whole_tiles_only=True)):
        assert "split_tail" in bad.feasibility_error()
