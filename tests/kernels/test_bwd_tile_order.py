"""The backward's CTA order with a block mask (`BwdConfig.lpt_order`, `bwd_launch.lpt_tile_order`): every
(KV tile, KV head, batch) once, head groups that fit the L2 budget, longest tiles first inside a group; and the
deterministic mode's turn order (`bwd_launch.turn_tile_order`) (CPU only)."""
from __future__ import annotations

import pytest
import torch

from flexlab.kernels import bwd_config
from flexlab.kernels.bwd_config import BwdConfig, default_bwd_config
from flexlab.kernels.bwd_launch import (QLists, l2_head_groups, lpt_tile_order, q_direction_tensors,
                                        turn_tile_order)
from flexlab.mask.build import create_block_mask


def _lists(mask_mod, B, H, S, cfg):
    bm = create_block_mask(mask_mod, B, H, S, S)
    lists = [bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices, bm.q_num_blocks,
             bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices]
    return q_direction_tensors(lists, bm.BLOCK_SIZE, cfg, S)


def _work(sparse, b, h_q):
    num, _, fnum, _ = sparse
    return (num + fnum)[b % num.shape[0], h_q % num.shape[1]]


@pytest.mark.parametrize("B,Hkv,qpk,S,per_head", [(4, 16, 1, 4096, False), (1, 4, 4, 2048, True),
                                                  (2, 3, 2, 1024, True)])
def test_order_is_a_grouped_longest_first_permutation(B, Hkv, qpk, S, per_head, monkeypatch):
    cfg = BwdConfig(head_dim=128)
    window = torch.tensor([64, 300, 900, 2000]).repeat(Hkv * qpk)

    def mask_mod(b, h, q_idx, kv_idx):  # causal, and per head a window of its own where the lists vary by head
        return (q_idx >= kv_idx) & ((q_idx - kv_idx <= window[h]) if per_head else (q_idx >= 0))
    sparse = _lists(mask_mod, None, Hkv * qpk if per_head else None, S, cfg)
    budget = 2 * qpk * S * 128 * 8  # two (batch, KV head) pairs per group at most
    monkeypatch.setattr(bwd_config, "LPT_GROUP_L2_BYTES", budget)
    order = lpt_tile_order(sparse, B, Hkv, qpk, S, 128)
    n_kv = S // 128
    assert order.dtype == torch.int32 and order.shape == (B * Hkv * n_kv, 3) and order.is_contiguous()
    triples = [tuple(r) for r in order.tolist()]
    assert sorted(triples) == sorted((n, h, b) for b in range(B) for h in range(Hkv) for n in range(n_kv))
    pairs = B * Hkv
    groups = -(-pairs // 2)
    bounds = [round(g * pairs / groups) for g in range(groups + 1)]  # even groups, sizes differing by one at most
    start = 0
    for lo, hi in zip(bounds, bounds[1:]):
        chunk = triples[start:start + (hi - lo) * n_kv]
        start += len(chunk)
        assert {b * Hkv + h for _, h, b in chunk} == set(range(lo, hi))  # a group's pairs, and only those
        work = [sum(int(_work(sparse, b, h * qpk + g)[n]) for g in range(qpk)) for n, h, b in chunk]
        assert work == sorted(work, reverse=True)
        ties = [(b * Hkv + h, n) for (n, h, b), w in zip(chunk, work) if w == work[0]]
        assert ties == sorted(ties)  # equal work keeps (head, tile) order


def test_the_launcher_orders_block_sparse_tiles_and_deterministic_turns():
    assert default_bwd_config(128, q_block=128).lpt_order
    assert not default_bwd_config(128).lpt_order  # no block mask: every KV tile walks every Q tile
    # deterministic mode: the launcher's turn order, with or without a block mask (`turn_tile_order`)
    assert default_bwd_config(128, deterministic=True, q_block=128).lpt_order
    assert default_bwd_config(128, deterministic=True).lpt_order
    assert default_bwd_config(256, deterministic=True).lpt_order


def test_groups_follow_the_l2_budget():
    # 4 MiB of Q, dO and dQ sums per (batch, head) at S=4096, D=128: 48 MiB hold 12 pairs, so 64 pairs make 6 even
    # groups, each a contiguous run of the order holding its pairs' tiles only
    cfg = BwdConfig(head_dim=128)
    sparse = _lists(lambda b, h, q, kv: q >= kv, None, None, 4096, cfg)
    order = lpt_tile_order(sparse, 4, 16, 1, 4096, 128)
    pair = (order[:, 2] * 16 + order[:, 1]).tolist()
    prefix_max = list(torch.tensor(pair).cummax(0).values.tolist())
    suffix_min = list(reversed(torch.tensor(pair[::-1]).cummin(0).values.tolist()))
    cuts = [i for i in range(1, len(pair)) if prefix_max[i - 1] < suffix_min[i]]
    assert bwd_config.LPT_GROUP_L2_BYTES == 48 << 20
    assert len(cuts) + 1 == 6
    sizes = [b - a for a, b in zip([0] + cuts, cuts + [len(pair)])]
    assert {s // 32 for s in sizes} == {10, 11}  # 32 KV tiles per pair


@pytest.mark.parametrize("higher_first", [False, True])
def test_turn_order_launches_every_waited_for_tile_first(higher_first):
    """Deterministic mode's CTA order: every (KV tile, head, batch) once; inside each L2 head group the heads take
    turns at each KV tile; a CTA's turn on a Q tile comes after every tile of its head launched before it."""
    B, Hkv, G, S, D, n_kv = 3, 4, 2, 4096, 128, 5
    order = turn_tile_order(n_kv, B, Hkv, G, S, D, higher_first, "cpu")
    assert order.dtype == torch.int32 and order.shape == (B * Hkv * n_kv, 3)
    assert len({tuple(r) for r in order.tolist()}) == B * Hkv * n_kv
    bounds = l2_head_groups(B, Hkv, G, S, D)
    assert len(bounds) > 2 and bounds[-1] == B * Hkv  # several groups at this size
    assert bounds == sorted(bounds) and max(b - a for a, b in zip(bounds, bounds[1:])) * G * S * D * 8 \
        <= bwd_config.LPT_GROUP_L2_BYTES
    first = order[: n_kv * bounds[1]]  # the first group: its heads take turns at each tile
    tiles = first[:, 0].view(n_kv, bounds[1])
    assert (tiles == tiles[:, :1]).all()
    assert tiles[:, 0].tolist() == (list(range(n_kv))[::-1] if higher_first else list(range(n_kv)))
    seen = {}
    for tile, h, b in order.tolist():  # per (batch, head), tiles come in the ranks' order
        prev = seen.get((b, h))
        if prev is not None:
            assert tile == (prev - 1 if higher_first else prev + 1)
        seen[b, h] = tile


def test_deterministic_walk_goes_in_q_order_where_partial_tiles_follow_full_ones():
    """A sliding window lists each KV tile's far edge (partial) before its inside (full); deterministic mode's
    highest-first dQ turns need every tile to walk its Q tiles in ascending order, so such tiles walk one merged,
    ascending list (all partial). Causal tiles, whose partial diagonal comes first, keep their lists."""
    from flexlab.kernels.bwd_launch import visit_ranks, walk_in_q_order
    cfg = default_bwd_config(128, deterministic=True, q_block=128)
    S = 2048
    m_tiles = S // cfg.tile_m

    def listed(lists, b, h, n):
        num, idx, fnum, fidx = lists
        return idx[b, h, n, : num[b, h, n]].tolist() + fidx[b, h, n, : fnum[b, h, n]].tolist()

    def window(b, h, q, kv):
        return (q >= kv) & (q - kv < 700)
    for mask_mod, reorders in ((window, True), (lambda b, h, q, kv: q >= kv, False)):
        lists = _lists(mask_mod, None, None, S, cfg)
        walked = walk_in_q_order(lists, m_tiles)
        assert all(t.is_contiguous() for t in walked)
        changed = 0
        for n in range(lists[0].shape[2]):
            before, after = listed(lists, 0, 0, n), listed(walked, 0, 0, n)
            assert sorted(before) == sorted(after)  # the same Q tiles, each once
            if after != before:
                changed += 1
                assert after == sorted(after) and walked[2][0, 0, n] == 0  # one ascending list, all partial
        assert (changed > 0) == reorders
        # every tile now reaches each Q tile after the next higher tile did: the turn order's premise
        ranks = visit_ranks(walked, m_tiles, higher_first=True)
        for m in range(m_tiles):
            visitors = [n for n in range(lists[0].shape[2]) if m in listed(walked, 0, 0, n)]
            steps = [listed(walked, 0, 0, n).index(m) for n in visitors]
            assert [int(ranks[0, 0, n, m]) for n in visitors] == list(range(len(visitors)))[::-1]
            assert steps == sorted(steps, reverse=True), (m, visitors, steps)  # higher tiles got there first


def test_memoised_order_follows_the_l2_budget(monkeypatch):
    # a mask's lists keep their CTA order between calls: a budget changed at run time (a notebook, a probe) must give
    # the order of the new budget, not the one built first
    cfg = BwdConfig(head_dim=128)
    lists = QLists(_lists(lambda b, h, q, kv: q >= kv, None, None, 4096, cfg), ())
    wide = lists.tile_order(4, 16, 1, 4096, 128)
    monkeypatch.setattr(bwd_config, "LPT_GROUP_L2_BYTES", 8 << 20)
    narrow = lists.tile_order(4, 16, 1, 4096, 128)
    assert torch.equal(narrow, lpt_tile_order(lists.tensors, 4, 16, 1, 4096, 128))
    assert not torch.equal(narrow, wide)
    monkeypatch.setattr(bwd_config, "LPT_GROUP_L2_BYTES", 48 << 20)
    assert lists.tile_order(4, 16, 1, 4096, 128) is wide
