"""Reading torch `BlockMask`s: per-tile states (empty / partial / full) and the raw tensors kernels consume."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask

BLOCK_EMPTY, BLOCK_PARTIAL, BLOCK_FULL = 0, 1, 2


def _dense_from_ordered(num: torch.Tensor, idx: torch.Tensor, n_cols: int) -> torch.Tensor:
    """(…, rows) counts + (…, rows, k) indices → (…, rows, n_cols) bool: True where a listed block sits."""
    k = idx.shape[-1]
    listed = torch.arange(k, device=idx.device) < num.unsqueeze(-1)
    dense = torch.zeros(*idx.shape[:-1], n_cols + 1, dtype=torch.bool, device=idx.device)
    # Unlisted slots scatter into a spare column that is dropped afterwards.
    target = torch.where(listed, idx.long(), torch.full_like(idx, n_cols, dtype=torch.long))
    dense.scatter_(-1, target, True)
    return dense[..., :n_cols]


def block_states(block_mask: BlockMask) -> torch.Tensor:
    """int8 (B, H, n_q_blocks, n_kv_blocks): 0 = empty (never loaded), 1 = partial (mask_mod applied), 2 = full.

    torch's `print(block_mask)` merges partial and full blocks; kernels treat them differently, so we keep them apart.
    """
    q_len, kv_len = block_mask.seq_lengths
    q_bs, kv_bs = block_mask.BLOCK_SIZE
    n_q, n_kv = -(-q_len // q_bs), -(-kv_len // kv_bs)
    states = torch.zeros(*block_mask.kv_indices.shape[:2], n_q, n_kv, dtype=torch.int8,
                         device=block_mask.kv_indices.device)
    partial = _dense_from_ordered(block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.kv_indices.shape[-1])
    states[partial[..., :n_q, :n_kv]] = BLOCK_PARTIAL
    if block_mask.full_kv_num_blocks is not None:
        full = _dense_from_ordered(block_mask.full_kv_num_blocks, block_mask.full_kv_indices,
                                   block_mask.full_kv_indices.shape[-1])
        states[full[..., :n_q, :n_kv]] = BLOCK_FULL
    return states


@dataclass(frozen=True)
class BlockMaskTensors:
    """The four index tensors a block-sparse kernel walks, plus the block size they were built at."""
    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    full_kv_num_blocks: torch.Tensor | None
    full_kv_indices: torch.Tensor | None
    q_block: int
    kv_block: int
    seq_lengths: tuple[int, int]


def as_block_mask_tensors(block_mask: BlockMask) -> BlockMaskTensors:
    q_bs, kv_bs = block_mask.BLOCK_SIZE
    return BlockMaskTensors(block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
                            block_mask.full_kv_indices, int(q_bs), int(kv_bs), tuple(block_mask.seq_lengths))
