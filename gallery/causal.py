"""Causal attention: each token sees itself and the tokens before it (decoder-only language models)."""
import torch

from flexlab.gallery import Mods, Variant


def generate_causal():
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return causal


def make(B, H, Q_LEN, KV_LEN, device="cpu"):
    return Mods(mask_mod=generate_causal())


VARIANT = Variant(
    name="causal",
    description="Each query attends to keys at the same or an earlier position.",
    paper="https://arxiv.org/abs/1706.03762",
    kind="mask",
    make=make,
    lengths_rule="any Q_LEN and KV_LEN; positions are aligned at the top-left (query i sees keys 0..i)",
    builtin_equivalent="sdpa(is_causal=True)",
)
