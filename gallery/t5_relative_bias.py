"""T5 relative position bias: a learned scalar per (head, distance bucket), looked up from a captured table."""
import math

import torch

from flexlab.gallery import Mods, Param, Variant


def generate_t5_relative_bias(bucket_of_offset: torch.Tensor, bias: torch.Tensor, q_len: int):
    """`bucket_of_offset[kv - q + q_len - 1]` is the bucket of relative offset kv - q; `bias[h, bucket]` its bias."""

    def t5_relative_bias(score, b, h, q_idx, kv_idx):
        bucket = bucket_of_offset[kv_idx - q_idx + (q_len - 1)]
        return score + bias[h, bucket]

    return t5_relative_bias


def relative_buckets(q_len: int, kv_len: int, num_buckets: int, max_distance: int, device="cpu") -> torch.Tensor:
    """T5's bidirectional bucketing of every offset kv - q in [-(q_len-1), kv_len-1].

    Half the buckets hold keys after the query; within a half, small distances get a bucket each and larger ones
    share log-spaced buckets up to `max_distance`.
    """
    offset = torch.arange(-(q_len - 1), kv_len, dtype=torch.int64)
    half = num_buckets // 2
    bucket = (offset > 0).to(torch.int64) * half
    distance = offset.abs()
    exact = half // 2
    log_ratio = torch.log(distance.clamp(min=1).double() / exact) / math.log(max_distance / exact)
    far = exact + (log_ratio * (half - exact)).to(torch.int64)
    far = far.clamp(max=half - 1)
    bucket = bucket + torch.where(distance < exact, distance, far)
    return bucket.to(torch.int32).to(device)


def make(B, H, Q_LEN, KV_LEN, device="cpu", num_buckets=32, max_distance=128):
    buckets = relative_buckets(Q_LEN, KV_LEN, num_buckets, max_distance, device)
    generator = torch.Generator().manual_seed(0)
    bias = (0.5 * torch.randn(H, num_buckets, generator=generator)).to(device)
    return Mods(score_mod=generate_t5_relative_bias(buckets, bias, Q_LEN),
                tensors={"bucket_of_offset": buckets, "bias": bias})


VARIANT = Variant(
    name="t5_relative_bias",
    description="Add bias[h, bucket(kv - q)] from a captured (heads x buckets) table; buckets grow log-spaced.",
    paper="https://arxiv.org/abs/1910.10683",
    kind="score",
    make=make,
    params=(Param("num_buckets", 32, 4, 128, 2, "buckets over both directions (exact for small offsets)"),
            Param("max_distance", 128, 8, 4096, 8, "offset beyond which all distances share the last bucket")),
    lengths_rule="any Q_LEN and KV_LEN",
    trainable=("bias",),
)
