"""Causal sliding window (Mistral, Longformer's local part): a token sees only the last `window` tokens."""
import torch

from flexlab.gallery import Mods, Param, Variant


def generate_sliding_window(window: int):
    def sliding_window(b, h, q_idx, kv_idx):
        causal = q_idx >= kv_idx
        recent = q_idx - kv_idx < window
        return causal & recent

    sliding_window.__name__ = f"sliding_window_{window}"
    return sliding_window


def make(B, H, Q_LEN, KV_LEN, device="cpu", window=64):
    return Mods(mask_mod=generate_sliding_window(window))


VARIANT = Variant(
    name="sliding_window",
    description="Causal attention restricted to the `window` most recent keys, the query's own included.",
    paper="https://arxiv.org/abs/2310.06825",
    kind="mask",
    make=make,
    params=(Param("window", 64, 1, 4096, 1, "number of keys each query sees, itself included"),),
    lengths_rule="any Q_LEN and KV_LEN (top-left aligned)",
    builtin_equivalent="flash_attn_func(causal=True, window_size=(window - 1, 0))",
)
