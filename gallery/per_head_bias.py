"""Per-head key bias: every head learns how much it favours each key position (e.g. sink or summary tokens)."""
import torch

from flexlab.gallery import Mods, Variant


def generate_per_head_bias(bias: torch.Tensor):
    """`bias[h, kv]` is added to every score of head h against key kv."""

    def per_head_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, kv_idx]

    return per_head_bias


def make(B, H, Q_LEN, KV_LEN, device="cpu"):
    generator = torch.Generator().manual_seed(0)
    bias = torch.randn(H, KV_LEN, generator=generator).to(device)
    return Mods(score_mod=generate_per_head_bias(bias), tensors={"bias": bias})


VARIANT = Variant(
    name="per_head_bias",
    description="Add a trainable bias[h, kv_idx]: each head scores key positions differently.",
    paper="https://arxiv.org/abs/2309.17453",
    kind="score",
    make=make,
    lengths_rule="any Q_LEN and KV_LEN (the table is sized to KV_LEN)",
    trainable=("bias",),
)
