"""StreamingLLM: a causal sliding window that always keeps the first few tokens (the attention sinks)."""
import torch

from flexlab.gallery import Mods, Param, Variant


def generate_attention_sinks(num_sinks: int, window: int):
    def attention_sinks(b, h, q_idx, kv_idx):
        causal = q_idx >= kv_idx
        sink = kv_idx < num_sinks
        recent = q_idx - kv_idx < window
        return causal & (sink | recent)

    attention_sinks.__name__ = f"attention_sinks_{num_sinks}_window_{window}"
    return attention_sinks


def make(B, H, Q_LEN, KV_LEN, device="cpu", num_sinks=4, window=64):
    return Mods(mask_mod=generate_attention_sinks(num_sinks, window))


VARIANT = Variant(
    name="attention_sinks",
    description="Causal window of recent keys plus the first num_sinks keys, which every query keeps seeing.",
    paper="https://arxiv.org/abs/2309.17453",
    kind="mask",
    make=make,
    params=(Param("num_sinks", 4, 0, 64, 1, "leading tokens kept as sinks"),
            Param("window", 64, 1, 4096, 1, "recent keys each query sees, itself included")),
    lengths_rule="any Q_LEN and KV_LEN (top-left aligned)",
)
