"""Block diffusion (BD3-LM): noisy blocks are denoised bidirectionally while conditioning on clean earlier blocks.

The row holds the noisy copy x_t (first half) followed by the clean copy x_0 (second half) of a sequence.
"""
import torch

from flexlab.gallery import Mods, Param, Variant


def generate_block_diffusion(half: int, block_size: int):
    """`half` is the length of one copy (x_t or x_0); tokens at index >= half belong to the clean copy."""

    def block_diffusion(b, h, q_idx, kv_idx):
        q_clean = q_idx >= half
        kv_clean = kv_idx >= half
        q_block = torch.where(q_clean, q_idx - half, q_idx) // block_size
        kv_block = torch.where(kv_clean, kv_idx - half, kv_idx) // block_size
        # noisy and clean tokens each see their own block in full, within their own copy
        block_diagonal = (q_block == kv_block) & (q_clean == kv_clean)
        # noisy tokens see the clean copy of every earlier block
        offset_block_causal = (q_block > kv_block) & kv_clean & ~q_clean
        # clean tokens see clean blocks up to their own
        block_causal = (q_block >= kv_block) & kv_clean & q_clean
        return block_diagonal | offset_block_causal | block_causal

    block_diffusion.__name__ = f"block_diffusion_{block_size}"
    return block_diffusion


def make(B, H, Q_LEN, KV_LEN, device="cpu", block_size=16):
    return Mods(mask_mod=generate_block_diffusion(KV_LEN // 2, block_size))


VARIANT = Variant(
    name="block_diffusion",
    description="Block-diagonal within noisy and clean copies, plus noisy-to-earlier-clean and clean block-causal.",
    paper="https://arxiv.org/abs/2503.09573",
    kind="mask",
    make=make,
    params=(Param("block_size", 16, 1, 1024, 1, "tokens denoised together"),),
    lengths_rule="Q_LEN == KV_LEN, even (x_t followed by x_0, each KV_LEN / 2 long)",
    accepts=lambda q_len, kv_len: q_len == kv_len and kv_len % 2 == 0,
)
