"""Prefix LM (T5 / UniLM / PaliGemma): bidirectional over a prefix, causal after it."""
import torch

from flexlab.gallery import Mods, Param, Variant


def generate_prefix_lm(prefix_length: int):
    def prefix_lm(b, h, q_idx, kv_idx):
        in_prefix = kv_idx < prefix_length
        causal = q_idx >= kv_idx
        return in_prefix | causal

    prefix_lm.__name__ = f"prefix_lm_{prefix_length}"
    return prefix_lm


def make(B, H, Q_LEN, KV_LEN, device="cpu", prefix_length=64):
    return Mods(mask_mod=generate_prefix_lm(prefix_length))


VARIANT = Variant(
    name="prefix_lm",
    description="Every query sees the whole prefix (bidirectional); after the prefix attention is causal.",
    paper="https://arxiv.org/abs/1910.10683",
    kind="mask",
    make=make,
    params=(Param("prefix_length", 64, 0, 8192, 1, "tokens at the start that everyone may see"),),
    lengths_rule="any Q_LEN and KV_LEN",
)
