"""Sandwich: the inner product of sinusoidal position embeddings used as a relative bias, per head."""
import torch

from flexlab.gallery import Mods, Param, Variant


def generate_sandwich(bias_of_distance: torch.Tensor):
    """`bias_of_distance[h, |q - kv|]` is the precomputed Sandwich bias of head h."""

    def sandwich(score, b, h, q_idx, kv_idx):
        return score + bias_of_distance[h, torch.abs(q_idx - kv_idx)]

    return sandwich


def sandwich_table(num_heads: int, max_distance: int, dim: int, device="cpu") -> torch.Tensor:
    """sum_i cos(d / 10000^(2i/dim)) - dim/2, over i = 1..dim/2, for d = 0..max_distance-1.

    The sum equals dim/2 at d = 0 and decays (with ripples) as d grows, so after the shift it is a soft
    recency penalty. Each head compresses the distance by a factor 8 (h + 1) / H, giving sharper heads first.
    """
    distance = torch.arange(max_distance, dtype=torch.float64)
    frequency = 10000.0 ** (-2.0 * torch.arange(1, dim // 2 + 1, dtype=torch.float64) / dim)
    ratio = 8.0 * torch.arange(1, num_heads + 1, dtype=torch.float64) / num_heads
    angle = distance[None, :, None] / ratio[:, None, None] * frequency[None, None, :]
    table = torch.cos(angle).sum(-1) - dim / 2
    return table.to(torch.float32).to(device)


def make(B, H, Q_LEN, KV_LEN, device="cpu", dim=32):
    table = sandwich_table(H, max(Q_LEN, KV_LEN), dim, device)
    return Mods(score_mod=generate_sandwich(table), tensors={"bias_of_distance": table})


VARIANT = Variant(
    name="sandwich",
    description="Add the shifted dot product of sinusoidal embeddings of q and kv (decays with distance), per head.",
    paper="https://arxiv.org/abs/2212.10356",
    kind="score",
    make=make,
    params=(Param("dim", 32, 2, 256, 2, "sinusoid width d' (more frequencies, sharper decay)"),),
    lengths_rule="any Q_LEN and KV_LEN",
)
