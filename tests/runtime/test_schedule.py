"""The host mirror of the CTA order: every tile exactly once, heavy ranks first inside each L2 head group."""
from __future__ import annotations

import torch

from flexlab.runtime.schedule import heads_per_group, issue_order


def test_every_tile_issued_once_with_partial_last_group():
    order = torch.tensor([3, 2, 1, 0], dtype=torch.int32)
    tiles = issue_order(4, 5, 2, order)
    assert tiles.shape == (20, 2)
    assert len({tuple(t) for t in tiles.tolist()}) == 20
    # first group: heads 0-1, rank 0 (tile 3) for both heads before rank 1
    assert tiles[:4].tolist() == [[3, 0], [3, 1], [2, 0], [2, 1]]
    assert tiles[-2:].tolist() == [[1, 4], [0, 4]]  # last group holds one head


def test_group_size_follows_l2_budget():
    assert heads_per_group(16384, 128, 2, 1, 16) == 4  # 8 MiB of K+V per head, 32 MiB budget
    assert heads_per_group(16384, 128, 2, 4, 16) == 16  # GQA: four query heads share one K/V
    assert heads_per_group(1 << 22, 256, 2, 1, 8) == 1


def test_dense_grids_take_narrower_groups():
    # Without a block mask every Q tile streams all K/V of its head: an 8 MiB budget, so 4 heads at S=4k, D=128.
    assert heads_per_group(4096, 128, 2, 1, 64, block_sparse=False) == 4
    assert heads_per_group(4096, 128, 2, 1, 64, block_sparse=True) == 16
    assert heads_per_group(16384, 128, 2, 1, 16, block_sparse=False) == 1
    assert heads_per_group(4096, 128, 2, 1, 64, l2_budget_bytes=16 << 20) == 8
