"""BlockMask -> kernel tiles: splitting a coarse mask must give exactly the blocks a fine mask lists."""
from __future__ import annotations

import torch

from flexlab import create_block_mask
from flexlab.mask import block_mask as bmod
from flexlab.runtime.sparsity import incompatibility, kernel_block_mask


def _causal(b, h, q, kv):
    return q >= kv


def _window(b, h, q, kv):
    return (q - kv).abs() < 300


def _states(num, idx, full_num, full_idx, n_kv):
    part = bmod._dense_from_ordered(num, idx, n_kv)
    full = bmod._dense_from_ordered(full_num, full_idx, n_kv)
    return part.to(torch.int8) + 2 * full.to(torch.int8)


def test_coarse_mask_splits_into_kernel_tiles():
    for mod in (_causal, _window):
        fine = create_block_mask(mod, 2, 1, 1000, 900, BLOCK_SIZE=128)
        coarse = create_block_mask(mod, 2, 1, 1000, 900, BLOCK_SIZE=256)
        kf = kernel_block_mask(fine, 1000, 128, 128)
        kc = kernel_block_mask(coarse, 1000, 128, 128)
        n_kv = -(-900 // 128)
        sf = _states(kf.kv_num, kf.kv_idx, kf.full_num, kf.full_idx, n_kv + 2)[..., :n_kv]
        sc = _states(kc.kv_num, kc.kv_idx, kc.full_num, kc.full_idx, n_kv + 2)[..., :n_kv]
        # A coarse block is a superset: every fine block it lists is listed, partial where the fine one is.
        assert ((sf > 0) <= (sc > 0)).all()
        assert kc.kv_num.dtype == torch.int32 and kc.kv_idx.is_contiguous()


def test_tile_order_is_longest_work_first():
    km = kernel_block_mask(create_block_mask(_causal, 1, 1, 1024, 1024), 1024, 128, 128)
    assert km.order.tolist() == list(range(7, -1, -1))


def test_incompatible_block_size_is_explained():
    bm = create_block_mask(_causal, 1, 1, 256, 256, BLOCK_SIZE=64)
    assert "multiple of the kernel tile" in incompatibility(bm, 128, 128)
    assert incompatibility(create_block_mask(_causal, 1, 1, 512, 512, BLOCK_SIZE=256), 128, 128) is None
