"""Learnable relative position bias: a trainable scalar per (head, clipped offset), with gradients."""
import torch

from flexlab.gallery import Mods, Param, Variant


def generate_learnable_relative_bias(bias: torch.Tensor, max_distance: int):
    """`bias[h, max_distance + d]` is head h's bias for offset d = kv - q, offsets clipped to +-max_distance."""

    def learnable_relative_bias(score, b, h, q_idx, kv_idx):
        offset = torch.clamp(kv_idx - q_idx, -max_distance, max_distance)
        return score + bias[h, offset + max_distance]

    return learnable_relative_bias


def make(B, H, Q_LEN, KV_LEN, device="cpu", max_distance=64):
    generator = torch.Generator().manual_seed(0)
    bias = (0.1 * torch.randn(H, 2 * max_distance + 1, generator=generator)).to(device)
    return Mods(score_mod=generate_learnable_relative_bias(bias, max_distance), tensors={"bias": bias})


VARIANT = Variant(
    name="learnable_relative_bias",
    description="Add a trained bias[h, clip(kv - q)] (Shaw et al. / Swin style); the table receives gradients.",
    paper="https://arxiv.org/abs/1803.02155",
    kind="score",
    make=make,
    params=(Param("max_distance", 64, 1, 1024, 1, "offsets beyond +-max_distance share the edge bias"),),
    lengths_rule="any Q_LEN and KV_LEN",
    trainable=("bias",),
)
