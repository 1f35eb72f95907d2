"""BlockMask -> kernel tiles: splitting a coarse mask must give exactly the blocks a fine mask lists."""
from __future__ import annotations

import pytest
import torch

from flexlab import create_block_mask
from flexlab.mask import block_mask as bmod
from flexlab.runtime.sparsity import incompatibility, kernel_block_mask, ragged_first_offset


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
        kf = kernel_block_mask(fine, 1000, 128, 128, 900)
        kc = kernel_block_mask(coarse, 1000, 128, 128, 900)
        n_kv = -(-900 // 128)
        sf = _states(kf.kv_num, kf.kv_idx, kf.full_num, kf.full_idx, n_kv + 2)[..., :n_kv]
        sc = _states(kc.kv_num, kc.kv_idx, kc.full_num, kc.full_idx, n_kv + 2)[..., :n_kv]
        # A coarse block is a superset: every fine block it lists is listed, partial where the fine one is.
        assert ((sf > 0) <= (sc > 0)).all()
        assert kc.kv_num.dtype == torch.int32 and kc.kv_idx.is_contiguous()


def test_tile_order_is_longest_work_first():
    km = kernel_block_mask(create_block_mask(_causal, 1, 1, 1024, 1024), 1024, 128, 128, 1024)
    assert km.order.tolist() == list(range(7, -1, -1))


def _everything(b, h, q, kv):
    return q >= 0


def _kernel_walk(q, k, v, mask_mod, kbm, tile_m, tile_n, q_offset=0):
    """float64 attention as the forward kernel computes it: whole padded KV tiles (keys past Skv are zero rows, as TMA
    fills them), the listed blocks in list order, mask_mod on partial blocks (evaluated on padded columns too), and
    the key-tail mask on the first visited block only. Q tile t starts at row t * tile_m - `q_offset`."""
    S, Skv, D = q.shape[0], k.shape[0], q.shape[1]
    n_kv = -(-Skv // tile_n)
    kp = torch.zeros(n_kv * tile_n, D, dtype=q.dtype)
    vp = torch.zeros_like(kp)
    kp[:Skv], vp[:Skv] = k, v
    out = torch.zeros_like(q)
    for t in range(kbm.kv_num.shape[-1]):
        rows = torch.arange(max(0, t * tile_m - q_offset), min((t + 1) * tile_m - q_offset, S))
        blocks = [(j, True) for j in kbm.kv_idx[0, 0, t, :int(kbm.kv_num[0, 0, t])].tolist()]
        blocks += [(j, False) for j in kbm.full_idx[0, 0, t, :int(kbm.full_num[0, 0, t])].tolist()]
        s = torch.full((len(rows), n_kv * tile_n), float("-inf"), dtype=torch.float64)
        for step, (j, partial) in enumerate(blocks):
            cols = torch.arange(j * tile_n, (j + 1) * tile_n)
            block = q[rows] @ kp[cols].T
            if partial:
                # column indices clamped to the last key, as the kernel does for mods that read captured tensors
                keep = mask_mod(0, 0, rows[:, None], cols.clamp(max=Skv - 1)[None, :])
                block = block.masked_fill(~keep, float("-inf"))
            if step == 0:
                block = block.masked_fill(cols[None, :] >= Skv, float("-inf"))
            s[:, cols] = block
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        out[rows] = p @ vp
    return out


def test_ragged_last_kv_block_comes_first():
    # The forward kernel masks the key tail only on the first block it visits: wherever a Q tile visits the ragged
    # last KV block, the lists must start with it (as a partial block), and otherwise hold the same blocks.
    g = torch.Generator().manual_seed(1)
    for mod, S, skv, tile_m in ((_everything, 1000, 1000, 128), (_window, 1000, 900, 128), (_causal, 1000, 1000, 128),
                                (_causal, 1000, 1000, 192), (_doc_mask(1000), 1000, 1000, 192),
                                (_everything, 300, 1000, 128)):
        bm = create_block_mask(mod, 1, 1, S, skv, BLOCK_SIZE=128)
        n_kv = -(-skv // 128)
        plain = kernel_block_mask(bm, S, tile_m, 128, n_kv * 128)  # a tile multiple: lists as torch gave them
        kbm = kernel_block_mask(bm, S, tile_m, 128, skv)
        before = _states(plain.kv_num, plain.kv_idx, plain.full_num, plain.full_idx, n_kv)
        after = _states(kbm.kv_num, kbm.kv_idx, kbm.full_num, kbm.full_idx, n_kv)
        expect = before.clone()
        expect[..., -1][expect[..., -1] == 2] = 1
        assert torch.equal(after, expect), mod.__name__
        visits = after[..., -1] > 0
        assert bool((kbm.kv_idx[..., 0][visits] == n_kv - 1).all())
        assert kbm.kv_num.dtype == torch.int32 and kbm.kv_idx.is_contiguous() and kbm.full_idx.is_contiguous()
        q, k, v = (torch.randn(n, 16, generator=g, dtype=torch.float64) for n in (S, skv, skv))
        keep = mod(0, 0, torch.arange(S)[:, None], torch.arange(skv)[None, :])
        ref = torch.softmax((q @ k.T).masked_fill(~keep, float("-inf")), dim=-1).nan_to_num(0.0) @ v
        assert (_kernel_walk(q, k, v, mod, kbm, tile_m, 128) - ref).abs().max() < 1e-12, mod.__name__
        pad = torch.arange(skv, n_kv * 128)
        if bool(mod(0, 0, torch.arange(S)[:, None], pad.clamp(max=skv - 1)[None, :]).any()):
            # mask_mod keeps some padded keys: the lists as torch gave them, walked the same way, leave them in
            assert (_kernel_walk(q, k, v, mod, plain, tile_m, 128) - ref).abs().max() > 1e-8, mod.__name__


def test_incompatible_block_size_is_explained():
    bm = create_block_mask(_causal, 1, 1, 256, 256, BLOCK_SIZE=64)
    assert "multiple of the kernel tile" in incompatibility(bm, 128, 128)
    assert incompatibility(create_block_mask(_causal, 1, 1, 512, 512, BLOCK_SIZE=256), 128, 128) is None


# ------------------------------------------------------------------ 192-row tiles over a mask built at 128
def _doc_mask(S, n_docs=3):
    doc = torch.arange(S) * n_docs // S

    def mod(b, h, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv)
    return mod


def _walk(q, k, v, mask_mod, kbm, tile_m, tile_n):
    """float64 attention computed the way the kernel walks the lists: per Q tile, the listed partial blocks with
    mask_mod applied and the full blocks without it; unlisted blocks contribute nothing."""
    S, Skv = q.shape[0], k.shape[0]
    out = torch.zeros_like(q)
    for t in range(kbm.kv_num.shape[-1]):
        rows = torch.arange(t * tile_m, min((t + 1) * tile_m, S))
        s = torch.full((len(rows), Skv), float("-inf"), dtype=torch.float64)
        lists = ((kbm.kv_num, kbm.kv_idx, True), (kbm.full_num, kbm.full_idx, False))
        for num, idx, apply_mod in lists:
            for j in idx[0, 0, t, :int(num[0, 0, t])].tolist():
                cols = torch.arange(j * tile_n, min((j + 1) * tile_n, Skv))
                block = q[rows] @ k[cols].T
                if apply_mod:
                    keep = mask_mod(0, 0, rows[:, None], cols[None, :])
                    block = block.masked_fill(~keep, float("-inf"))
                s[:, cols] = block
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        out[rows] = p @ v
    return out


def test_merged_192_row_tiles_compute_the_same_attention():
    S, tile_m, tile_n = 1000, 192, 128
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(S, 16, generator=g, dtype=torch.float64) for _ in range(3))
    for mod in (_causal, _window, _doc_mask(S)):
        bm = create_block_mask(mod, 1, 1, S, S, BLOCK_SIZE=128)
        assert incompatibility(bm, tile_m, tile_n) is None  # 192 merges the 128-row mask blocks it straddles
        kbm = kernel_block_mask(bm, S, tile_m, tile_n, S)
        assert kbm.kv_num.shape[-1] == -(-S // tile_m) and kbm.kv_idx.dtype == torch.int32
        keep = mod(0, 0, torch.arange(S)[:, None], torch.arange(S)[None, :])
        ref = torch.softmax((q @ k.T).masked_fill(~keep, float("-inf")), dim=-1) @ v
        assert (_walk(q, k, v, mod, kbm, tile_m, tile_n) - ref).abs().max() < 1e-12


def test_merged_tiles_skip_and_trust_only_what_every_covered_row_says():
    S = 1024
    bm = create_block_mask(_causal, 1, 1, S, S, BLOCK_SIZE=128)
    kbm = kernel_block_mask(bm, S, 192, 128, S)
    n_kv = S // 128
    states = _states(kbm.kv_num, kbm.kv_idx, kbm.full_num, kbm.full_idx, n_kv + 2)[0, 0, :, :n_kv]
    # Tile 1 covers rows 192..383: mask rows 1 and 2. Block 0 is full in both, block 1 full in row 2 but partial in
    # row 1 (so partial), block 2 partial in row 2 and empty in row 1 (so partial), block 3 empty in both.
    assert states[1, :4].tolist() == [2, 1, 1, 0]
    assert kbm.order.tolist()[0] == int(torch.argmax((states > 0).sum(-1)))


def test_merging_stays_opt_in_for_power_of_two_tiles():
    bm = create_block_mask(_causal, 1, 1, 256, 256, BLOCK_SIZE=(64, 128))
    assert "multiple of the kernel tile" in incompatibility(bm, 128, 128)
    assert incompatibility(bm, 192, 128) is None


# ------------------------------------------------------------------ 80-key tiles over a mask built at 128
def test_merged_80_key_tiles_compute_the_same_attention():
    # D=256 kernels may take 80-key tiles under a mask at torch's 128 (`MERGED_TILE_N`): a tile covers parts of one or
    # two mask columns. Ragged lengths, both tile merges at once, and the kernel's own walk of padded tiles.
    g = torch.Generator().manual_seed(2)
    for S, skv, tile_m in ((1000, 1000, 128), (1000, 900, 128), (777, 1000, 192), (1024, 1024, 128)):
        q, k, v = (torch.randn(n, 16, generator=g, dtype=torch.float64) for n in (S, skv, skv))
        for mod in (_causal, _window, _doc_mask(max(S, skv)), _everything):
            bm = create_block_mask(mod, 1, 1, S, skv, BLOCK_SIZE=128)
            assert incompatibility(bm, tile_m, 80) is None
            kbm = kernel_block_mask(bm, S, tile_m, 80, skv)
            assert kbm.kv_num.shape[-1] == -(-S // tile_m) and kbm.kv_idx.dtype == torch.int32
            keep = mod(0, 0, torch.arange(S)[:, None], torch.arange(skv)[None, :])
            ref = torch.softmax((q @ k.T).masked_fill(~keep, float("-inf")), dim=-1).nan_to_num(0.0) @ v
            assert (_kernel_walk(q, k, v, mod, kbm, tile_m, 80) - ref).abs().max() < 1e-12, (mod.__name__, S, skv)
            listed = kbm.kv_num + kbm.full_num
            assert int(listed.max()) <= -(-skv // 80)


def test_merged_key_tiles_skip_and_trust_only_what_every_covered_column_says():
    S = 512
    kbm = kernel_block_mask(create_block_mask(_causal, 1, 1, S, S, BLOCK_SIZE=128), S, 128, 80, S)
    states = _states(kbm.kv_num, kbm.kv_idx, kbm.full_num, kbm.full_idx, 9)[0, 0, :, :7]
    # Q tile 1 (rows 128..255): mask column 0 full, column 1 partial (the diagonal), columns 2+ empty. Key tile 0
    # (keys 0..79) lies in column 0: full; tile 1 (80..159) straddles columns 0 and 1: partial; tile 2 (160..239) in
    # column 1: partial; tile 3 (240..319) straddles columns 1 and 2: partial; tile 4 (320..399) in column 2: skipped.
    assert states[1, :5].tolist() == [2, 1, 1, 1, 0]
    # rows 384..511: key tiles 0-3 (keys 0..319) in full columns; tile 4 (320..399) reaches the diagonal column 3
    assert states[3].tolist() == [2, 2, 2, 2, 1, 1, 1]
    assert "multiple of the kernel tile" in incompatibility(create_block_mask(_causal, 1, 1, S, S), 128, 96)


# ------------------------------------------------------------------ the padded Q rows in the first tile
def test_ragged_first_tiles_compute_the_same_attention():
    # `FwdConfig.ragged_first_tile`: tile t starts at row t * 192 - pad, so the first tile holds the padded rows.
    g = torch.Generator().manual_seed(3)
    for S, skv in ((1000, 1000), (1000, 900), (777, 1000), (4096, 4096), (100, 300)):
        q, k, v = (torch.randn(n, 16, generator=g, dtype=torch.float64) for n in (S, skv, skv))
        offset = ragged_first_offset(S, 192)
        assert 0 < offset < 192 and (S + offset) % 192 == 0
        for mod in (_causal, _window, _doc_mask(max(S, skv)), _everything):
            bm = create_block_mask(mod, 1, 1, S, skv, BLOCK_SIZE=128)
            kbm = kernel_block_mask(bm, S, 192, 128, skv, ragged_first=True)
            assert kbm.kv_num.shape[-1] == -(-S // 192)
            keep = mod(0, 0, torch.arange(S)[:, None], torch.arange(skv)[None, :])
            ref = torch.softmax((q @ k.T).masked_fill(~keep, float("-inf")), dim=-1).nan_to_num(0.0) @ v
            walked = _kernel_walk(q, k, v, mod, kbm, 192, 128, offset)
            assert (walked - ref).abs().max() < 1e-12, (mod.__name__, S, skv)


def test_ragged_first_tiles_shorten_a_causal_walk():
    # 4096 queries in 22 tiles of 192 rows: padded last, the longest tile (32 KV blocks) carries 128 padded rows;
    # padded first, the shortest (1 block) does.
    bm = create_block_mask(_causal, 1, 1, 4096, 4096, BLOCK_SIZE=128)
    last = kernel_block_mask(bm, 4096, 192, 128, 4096)
    first = kernel_block_mask(bm, 4096, 192, 128, 4096, ragged_first=True)
    assert int((last.kv_num + last.full_num).sum()) == 384
    assert int((first.kv_num + first.full_num).sum()) == 363
    assert (first.kv_num + first.full_num)[0, 0, 0].item() == 1
    assert first.mean_kv_blocks < last.mean_kv_blocks
    # tiles that divide the mask's rows are split, not merged: moving their padding is refused
    with pytest.raises(ValueError, match="straddle"):
        kernel_block_mask(bm, 1000, 128, 128, 1000, ragged_first=True)
    assert ragged_first_offset(4032, 192) == 0
