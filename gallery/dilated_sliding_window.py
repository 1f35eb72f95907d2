"""Dilated sliding window (Longformer's dilated heads): a causal window that skips keys in strides."""
import torch

from flexlab.gallery import Mods, Param, Variant


def generate_dilated_sliding_window(window: int, dilation: int):
    def dilated_sliding_window(b, h, q_idx, kv_idx):
        distance = q_idx - kv_idx
        causal = distance >= 0
        in_reach = distance < window * dilation
        on_stride = distance % dilation == 0
        return causal & in_reach & on_stride

    dilated_sliding_window.__name__ = f"dilated_sliding_window_{window}x{dilation}"
    return dilated_sliding_window


def make(B, H, Q_LEN, KV_LEN, device="cpu", window=32, dilation=2):
    return Mods(mask_mod=generate_dilated_sliding_window(window, dilation))


VARIANT = Variant(
    name="dilated_sliding_window",
    description="Causal window of `window` keys taken every `dilation` positions, reaching window*dilation back.",
    paper="https://arxiv.org/abs/2004.05150",
    kind="mask",
    make=make,
    params=(Param("window", 32, 1, 1024, 1, "keys each query sees"),
            Param("dilation", 2, 1, 16, 1, "stride between the keys a query sees")),
    lengths_rule="any Q_LEN and KV_LEN (top-left aligned)",
)
