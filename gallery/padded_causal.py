"""Causal attention over right-padded batches: padded query rows see nothing at all (fully masked rows)."""
import torch

from flexlab.gallery import Mods, Param, Variant


def generate_padded_causal(valid_length: torch.Tensor):
    """`valid_length[b]` is how many leading tokens of batch row b are real; the rest is padding."""

    def padded_causal(b, h, q_idx, kv_idx):
        real_query = q_idx < valid_length[b]
        real_key = kv_idx < valid_length[b]
        return real_query & real_key & (q_idx >= kv_idx)

    return padded_causal


def valid_lengths(B: int, seq_len: int, pad_fraction: float, device="cpu") -> torch.Tensor:
    """Row b loses a share of its tokens to padding that grows with b, reaching `pad_fraction` on the last row."""
    lengths = [max(1, seq_len - round(pad_fraction * seq_len * (b + 1) / B)) for b in range(B)]
    return torch.tensor(lengths, dtype=torch.int32, device=device)


def make(B, H, Q_LEN, KV_LEN, device="cpu", pad_fraction=0.25):
    valid_length = valid_lengths(B, KV_LEN, pad_fraction, device)
    return Mods(mask_mod=generate_padded_causal(valid_length), tensors={"valid_length": valid_length})


VARIANT = Variant(
    name="padded_causal",
    description="Causal attention where padding tokens are masked as keys and as queries; padded rows output 0.",
    paper="https://arxiv.org/abs/1706.03762",
    kind="mask",
    make=make,
    params=(Param("pad_fraction", 0.25, 0.0, 0.95, 0.05, "share of the last batch row that is padding"),),
    lengths_rule="Q_LEN == KV_LEN (self-attention over the same padded rows)",
    accepts=lambda q_len, kv_len: q_len == kv_len,
    builtin_equivalent="sdpa(attn_mask=padding & causal) (SDPA returns NaN on fully masked rows, flex returns 0)",
)
