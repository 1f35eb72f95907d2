"""Gemma 2's local layers: a causal sliding window and tanh soft-capped logits, a mask and a score mod together."""
import torch

from flexlab.gallery import Mods, Param, Variant


def generate_gemma2_local(window: int, cap: float):
    def local_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    local_window.__name__ = f"local_window_{window}"
    softcap.__name__ = f"softcap_{cap:g}".replace(".", "p")
    return softcap, local_window


def make(B, H, Q_LEN, KV_LEN, device="cpu", window=128, cap=50.0):
    score_mod, mask_mod = generate_gemma2_local(window, cap)
    return Mods(score_mod=score_mod, mask_mod=mask_mod)


VARIANT = Variant(
    name="gemma2_local",
    description="Causal sliding window (4096 in Gemma 2) with logits soft-capped at 50 by cap * tanh(s / cap).",
    paper="https://arxiv.org/abs/2408.00118",
    kind="both",
    make=make,
    params=(Param("window", 128, 1, 8192, 1, "keys each query sees, itself included"),
            Param("cap", 50.0, 1.0, 100.0, 0.5, "logit bound")),
    lengths_rule="any Q_LEN and KV_LEN (top-left aligned)",
    builtin_equivalent="flash_attn_func(causal=True, window_size=(window - 1, 0), softcap=cap)",
)
