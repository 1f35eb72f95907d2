"""The mods the foundation tests run over: one of each kind torch's FlexAttention users write."""
from __future__ import annotations


import torch


def make_mods(B: int, H: int, Sq: int, Skv: int, device="cpu"):
    """name → (score_mod or None, mask_mod or None). Captured tensors are built for these exact sizes."""
    window = 48
    prefix = max(1, Sq // 5)
    # Documents: random boundaries over the kv sequence; queries are aligned to the tail of kv (Sq may be < Skv).
    g = torch.Generator().manual_seed(1)
    cuts = torch.sort(torch.randint(1, max(2, Skv), (3,), generator=g)).values
    doc_kv = torch.bucketize(torch.arange(Skv), cuts, right=True).to(device)
    offset = Skv - Sq

    def causal(b, h, q_idx, kv_idx):
        return q_idx + offset >= kv_idx

    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx + offset >= kv_idx) & (q_idx + offset - kv_idx <= window)

    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < prefix) | (q_idx + offset >= kv_idx)

    def document(b, h, q_idx, kv_idx):
        q_pos = torch.clamp(q_idx + offset, 0, Skv - 1)
        return (doc_kv[q_pos] == doc_kv[kv_idx]) & (q_idx + offset >= kv_idx)

    slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / H) for i in range(H)], device=device)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx - offset)

    cap = 20.0

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    max_dist = 64
    bias_table = torch.randn(H, 2 * max_dist + 1, generator=g).to(device)

    def bias_table_mod(score, b, h, q_idx, kv_idx):
        rel = torch.clamp(kv_idx - q_idx, -max_dist, max_dist) + max_dist
        return score + bias_table[h, rel]

    def rows_masked(b, h, q_idx, kv_idx):  # every 7th query row sees nothing at all
        return (q_idx % 7 != 3) & (q_idx + offset >= kv_idx)

    return {
        "noop": (None, None),
        "causal": (None, causal),
        "sliding_window": (None, sliding_window),
        "prefix_lm": (None, prefix_lm),
        "document": (None, document),
        "alibi_causal": (alibi, causal),
        "softcap": (softcap, None),
        "bias_table": (bias_table_mod, None),
        "fully_masked_rows": (None, rows_masked),
    }


MOD_NAMES = tuple(make_mods(1, 2, 8, 8).keys())
