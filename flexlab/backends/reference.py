"""Dense reference attention: the ground truth every kernel is tested against.

Plain math in float32 or float64 on any device, differentiable (including captured tensors that require grad).
It follows the kernels' block semantics exactly: a (q, kv) pair is kept when its block is listed as full, or listed
as partial and the mask_mod keeps it; unlisted blocks are skipped. For masks built by create_block_mask this is the
same as evaluating the mask_mod everywhere. Fully masked rows give output 0 and LSE -inf, never NaN.
"""
from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

from ..mask.block_mask import BLOCK_FULL, BLOCK_PARTIAL, block_states
from ..mods import evaluate_mask_mod, evaluate_score_mod, index_grid


def _kept_pairs(block_mask: BlockMask, B: int, H: int, Sq: int, Skv: int, device) -> torch.Tensor:
    """(B, H, Sq, Skv) bool of kept pairs under `block_mask` (broadcast over B/H where the mask has size 1)."""
    q_bs, kv_bs = block_mask.BLOCK_SIZE
    states = block_states(block_mask).to(device)
    states = states.repeat_interleave(q_bs, dim=2)[:, :, :Sq].repeat_interleave(kv_bs, dim=3)[:, :, :, :Skv]
    states = states.expand(B, H, Sq, Skv)
    mb, mh = block_mask.kv_indices.shape[:2]
    b_idx, h_idx, q_idx, kv_idx = index_grid(B, H, Sq, Skv, device)
    mask = evaluate_mask_mod(block_mask.mask_mod, b_idx, h_idx, q_idx, kv_idx)
    return (states == BLOCK_FULL) | ((states == BLOCK_PARTIAL) & mask)


def reference_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod=None,
                        block_mask: BlockMask | None = None, scale: float | None = None, enable_gqa: bool = False,
                        compute_dtype: torch.dtype = torch.float64, with_max: bool = False):
    """Returns (out, lse) in compute_dtype, lse in natural log; with `with_max` also each row's largest score after
    score_mod and masking (-inf where all are masked; no gradient), torch's `max_scores`. Inputs are validated."""
    B, Hq, Sq, D = query.shape
    Hkv, Skv = key.shape[1], key.shape[2]
    scale = D ** -0.5 if scale is None else scale
    q, k, v = (t.to(compute_dtype) for t in (query, key, value))
    if Hq != Hkv:  # GQA: query head h reads kv head h // (Hq // Hkv)
        k = k.repeat_interleave(Hq // Hkv, dim=1)
        v = v.repeat_interleave(Hq // Hkv, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    if score_mod is not None:
        scores = evaluate_score_mod(score_mod, scores, *index_grid(B, Hq, Sq, Skv, q.device))
        scores = scores.to(compute_dtype)
    if block_mask is not None:
        keep = _kept_pairs(block_mask, B, Hq, Sq, Skv, q.device)
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # exp(score - lse) is exactly 0 for masked pairs; a fully masked row has lse = -inf, so guard it to 0 output.
    # (Only -inf: a NaN or +inf score makes its row NaN, as torch's flex_attention does, never a quiet 0.)
    row_alive = (lse != float("-inf")).unsqueeze(-1)
    safe_lse = torch.where(row_alive, lse.unsqueeze(-1), torch.zeros_like(lse).unsqueeze(-1))
    probs = torch.where(row_alive, torch.exp(scores - safe_lse), torch.zeros_like(scores))
    if with_max:
        return probs @ v, lse, scores.detach().amax(dim=-1)
    return probs @ v, lse
