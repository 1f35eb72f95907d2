"""Tanh soft-capping of logits (Gemma 2, Grok-1): scores are squashed smoothly into (-cap, cap)."""
import torch

from flexlab.gallery import Mods, Param, Variant


def generate_softcap(cap: float):
    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    softcap.__name__ = f"softcap_{cap:g}".replace(".", "p")
    return softcap


def make(B, H, Q_LEN, KV_LEN, device="cpu", cap=20.0):
    return Mods(score_mod=generate_softcap(cap))


VARIANT = Variant(
    name="softcap",
    description="Scores pass through cap * tanh(score / cap), bounding logits without a hard clip.",
    paper="https://arxiv.org/abs/2408.00118",
    kind="score",
    make=make,
    params=(Param(name="cap", default=20.0, min=1.0, max=100.0, step=0.5,
                  description="bound of the logits; large caps change little"),),
    lengths_rule="any Q_LEN and KV_LEN",
    builtin_equivalent="flash_attn_func(softcap=cap)",
)
