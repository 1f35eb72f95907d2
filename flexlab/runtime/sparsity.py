"""Turn a torch BlockMask into the int32 tensors the kernel walks, at the kernel's tile size, plus a tile order.

A mask built at a block size that is a multiple of the kernel tile is split: a (q_bs, kv_bs) block becomes
(q_bs/tile_m) x (kv_bs/tile_n) kernel blocks of the same state. A Q tile that no mask block size divides (192 rows, for
a mask at torch's 128) is merged instead: it covers parts of two or more mask rows, so a KV block is full for the tile
only where it is full in every covered row, skipped only where it is empty in every covered row, and partial (mask_mod
evaluated element by element) otherwise. That is exact whenever the mask's block states agree with its mask_mod (as
`create_block_mask` builds them); a hand-made mask whose "full" blocks would be masked by mask_mod is not merged the
way torch would run it, which is why merging is limited to `MERGED_TILE_M`. KV tiles merge the same way, the mask
columns they cover (`MERGED_TILE_N`: 80-key tiles at D=256 over a mask at 128). The result is cached per BlockMask
object, so a training loop that reuses its mask pays this once.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

_CACHE: "OrderedDict[tuple, KernelBlockMask]" = OrderedDict()
_CACHE_SIZE = 64
MERGED_TILE_M = (192,)  # Q tiles that accept a mask at any block size by merging the mask rows they cover
MERGED_TILE_N = (80,)  # KV tiles that accept a mask at any block size by merging the mask columns they cover


@dataclass(frozen=True)
class KernelBlockMask:
    kv_num: torch.Tensor  # (Bm, Hm, nQ) int32: partial blocks per Q tile
    kv_idx: torch.Tensor  # (Bm, Hm, nQ, K) int32
    full_num: torch.Tensor
    full_idx: torch.Tensor
    order: torch.Tensor  # (nQ,) int32: Q tiles longest-work-first
    # KV blocks a Q tile visits, on average over the mask's batches, heads and Q tiles: the launcher's measure of how
    # short tiles are (`runtime.launch.runs_dynamic`)
    mean_kv_blocks: float

    def as_args(self) -> tuple:
        return (self.kv_num, self.kv_idx, self.full_num, self.full_idx)


def incompatibility(block_mask, tile_m: int, tile_n: int) -> str | None:
    """Why this mask cannot drive a kernel with these tiles, or None."""
    return block_size_incompatibility(tuple(int(x) for x in block_mask.BLOCK_SIZE), tile_m, tile_n)


def block_size_incompatibility(block_size: tuple[int, int], tile_m: int, tile_n: int) -> str | None:
    q_bs, kv_bs = block_size
    if (kv_bs % tile_n and tile_n not in MERGED_TILE_N) or (q_bs % tile_m and tile_m not in MERGED_TILE_M):
        return (f"block_mask BLOCK_SIZE={(q_bs, kv_bs)} is not a multiple of the kernel tile {(tile_m, tile_n)}; "
                f"build it with BLOCK_SIZE={tile_m} or a multiple")
    return None


def _split(num: torch.Tensor, idx: torch.Tensor, rq: int, rk: int, n_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    if rk > 1:  # every listed mask block j becomes kernel blocks j*rk .. j*rk+rk-1, still a prefix of the row
        idx = (idx.unsqueeze(-1) * rk + torch.arange(rk, device=idx.device, dtype=idx.dtype)).flatten(-2)
        num = num * rk
    if rq > 1:
        idx = idx.repeat_interleave(rq, dim=2)
        num = num.repeat_interleave(rq, dim=2)
    return num[:, :, :n_q].to(torch.int32).contiguous(), idx[:, :, :n_q].to(torch.int32).contiguous()


def _covered(states: torch.Tensor, dim: int, count: int, tile: int, block: int, length: int,
             offset: int = 0) -> torch.Tensor:
    """`states` (block states along `dim`) at `count` tiles of `tile` along that axis, tile t starting at
    t * tile - offset: a tile is empty where every block it covers (within [0, length)) is empty, full where every one
    is full, partial otherwise."""
    from ..mask.block_mask import BLOCK_EMPTY, BLOCK_FULL, BLOCK_PARTIAL
    t = torch.arange(count, device=states.device)
    first = torch.clamp(t * tile - offset, min=0) // block
    last = (torch.clamp((t + 1) * tile - offset, max=length) - 1) // block
    nonempty = full = None
    for k in range(-(-tile // block) + 1):  # a tile covers at most ceil(tile / block) + 1 blocks
        s = states.index_select(dim, torch.minimum(first + k, last))
        nonempty = (s != BLOCK_EMPTY) if nonempty is None else nonempty | (s != BLOCK_EMPTY)
        full = (s == BLOCK_FULL) if full is None else full & (s == BLOCK_FULL)
    return torch.where(full, BLOCK_FULL, torch.where(nonempty, BLOCK_PARTIAL, BLOCK_EMPTY)).to(torch.int8)


def _merged(block_mask, seqlen_q: int, seqlen_k: int, tile_m: int, tile_n: int, n_q: int, q_offset: int = 0) -> tuple:
    """Lists for tiles that straddle mask rows or columns (see the module docstring), Q tile t starting at row
    t * tile_m - q_offset; KV blocks in ascending order."""
    from ..mask.block_mask import BLOCK_FULL, BLOCK_PARTIAL, block_states
    q_bs, kv_bs = (int(x) for x in block_mask.BLOCK_SIZE)
    states = block_states(block_mask)  # (B, H, mask rows, mask cols)
    if kv_bs % tile_n:
        states = _covered(states, 3, -(-seqlen_k // tile_n), tile_n, kv_bs, seqlen_k)
    elif kv_bs > tile_n:
        states = states.repeat_interleave(kv_bs // tile_n, dim=-1)
    if q_bs % tile_m or q_offset:
        states = _covered(states, 2, n_q, tile_m, q_bs, seqlen_q, q_offset)
    else:
        states = states.repeat_interleave(q_bs // tile_m, dim=2)[:, :, :n_q]
    partial, full = states == BLOCK_PARTIAL, states == BLOCK_FULL

    def lists(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.sort(sel.to(torch.int8), dim=-1, descending=True, stable=True).indices
        return sel.sum(-1).to(torch.int32).contiguous(), idx.to(torch.int32).contiguous()

    return (*lists(partial), *lists(full))


def _ragged_block_first(kv_num, kv_idx, full_num, full_idx, tail: int) -> tuple:
    """List KV block `tail` (the one holding the last, ragged keys), wherever a Q tile visits it, as that tile's first
    partial block.

    The forward kernel masks the key tail only on the first block it visits, so neither of its loops carries a
    per-element tail test (ptxas turned one into a second pass of selects on every block, ~130 instructions per step,
    and the extra registers spilled in the heavier gallery masks). A block the BlockMask calls full becomes partial:
    mask_mod there keeps every valid key, so only the loop it runs in changes, not the result; the order of the other
    blocks is kept."""
    live_p = torch.arange(kv_idx.shape[-1], device=kv_idx.device) < kv_num.unsqueeze(-1)
    live_f = torch.arange(full_idx.shape[-1], device=full_idx.device) < full_num.unsqueeze(-1)
    in_p = (kv_idx == tail) & live_p
    in_f = (full_idx == tail) & live_f
    in_full = in_f.any(-1)
    visits = in_p.any(-1) | in_full
    if not bool(visits.any()):
        return kv_num, kv_idx, full_num, full_idx
    if bool(in_full.any()):  # drop it from the full list, keeping the others in order
        keep_first = torch.sort((~in_f).to(torch.int8), dim=-1, descending=True, stable=True).indices
        full_idx = torch.gather(full_idx, -1, keep_first).contiguous()
        full_num = (full_num - in_full.to(full_num.dtype)).contiguous()
    others = live_p & ~in_p
    others_first = torch.sort(others.to(torch.int8), dim=-1, descending=True, stable=True).indices
    moved = torch.cat([torch.full_like(kv_idx[..., :1], tail), torch.gather(kv_idx, -1, others_first)], dim=-1)
    kept = torch.cat([kv_idx, torch.zeros_like(kv_idx[..., :1])], dim=-1)
    kv_idx = torch.where(visits.unsqueeze(-1), moved, kept).contiguous()
    kv_num = torch.where(visits, others.sum(-1).to(kv_num.dtype) + 1, kv_num).contiguous()
    return kv_num, kv_idx, full_num, full_idx


def ragged_first_offset(seqlen_q: int, tile_m: int) -> int:
    """Rows the first Q tile starts before row 0 when the tile holding the rows that do not fill a whole tile is the
    first instead of the last (`FwdConfig.ragged_first_tile`)."""
    return -seqlen_q % tile_m


def kernel_block_mask(block_mask, seqlen_q: int, tile_m: int, tile_n: int, seqlen_k: int,
                      ragged_first: bool = False) -> KernelBlockMask:
    """The kernel's lists for `block_mask` at (tile_m, tile_n). With `seqlen_k` not a multiple of tile_n, the last
    KV block is, wherever a Q tile visits it, that tile's first partial block (`_ragged_block_first`): the forward
    kernel masks the key tail only on the first block it visits. `ragged_first`: Q tile t starts at row
    t * tile_m - `ragged_first_offset` (merged lists; tiles in `MERGED_TILE_M` only)."""
    q_offset = ragged_first_offset(seqlen_q, tile_m) if ragged_first else 0
    if q_offset and tile_m not in MERGED_TILE_M:
        raise ValueError(f"ragged_first: Q tiles of {tile_m} rows straddle mask rows only at {MERGED_TILE_M}")
    key = (id(block_mask), id(block_mask.kv_indices), tile_m, tile_n, seqlen_q, seqlen_k, q_offset)
    hit = _CACHE.get(key)
    if hit is not None:
        _CACHE.move_to_end(key)
        return hit
    q_bs, kv_bs = (int(x) for x in block_mask.BLOCK_SIZE)
    rq, rk = q_bs // tile_m, kv_bs // tile_n
    n_q = -(-seqlen_q // tile_m)
    if q_bs % tile_m or kv_bs % tile_n or q_offset:
        kv_num, kv_idx, full_num, full_idx = _merged(block_mask, seqlen_q, seqlen_k, tile_m, tile_n, n_q, q_offset)
    else:
        kv_num, kv_idx = _split(block_mask.kv_num_blocks, block_mask.kv_indices, rq, rk, n_q)
        if block_mask.full_kv_num_blocks is not None:
            full_num, full_idx = _split(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, rq, rk, n_q)
        else:  # no full blocks recorded: everything listed is partial
            full_num = torch.zeros_like(kv_num)
            full_idx = torch.zeros_like(kv_idx[..., :1])
    if seqlen_k % tile_n:
        kv_num, kv_idx, full_num, full_idx = _ragged_block_first(kv_num, kv_idx, full_num, full_idx,
                                                                 seqlen_k // tile_n)
    # The kernel reads each list's first entry before it knows whether the list is used: never an empty last mode.
    kv_idx, full_idx = (x if x.shape[-1] else x.new_zeros((*x.shape[:-1], 1)) for x in (kv_idx, full_idx))
    work = (kv_num + full_num).sum(dim=(0, 1))
    order = torch.argsort(work, descending=True, stable=True).to(torch.int32).contiguous()
    result = KernelBlockMask(kv_num, kv_idx, full_num, full_idx, order, float(work.sum()) / max(1, kv_num.numel()))
    _CACHE[key] = result
    # Keep the BlockMask alive with its entry so its id cannot be reused by another mask while cached.
    _CACHE.move_to_end(key)
    object.__setattr__(result, "_owner", block_mask)
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return result
