"""Shared prefix: several completions of one prompt packed in a row, each seeing the prompt and itself only."""
import torch

from flexlab.gallery import Mods, Param, Variant


def generate_shared_prefix(segment_id: torch.Tensor):
    """`segment_id[i]` is 0 for prompt tokens and c + 1 for tokens of completion c."""

    def shared_prefix(b, h, q_idx, kv_idx):
        causal = q_idx >= kv_idx
        key_in_prompt = segment_id[kv_idx] == 0
        same_completion = segment_id[q_idx] == segment_id[kv_idx]
        return causal & (key_in_prompt | same_completion)

    return shared_prefix


def segment_ids(seq_len: int, prefix_length: int, num_completions: int, device="cpu") -> torch.Tensor:
    """Prompt first, then `num_completions` equal-length completions (the last one takes the remainder)."""
    prefix_length = min(prefix_length, seq_len)
    rest = seq_len - prefix_length
    per = max(1, rest // num_completions)
    ids = torch.zeros(seq_len, dtype=torch.int32)
    tail = torch.arange(rest) // per
    ids[prefix_length:] = (tail.clamp(max=num_completions - 1) + 1).to(torch.int32)
    return ids.to(device)


def make(B, H, Q_LEN, KV_LEN, device="cpu", prefix_length=96, num_completions=4):
    segment_id = segment_ids(KV_LEN, prefix_length, num_completions, device)
    return Mods(mask_mod=generate_shared_prefix(segment_id), tensors={"segment_id": segment_id})


VARIANT = Variant(
    name="shared_prefix",
    description="One prompt, many sampled completions in one row: each completion sees the prompt and itself.",
    paper="https://arxiv.org/abs/2402.05099",
    kind="mask",
    make=make,
    params=(Param("prefix_length", 96, 0, 8192, 1, "tokens of the shared prompt"),
            Param("num_completions", 4, 1, 64, 1, "completions packed after the prompt")),
    lengths_rule="Q_LEN == KV_LEN (one packed row)",
    accepts=lambda q_len, kv_len: q_len == kv_len,
)
