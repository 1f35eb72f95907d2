"""Stored partial-block bits (`flexlab.runtime.mask_bits`): layout, contents and when they are stored (CPU)."""
from __future__ import annotations

import pytest
import torch

from flexlab.mask.build import create_block_mask, create_mask
from flexlab.runtime import mask_bits
from flexlab.runtime.sparsity import kernel_block_mask


def test_fragment_order_puts_a_threads_columns_in_one_word():
    # column 8 j + 2 t + e -> word t, bit 2 j + e; and back
    for col in (0, 1, 2, 7, 8, 9, 31, 64, 126, 127):
        keep = torch.zeros(128, dtype=torch.bool)
        keep[col] = True
        words = mask_bits.pack_fragment_order(keep)
        j, t, e = col // 8, (col % 8) // 2, col % 2
        expected = torch.zeros(4, dtype=torch.int64)
        expected[t] = 1 << (2 * j + e)
        assert torch.equal(words.to(torch.int64) & 0xFFFFFFFF, expected), col
    keep = torch.rand(5, 3, 128, generator=torch.Generator().manual_seed(0)) < 0.5
    assert torch.equal(mask_bits.unpack_fragment_order(mask_bits.pack_fragment_order(keep)), keep)


def _document(S, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    doc = torch.sort(torch.randint(0, n, (S,), generator=gen)).values.to(torch.int32)

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
    return mask_mod


def _head_window(S):
    window = torch.arange(3, dtype=torch.int32) * 150 + 40

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= window[h]
    return mask_mod


@pytest.mark.parametrize("Sq,Skv", [(1000, 1000), (300, 777), (777, 300), (128, 256)])
@pytest.mark.parametrize("case", ["document", "head_window"])
@pytest.mark.parametrize("rows_are_q", [True, False])
def test_stored_bits_equal_the_mask_inside_every_listed_block(Sq, Skv, case, rows_are_q):
    mask_mod = _document(max(Sq, Skv), 7) if case == "document" else _head_window(max(Sq, Skv))
    H = 1 if case == "document" else 3
    bm = create_block_mask(mask_mod, None, None if case == "document" else H, Sq, Skv)
    dense = create_mask(mask_mod, 1, H, Sq, Skv)[0]  # (H, Sq, Skv)
    if rows_are_q:
        kbm = kernel_block_mask(bm, Sq, 128, 128, Skv)
        num, idx, len_rows, len_cols = kbm.kv_num, kbm.kv_idx, Sq, Skv
    else:  # lists over KV tiles, rows = keys (a backward that computes S^T)
        num, idx, len_rows, len_cols = bm.q_num_blocks.int(), bm.q_indices.int(), Skv, Sq
        dense = dense.transpose(-1, -2)
    bits = mask_bits.build(mask_mod, num, idx, batch=2, heads=H, rows_are_q=rows_are_q, tile_rows=128,
                           len_rows=len_rows, len_cols=len_cols, varies_b=False, varies_h=case != "document")
    assert bits.dtype == torch.int32 and bits.shape[0] == 1 and bits.shape[1] == (1 if case == "document" else H)
    assert bits.shape[3] == max(1, int(num.max())) and bits.shape[4:] == (128, 4)
    keep = mask_bits.unpack_fragment_order(bits)
    checked = 0
    for h in range(bits.shape[1]):
        for o in range(idx.shape[2]):
            for p in range(int(num[0, h % num.shape[1], o])):
                n = int(idx[0, h % idx.shape[1], o, p])
                r0, c0 = o * 128, n * 128
                rows, cols = min(128, len_rows - r0), min(128, len_cols - c0)
                want = dense[h, r0:r0 + rows, c0:c0 + cols]
                assert torch.equal(keep[0, h, o, p, :rows, :cols], want), (h, o, p)
                checked += 1
    assert checked > 0


def test_bits_vary_over_batch_and_head_only_where_needed():
    def by_batch(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + b * 100
    bm = create_block_mask(by_batch, 3, None, 512, 512)
    kbm = kernel_block_mask(bm, 512, 128, 128, 512)
    bits = mask_bits.build(by_batch, kbm.kv_num, kbm.kv_idx, batch=3, heads=5, rows_are_q=True, tile_rows=128,
                           len_rows=512, len_cols=512, varies_b=True, varies_h=False)
    assert bits.shape[:2] == (3, 1)
    keep = mask_bits.unpack_fragment_order(bits)
    dense = create_mask(by_batch, 3, 1, 512, 512)[:, 0]
    for b in range(3):
        for o in range(4):
            for p in range(int(kbm.kv_num[b, 0, o])):
                n = int(kbm.kv_idx[b, 0, o, p])
                assert torch.equal(keep[b, 0, o, p], dense[b, o * 128:(o + 1) * 128, n * 128:(n + 1) * 128])


def test_too_large_a_store_is_not_built(monkeypatch):
    mask_mod = _document(1024, 5)
    bm = create_block_mask(mask_mod, None, None, 1024, 1024)
    kbm = kernel_block_mask(bm, 1024, 128, 128, 1024)
    monkeypatch.setattr(mask_bits, "MAX_BYTES", 1024)
    assert mask_bits.build(mask_mod, kbm.kv_num, kbm.kv_idx, batch=1, heads=1, rows_are_q=True, tile_rows=128,
                           len_rows=1024, len_cols=1024, varies_b=False, varies_h=False) is None


def test_stored_masks_cache_per_block_lists():
    mask_mod = _document(512, 3)
    store = mask_bits.StoredMasks(mask_mod, False, False)
    bm = create_block_mask(mask_mod, None, None, 512, 512)
    kbm = kernel_block_mask(bm, 512, 128, 128, 512)
    a = store.bits(kbm, kbm.kv_num, kbm.kv_idx, 1, 2, True, 128, 512, 512)
    assert store.bits(kbm, kbm.kv_num, kbm.kv_idx, 1, 2, True, 128, 512, 512) is a
    assert store.bits(kbm, kbm.kv_num, kbm.kv_idx, 2, 2, True, 128, 512, 512) is not a


def test_the_cute_backend_stores_bits_only_for_masks_reading_captured_tensors():
    from flexlab.backends.cute import stores_mask_bits
    assert stores_mask_bits(None, _document(256, 3))
    assert stores_mask_bits(None, _head_window(256))
    assert not stores_mask_bits(None, lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
    table = torch.randn(64)

    def bias_only(score, b, h, q_idx, kv_idx):  # a captured tensor read by the score_mod, not the mask
        return score + table[(q_idx - kv_idx).abs() % 64]
    assert not stores_mask_bits(bias_only, lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)


def test_in_place_edits_rebuild_an_entry_instead_of_adding_one(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    doc = torch.sort(torch.randint(0, 4, (512,), generator=gen)).values.to(torch.int32)

    def mask_mod(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]
    bm = create_block_mask(lambda b, h, q, kv: q >= 0, None, None, 512, 512)  # every block full: list them partial
    kbm = kernel_block_mask(bm, 512, 128, 128, 512)
    num = torch.full_like(kbm.full_num, 4)
    idx = torch.arange(4, dtype=torch.int32).expand(1, 1, 4, 4).contiguous()
    store = mask_bits.StoredMasks(mask_mod, False, False, watch=(doc,))
    first = store.bits(kbm, num, idx, 1, 1, True, 128, 512, 512)
    doc.copy_(torch.sort(torch.randint(0, 9, (512,), generator=gen)).values.to(torch.int32))
    second = store.bits(kbm, num, idx, 1, 1, True, 128, 512, 512)
    assert len(store._cache) == 1 and not torch.equal(first.words, second.words)
    dense = create_mask(mask_mod, 1, 1, 512, 512)[0, 0]
    keep = mask_bits.unpack_fragment_order(second.words)[0, 0]
    for o in range(4):
        kept = [int(p) for p in second.idx[0, 0, o, :int(second.num[0, 0, o])]]
        for i, p in enumerate(kept):
            assert torch.equal(keep[o, i], dense[o * 128:(o + 1) * 128, p * 128:(p + 1) * 128])
        # the blocks left out of the lists are exactly those the mask empties
        assert kept == [p for p in range(4) if dense[o * 128:(o + 1) * 128, p * 128:(p + 1) * 128].any()]
    # the byte bound drops the oldest entries (the newest always stays)
    monkeypatch.setattr(mask_bits, "MAX_CACHED_BYTES", second.words.numel() * 4)
    store.bits(kbm, num, idx, 2, 1, True, 128, 512, 512)
    assert len(store._cache) == 1


def test_bits_at_192_row_tiles_over_merged_mask_rows():
    # A 192-row Q tile covers parts of two 128-row mask blocks; its lists merge them, and the bits must follow the
    # kernel's rows (192 per tile), not the mask's blocks.
    S = 1000
    mask_mod = _document(S, 6, seed=4)
    bm = create_block_mask(mask_mod, None, None, S, S)
    kbm = kernel_block_mask(bm, S, 192, 128, S)
    bits = mask_bits.build(mask_mod, kbm.kv_num, kbm.kv_idx, batch=1, heads=1, rows_are_q=True, tile_rows=192,
                           len_rows=S, len_cols=S, varies_b=False, varies_h=False)
    assert bits.shape[4:] == (192, 4)
    keep = mask_bits.unpack_fragment_order(bits)
    dense = create_mask(mask_mod, 1, 1, S, S)[0, 0]
    for o in range(kbm.kv_num.shape[2]):
        for p in range(int(kbm.kv_num[0, 0, o])):
            n = int(kbm.kv_idx[0, 0, o, p])
            r0, c0 = o * 192, n * 128
            rows, cols = min(192, S - r0), min(128, S - c0)
            assert torch.equal(keep[0, 0, o, p, :rows, :cols], dense[r0:r0 + rows, c0:c0 + cols]), (o, p)


def test_bits_follow_ragged_first_tiles():
    # `FwdConfig.ragged_first_tile`: Q tile o starts at row o * 192 - pad; the bits follow those rows, and the rows
    # before 0 (never stored) read row 0's mask, so no index is negative.
    S = 1000
    pad = -S % 192
    mask_mod = _document(S, 6, seed=5)
    bm = create_block_mask(mask_mod, None, None, S, S)
    kbm = kernel_block_mask(bm, S, 192, 128, S, ragged_first=True)
    bits = mask_bits.build(mask_mod, kbm.kv_num, kbm.kv_idx, batch=1, heads=1, rows_are_q=True, tile_rows=192,
                           len_rows=S, len_cols=S, varies_b=False, varies_h=False, row_offset=pad)
    keep = mask_bits.unpack_fragment_order(bits)
    dense = create_mask(mask_mod, 1, 1, S, S)[0, 0]
    checked = 0
    for o in range(kbm.kv_num.shape[2]):
        r0 = o * 192 - pad
        first = max(0, -r0)  # the tile's first row at or after row 0
        for p in range(int(kbm.kv_num[0, 0, o])):
            c0 = int(kbm.kv_idx[0, 0, o, p]) * 128
            cols = min(128, S - c0)
            assert torch.equal(keep[0, 0, o, p, first:, :cols], dense[r0 + first:r0 + 192, c0:c0 + cols]), (o, p)
            if first:
                assert torch.equal(keep[0, 0, o, p, :first, :cols], dense[0:1, c0:c0 + cols].expand(first, cols))
            checked += 1
    assert checked > 5
    store = mask_bits.StoredMasks(mask_mod, False, False)
    moved = store.bits(kbm, kbm.kv_num, kbm.kv_idx, 1, 1, True, 192, S, S, row_offset=pad)
    assert store.bits(kbm, kbm.kv_num, kbm.kv_idx, 1, 1, True, 192, S, S) is not moved  # the offset keys the entry


@pytest.mark.parametrize("rows_are_q,tile_rows,tile_cols", [(True, 192, 128), (False, 128, 64), (False, 128, 128)])
def test_blocks_whose_bits_are_all_zero_leave_the_lists(rows_are_q, tile_rows, tile_cols):
    # Tiles smaller than the mask's blocks (the backward's 64 query columns) or merged over two mask rows (192-row
    # forward tiles) can be empty inside a listed partial block: those leave the partial lists, the rest keep their
    # order and their words.
    S = 1024
    mask_mod = _document(S, 7)
    bm = create_block_mask(mask_mod, None, None, S, S)
    dense = create_mask(mask_mod, 1, 1, S, S)[0, 0]
    if rows_are_q:
        kbm = kernel_block_mask(bm, S, tile_rows, tile_cols, S)
        num, idx = kbm.kv_num, kbm.kv_idx
    else:
        from flexlab.kernels.bwd_config import BwdConfig
        from flexlab.kernels.bwd_launch import q_direction_tensors
        cfg = BwdConfig(head_dim=128 if tile_cols == 64 else 64, tile_m=tile_cols, tile_n=tile_rows)
        lists = [bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices, bm.q_num_blocks,
                 bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices]
        num, idx = q_direction_tensors(lists, bm.BLOCK_SIZE, cfg, S)[:2]
        dense = dense.T  # rows = keys
    words = mask_bits.build(mask_mod, num, idx, batch=1, heads=1, rows_are_q=rows_are_q, tile_rows=tile_rows,
                            len_rows=S, len_cols=S, varies_b=False, varies_h=False, tile_cols=tile_cols)
    stored = mask_bits.drop_empty_blocks(num, idx, words)
    keep = mask_bits.unpack_fragment_order(stored.words, tile_cols)[0, 0]
    dropped = 0
    for o in range(num.shape[2]):
        before = [int(p) for p in idx[0, 0, o, :int(num[0, 0, o])]]
        after = [int(p) for p in stored.idx[0, 0, o, :int(stored.num[0, 0, o])]]
        rows = slice(o * tile_rows, min(S, (o + 1) * tile_rows))

        def block(p):
            return dense[rows, p * tile_cols:(p + 1) * tile_cols]
        assert after == [p for p in before if block(p).any()]
        dropped += len(before) - len(after)
        for i, p in enumerate(after):
            got = keep[o, i, :rows.stop - rows.start]
            assert torch.equal(got, block(p))
    assert stored.pruned == (dropped > 0)
    if tile_cols == 64 or tile_rows == 192:
        assert dropped > 0  # these tiles do cut document boundaries inside a mask block
    else:
        assert dropped == 0 and stored.num is num  # 128x128 tiles are the mask's own blocks: none is empty


def test_lists_broadcast_over_a_mode_the_bits_vary_over_are_kept_whole():
    num = torch.tensor([[[2]]], dtype=torch.int32)
    idx = torch.tensor([[[[0, 1]]]], dtype=torch.int32)
    words = torch.zeros((2, 1, 1, 2, 128, 4), dtype=torch.int32)  # empty for batch 0 and 1, but per batch
    stored = mask_bits.drop_empty_blocks(num, idx, words)
    assert not stored.pruned and stored.num is num and stored.idx is idx
