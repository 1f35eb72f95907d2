"""Partial-block masks stored as bits, so a kernel tests one bit per score instead of running mask_mod.

A mask_mod that reads captured tensors (document ids, image spans) costs the forward kernel dozens of global loads
and index clamps per partial block: its partial-block step compiles to ~860 SASS instructions against ~450 for a
full block. The mask of a block does not change between calls as long as nothing it reads changes, so it is
evaluated here once with torch (the same `evaluate` the reference backend uses), packed 32 scores to a word, and
cached; the kernel loads one word per accumulator row instead (`kernels.mask.apply_fragment_bits`).

Layout, for a kernel whose block lists are (num, idx) over `outer` tiles (Q tiles in the forward, KV tiles in the
backward, whose accumulator is S^T): an int32 tensor (Bx, Hx, n_outer, P, tile_rows, 4), where P is the longest
partial list, Bx/Hx are the batch/head modes the mask varies over (1 where neither the lists nor the mask_mod depend
on them) and entry [b, h, o, p] is the block listed at position p of tile o. Each row holds its 64 or 128 columns in
Hopper wgmma accumulator order: word t holds the columns a thread with `lane % 4 == t` owns, column 8 j + 2 t + e at
bit 2 j + e (16 or 32 bits used). So each thread loads exactly its bits of a row with one 4-byte load, and a warp's
loads of 8 rows are 128 contiguous bytes. The cache key holds the captured tensors' version counters, so an
in-place edit of what the mask reads builds the bits again.

The bits also show which listed partial blocks the tile does not need at all: a kernel tile smaller than the mask's
block (the backward's 64-query tiles of a 128-row block) or merged over two mask rows (192-row forward tiles) can
be masked everywhere. Those are dropped from the partial lists the kernel walks (`StoredBits`): a step that masks
every score adds exact zeros, so the results are the same bits, and a document mask's backward at 8 documents in
4096 tokens walks 244 steps instead of 254.
"""
from __future__ import annotations

import math
from collections import OrderedDict

import torch

from ..mods import evaluate_mask_mod_pointwise

TILE_COLS = (64, 128)  # accumulator columns per block the bit layout covers (N of the kernel's m64nN GEMM)
WORDS_PER_ROW = 4  # one per thread of a quad (lane % 4)
# Stored masks larger than this are not built (the kernel evaluates mask_mod instead): memory stays bounded for
# masks with many partial blocks at large batch x heads.
MAX_BYTES = 256 << 20
# Scores evaluated per torch call while building (int64 temporaries: a few tens of MiB per chunk)
CHUNK_ELEMENTS = 1 << 22
_CACHE_ENTRIES = 16
MAX_CACHED_BYTES = 512 << 20  # per mask_mod, over all its entries (the newest is kept whatever its size)


def stored_shape(num: torch.Tensor, idx: torch.Tensor, batch: int, heads: int, tile_rows: int,
                 varies_b: bool, varies_h: bool, longest: int) -> tuple[int, ...]:
    """Shape of the stored bits for these lists (`longest`: the largest entry of `num`)."""
    bm, hm = idx.shape[0], idx.shape[1]
    bx = batch if (varies_b or bm > 1) else 1
    hx = heads if (varies_h or hm > 1) else 1
    return (bx, hx, idx.shape[2], max(1, longest), tile_rows, WORDS_PER_ROW)


def pack_fragment_order(keep: torch.Tensor) -> torch.Tensor:
    """(..., N) bool, N = 64 or 128 -> (..., 4) int32: word t, bit 2 j + e = column 8 j + 2 t + e (see the module
    docstring)."""
    cols = keep.shape[-1]
    if cols not in TILE_COLS:
        raise ValueError(f"pack_fragment_order: rows of {TILE_COLS} columns expected, got {cols}")
    lead = keep.shape[:-1]
    # column 8 j + 2 t + e  ->  (j, t, e)  ->  (t, j, e): bit 2 j + e of word t
    frag = keep.reshape(*lead, cols // 8, WORDS_PER_ROW, 2).transpose(-3, -2).reshape(*lead, WORDS_PER_ROW, cols // 4)
    weights = torch.bitwise_left_shift(torch.ones(cols // 4, dtype=torch.int64, device=keep.device),
                                       torch.arange(cols // 4, device=keep.device))
    words = (frag.to(torch.int64) * weights).sum(-1)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # two's complement: bit 31 is the sign bit


def unpack_fragment_order(words: torch.Tensor, cols: int = 128) -> torch.Tensor:
    """Inverse of `pack_fragment_order` (tests and the inspector): (..., 4) int32 -> (..., cols) bool."""
    lead = words.shape[:-1]
    bits = (words.to(torch.int64).unsqueeze(-1) >> torch.arange(cols // 4, device=words.device)) & 1
    frag = bits.reshape(*lead, WORDS_PER_ROW, cols // 8, 2).transpose(-3, -2)
    return frag.reshape(*lead, cols).bool()


def build(mask_mod, num: torch.Tensor, idx: torch.Tensor, *, batch: int, heads: int, rows_are_q: bool,
          tile_rows: int, len_rows: int, len_cols: int, varies_b: bool, varies_h: bool, tile_cols: int = 128,
          chunk_elements: int = CHUNK_ELEMENTS, row_offset: int = 0) -> torch.Tensor | None:
    """The stored bits of every listed partial block (layout in the module docstring), or None when they would
    take more than `MAX_BYTES`.

    `rows_are_q`: the kernel's accumulator rows are queries (forward) or keys (a backward that computes S^T).
    Indices past a sequence end are clamped to its last position (those rows are never stored, those columns are
    masked by the kernel's own tail test), so the mask_mod never reads past a captured buffer. `row_offset`: row tile
    o starts at o * tile_rows - row_offset (the forward's `FwdConfig.ragged_first_tile`); rows before 0, never
    stored either, are clamped to 0."""
    longest = int(num.max()) if num.numel() else 0
    shape = stored_shape(num, idx, batch, heads, tile_rows, varies_b, varies_h, longest)
    if 4 * math.prod(shape) > MAX_BYTES:
        return None
    bx, hx, n_outer, p_max = shape[:4]
    device = idx.device
    b_of = torch.arange(bx, device=device)
    h_of = torch.arange(hx, device=device)
    lists = idx[b_of % idx.shape[0]][:, h_of % idx.shape[1], :, :p_max]  # (bx, hx, n_outer, P)
    if lists.shape[-1] < p_max:  # a list mode shorter than P (no partial blocks anywhere): nothing is read there
        lists = torch.nn.functional.pad(lists, (0, p_max - lists.shape[-1]))
    rows = torch.arange(tile_rows, device=device)
    cols = torch.arange(tile_cols, device=device)
    out = torch.empty(shape, dtype=torch.int32, device=device)
    flat_lists = lists.reshape(-1, p_max)
    flat_out = out.view(-1, p_max, tile_rows, WORDS_PER_ROW)
    per_tile = p_max * tile_rows * tile_cols
    step = max(1, chunk_elements // per_tile)
    for start in range(0, flat_lists.shape[0], step):
        g = torch.arange(start, min(start + step, flat_lists.shape[0]), device=device)
        o = g % n_outer
        h = (g // n_outer) % hx
        b = g // (n_outer * hx)
        row_idx = torch.clamp(o[:, None, None, None] * tile_rows + rows[:, None] - row_offset, 0, len_rows - 1)
        col_idx = torch.clamp(flat_lists[g][:, :, None, None] * tile_cols + cols, max=len_cols - 1)
        row_idx, col_idx = torch.broadcast_tensors(row_idx, col_idx)  # (G, P, tile_rows, 128)
        q_idx, kv_idx = (row_idx, col_idx) if rows_are_q else (col_idx, row_idx)
        bb = b[:, None, None, None].expand_as(q_idx)
        hh = h[:, None, None, None].expand_as(q_idx)
        keep = evaluate_mask_mod_pointwise(mask_mod, bb.reshape(-1), hh.reshape(-1), q_idx.reshape(-1),
                                           kv_idx.reshape(-1)).view(q_idx.shape)
        flat_out[g] = pack_fragment_order(keep)
    return out


class StoredBits:
    """What a kernel reading stored bits walks: `words` (the layout above) and its partial lists `num`/`idx`, which
    are the caller's lists less the blocks whose bits are all zero (`pruned` says whether any were)."""

    __slots__ = ("words", "num", "idx", "pruned", "_derived")

    def __init__(self, words: torch.Tensor, num: torch.Tensor, idx: torch.Tensor, pruned: bool):
        self.words, self.num, self.idx, self.pruned = words, num, idx, pruned
        self._derived = None

    def derived(self, build):
        """An object a launcher builds from these lists (the backward's `QLists` of the pruned lists), built once and
        kept with the bits, so it lives and is rebuilt exactly as they are."""
        if self._derived is None:
            self._derived = build()
        return self._derived


def drop_empty_blocks(num: torch.Tensor, idx: torch.Tensor, words: torch.Tensor) -> StoredBits:
    """`StoredBits` for `build`'s words over the lists (num, idx), with every listed block whose bits are all zero
    taken out of the lists and the words moved along (the remaining blocks keep their order, so a ragged tail block
    listed first stays first). Lists that broadcast over a batch or head mode the bits do not (a mask_mod reading
    `b` under a mask built with B=1) are kept whole: pruning them would need a list per batch or head."""
    if tuple(num.shape[:2]) != tuple(words.shape[:2]) or words.shape[3] == 0:
        return StoredBits(words, num, idx, False)
    p_max = words.shape[3]
    listed = torch.arange(p_max, device=num.device) < num.unsqueeze(-1).long()
    keep = words.ne(0).flatten(-2).any(-1) & listed  # (Bx, Hx, n_outer, P)
    if bool(torch.equal(keep, listed)):
        return StoredBits(words, num, idx, False)
    moved = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)  # kept blocks first, in list order
    new_idx = idx.clone()
    new_idx[..., :p_max] = torch.gather(idx[..., :p_max], -1, moved)
    new_words = torch.gather(words, 3, moved[..., None, None].expand_as(words)).contiguous()
    new_num = keep.sum(-1).to(num.dtype).contiguous()
    return StoredBits(new_words, new_num, new_idx.contiguous(), True)


def store_for(generated, mask_mod, watch: tuple = ()) -> "StoredMasks | None":
    """The store for a generated mask_mod, where the policy keeps its partial blocks as bits
    (`kernels.config.STORE_MASK_BITS`: masks that read captured tensors), else None. `watch`: the user's captured
    tensors, whose in-place edits invalidate stored bits."""
    from ..kernels import config as policy
    if mask_mod is None or not policy.STORE_MASK_BITS or not generated.mask_reads("tensor"):
        return None
    return StoredMasks(mask_mod, generated.mask_reads("b"), generated.mask_reads("h"), tuple(watch))


class StoredMasks:
    """The stored bits of one mask_mod, per block lists and kernel tile shape. One entry per (block lists, shape):
    an in-place edit of a captured tensor the mask reads (its version counter moves) rebuilds that entry instead of
    adding one, and the entries together stay under `MAX_CACHED_BYTES`."""

    def __init__(self, mask_mod, varies_b: bool, varies_h: bool, watch: tuple = ()):
        self.mask_mod = mask_mod
        self.varies_b, self.varies_h = varies_b, varies_h
        self.watch = tuple(watch)  # the captured tensors the mask reads: their in-place versions date each entry
        self._cache: OrderedDict = OrderedDict()  # key -> (owner, versions, bits or None)

    def bits(self, owner, num: torch.Tensor, idx: torch.Tensor, batch: int, heads: int, rows_are_q: bool,
             tile_rows: int, len_rows: int, len_cols: int, tile_cols: int = 128,
             row_offset: int = 0) -> StoredBits | None:
        """Cached `build`, with the blocks it finds empty dropped from the lists (`drop_empty_blocks`); `owner` (the
        kernel's block lists, which hold `num` and `idx`) is kept alive with the entry so that its id is not reused
        while cached."""
        key = (id(owner), batch, heads, rows_are_q, tile_rows, len_rows, len_cols, tile_cols, row_offset)
        versions = tuple(t._version for t in self.watch)
        hit = self._cache.get(key)
        if hit is not None and hit[1] == versions:
            self._cache.move_to_end(key)
            return hit[2]
        bits = build(self.mask_mod, num, idx, batch=batch, heads=heads, rows_are_q=rows_are_q, tile_rows=tile_rows,
                     len_rows=len_rows, len_cols=len_cols, varies_b=self.varies_b, varies_h=self.varies_h,
                     tile_cols=tile_cols, row_offset=row_offset)
        if bits is not None:
            bits = drop_empty_blocks(num, idx, bits)
        self._cache[key] = (owner, versions, bits)
        self._cache.move_to_end(key)
        while len(self._cache) > 1 and (len(self._cache) > _CACHE_ENTRIES or self.cached_bytes() > MAX_CACHED_BYTES):
            self._cache.popitem(last=False)
        return bits

    def cached_bytes(self) -> int:
        return sum(entry[2].words.numel() * 4 for entry in self._cache.values() if entry[2] is not None)
