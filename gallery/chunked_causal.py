"""Chunked (block-causal) attention as in Llama 4's local layers: causal inside fixed chunks, nothing across."""
import torch

from flexlab.gallery import Mods, Param, Variant


def generate_chunked_causal(chunk_size: int):
    def chunked_causal(b, h, q_idx, kv_idx):
        same_chunk = q_idx // chunk_size == kv_idx // chunk_size
        return same_chunk & (q_idx >= kv_idx)

    chunked_causal.__name__ = f"chunked_causal_{chunk_size}"
    return chunked_causal


def make(B, H, Q_LEN, KV_LEN, device="cpu", chunk_size=64):
    return Mods(mask_mod=generate_chunked_causal(chunk_size))


VARIANT = Variant(
    name="chunked_causal",
    description="The sequence is cut into chunks of chunk_size tokens; attention is causal within a chunk only.",
    paper="https://ai.meta.com/blog/llama-4-multimodal-intelligence/",
    kind="mask",
    make=make,
    params=(Param("chunk_size", 64, 1, 8192, 1, "tokens per chunk (8192 in Llama 4)"),),
    lengths_rule="any Q_LEN and KV_LEN (top-left aligned)",
)
