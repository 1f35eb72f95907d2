"""ALiBi with learned slopes: each head's distance penalty is a trainable scalar, started at ALiBi's values."""
import torch

from flexlab.gallery import Mods, Variant


def generate_learnable_alibi(slopes: torch.Tensor):
    """`slopes[h]` scales head h's penalty on |i - j|; trained, a head can sharpen or flatten its recency bias."""

    def learnable_alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * torch.abs(q_idx - kv_idx)

    return learnable_alibi


def make(B, H, Q_LEN, KV_LEN, device="cpu"):
    # ALiBi's geometric sequence 2^(-8 (h + 1) / H) as the starting point, one float per head
    slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, dtype=torch.float32) / H).to(device)
    return Mods(score_mod=generate_learnable_alibi(slopes), tensors={"slopes": slopes})


VARIANT = Variant(
    name="learnable_alibi",
    description="Subtract slopes[h] * |i - j| with one trainable slope per head, started at ALiBi's sequence.",
    paper="https://arxiv.org/abs/2108.12409",
    kind="score",
    make=make,
    lengths_rule="any Q_LEN and KV_LEN",
    trainable=("slopes",),
)
