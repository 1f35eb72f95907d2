"""Full attention with an identity score_mod: the baseline every other variant is compared against."""
import torch

from flexlab.gallery import Mods, Variant


def generate_noop():
    def noop(score, b, h, q_idx, kv_idx):
        return score

    return noop


def make(B, H, Q_LEN, KV_LEN, device="cpu"):
    return Mods(score_mod=generate_noop())


VARIANT = Variant(
    name="noop",
    description="Plain softmax attention: every query sees every key, scores untouched.",
    paper="https://arxiv.org/abs/1706.03762",
    kind="score",
    make=make,
    lengths_rule="any Q_LEN and KV_LEN",
    builtin_equivalent="sdpa()",
)
