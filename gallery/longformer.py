"""Longformer: a symmetric local window plus a few global tokens that see and are seen by everyone."""
import torch

from flexlab.gallery import Mods, Param, Variant


def generate_longformer(window: int, num_global: int):
    def longformer(b, h, q_idx, kv_idx):
        local = torch.abs(q_idx - kv_idx) <= window
        global_query = q_idx < num_global
        global_key = kv_idx < num_global
        return local | global_query | global_key

    longformer.__name__ = f"longformer_w{window}_g{num_global}"
    return longformer


def make(B, H, Q_LEN, KV_LEN, device="cpu", window=32, num_global=8):
    return Mods(mask_mod=generate_longformer(window, num_global))


VARIANT = Variant(
    name="longformer",
    description="Bidirectional window of +-window tokens; the first num_global tokens are global both ways.",
    paper="https://arxiv.org/abs/2004.05150",
    kind="mask",
    make=make,
    params=(Param("window", 32, 0, 2048, 1, "keys on each side a query sees"),
            Param("num_global", 8, 0, 512, 1, "leading tokens with global attention (e.g. [CLS], question)")),
    lengths_rule="any Q_LEN and KV_LEN",
)
