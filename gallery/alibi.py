"""ALiBi: a per-head linear penalty on distance replaces position embeddings."""
import torch

from flexlab.gallery import Mods, Variant


def generate_alibi(num_heads: int):
    def alibi(score, b, h, q_idx, kv_idx):
        # Head h gets slope 2^(-8 (h + 1) / H): a geometric sequence, steepest on head 0.
        slope = torch.exp2(-8.0 * (h + 1) / num_heads)
        distance = torch.abs(q_idx - kv_idx)
        return score - slope * distance

    alibi.__name__ = f"alibi_{num_heads}_heads"
    return alibi


def make(B, H, Q_LEN, KV_LEN, device="cpu"):
    return Mods(score_mod=generate_alibi(H))


VARIANT = Variant(
    name="alibi",
    description="Subtract slope_h * |i - j| from each score; slopes form a geometric sequence over heads.",
    paper="https://arxiv.org/abs/2108.12409",
    kind="score",
    make=make,
    lengths_rule="any Q_LEN and KV_LEN (pair it with causal for the paper's decoder setting)",
    builtin_equivalent="flash_attn_func(alibi_slopes=...) (with causal=True)",
)
