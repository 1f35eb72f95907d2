"""Standard mods the code generator must handle, written the way researchers write them (closures, captures).

Shared by the codegen tests and by the cross-process hash test, which imports this file in a fresh interpreter.
"""
from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import and_masks, or_masks

B, H, Q_LEN, KV_LEN = 2, 3, 70, 90


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def make_sliding_window(window: int):
    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= window
    return sliding_window


def make_prefix_lm(prefix_length: int):
    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < prefix_length) | (q_idx >= kv_idx)
    return prefix_lm


def make_document(doc_ids: torch.Tensor):
    def document(b, h, q_idx, kv_idx):
        return (doc_ids[q_idx] == doc_ids[kv_idx]) & (q_idx >= kv_idx)
    return document


def make_alibi(num_heads: int):
    def alibi(score, b, h, q_idx, kv_idx):
        slope = torch.exp2(-8.0 * (h + 1) / num_heads)
        return score - slope * (q_idx - kv_idx).abs()
    return alibi


def make_softcap(cap: float):
    def tanh_softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)
    return tanh_softcap


def make_relative_bias(table: torch.Tensor, max_distance: int):
    def relative_bias(score, b, h, q_idx, kv_idx):
        offset = torch.clamp(kv_idx - q_idx, -max_distance, max_distance)
        return score + table[h, offset + max_distance]
    return relative_bias


def make_full_bias(bias: torch.Tensor):
    def full_bias(score, b, h, q_idx, kv_idx):
        return score + bias[b, h, q_idx, kv_idx]
    return full_bias


def cases(seed: int = 0) -> dict[str, tuple]:
    """name -> (score_mod, mask_mod); fresh captured tensors from `seed`."""
    g = torch.Generator().manual_seed(seed)
    doc_ids = torch.sort(torch.randint(0, 4, (max(Q_LEN, KV_LEN),), generator=g)).values
    table = torch.randn(H, 2 * 16 + 1, generator=g)
    bias = torch.randn(B, H, Q_LEN, KV_LEN, generator=g)
    return {
        "causal": (None, causal),
        "sliding_window": (None, make_sliding_window(16)),
        "prefix_lm": (None, make_prefix_lm(20)),
        "document": (None, make_document(doc_ids)),
        "alibi": (make_alibi(H), None),
        "tanh_softcap": (make_softcap(20.0), None),
        "relative_bias": (make_relative_bias(table, 16), None),
        "full_bias": (make_full_bias(bias), None),
        "and_masks": (None, and_masks(causal, make_sliding_window(24), make_document(doc_ids))),
        "or_masks": (None, or_masks(make_prefix_lm(8), make_sliding_window(4))),
        "softcap_and_window": (make_softcap(30.0), and_masks(causal, make_sliding_window(32))),
    }


def grid(B=B, H=H, Q=Q_LEN, KV=KV_LEN, device="cpu"):
    """Broadcastable (b, h, q_idx, kv_idx) index tensors, int64 like torch's arange."""
    return (torch.arange(B, device=device).view(B, 1, 1, 1), torch.arange(H, device=device).view(1, H, 1, 1),
            torch.arange(Q, device=device).view(1, 1, Q, 1), torch.arange(KV, device=device).view(1, 1, 1, KV))
