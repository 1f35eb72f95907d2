"""Bad input gets a clear error naming the argument or the function — never a crash deep inside."""
from __future__ import annotations

import pytest
import torch

import flexlab
from flexlab.testing import random_qkv


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def test_wrong_rank():
    q, k, v = random_qkv(1, 2, 16, 16, 8)
    with pytest.raises(ValueError, match="query must be 4-D"):
        flexlab.flex_attention(q[0], k, v)


def test_not_a_tensor():
    q, k, v = random_qkv(1, 2, 16, 16, 8)
    with pytest.raises(TypeError, match="key must be a torch.Tensor"):
        flexlab.flex_attention(q, k.numpy(), v)


def test_integer_dtype():
    q, k, v = random_qkv(1, 2, 16, 16, 8)
    with pytest.raises(TypeError, match="value must be float16"):
        flexlab.flex_attention(q, k, v.to(torch.int32))


def test_mixed_dtypes():
    q, k, v = random_qkv(1, 2, 16, 16, 8)
    with pytest.raises(TypeError, match="share a dtype"):
        flexlab.flex_attention(q, k.half(), v)


def test_mismatched_head_dim():
    q, _, v = random_qkv(1, 2, 16, 16, 8)
    k = torch.randn(1, 2, 16, 4)
    with pytest.raises(ValueError, match="head dim"):
        flexlab.flex_attention(q, k, v)


def test_mismatched_kv_lengths():
    q, k, _ = random_qkv(1, 2, 16, 16, 8)
    v = torch.randn(1, 2, 17, 8)
    with pytest.raises(ValueError, match="key and value must agree"):
        flexlab.flex_attention(q, k, v)


def test_mismatched_batch():
    q, _, _ = random_qkv(1, 2, 16, 16, 8)
    _, k, v = random_qkv(2, 2, 16, 16, 8)
    with pytest.raises(ValueError, match="batch size"):
        flexlab.flex_attention(q, k, v)


def test_heads_without_enable_gqa():
    q, k, v = random_qkv(1, 4, 16, 16, 8, Hkv=2)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        flexlab.flex_attention(q, k, v)


def test_heads_not_a_multiple():
    q, k, v = random_qkv(1, 3, 16, 16, 8, Hkv=2)
    with pytest.raises(ValueError, match="multiple"):
        flexlab.flex_attention(q, k, v, enable_gqa=True)


def test_score_mod_with_wrong_arity_is_named():
    q, k, v = random_qkv(1, 2, 16, 16, 8)

    def my_bias(score, b, h):
        return score

    with pytest.raises(TypeError, match="'my_bias' takes 3"):
        flexlab.flex_attention(q, k, v, score_mod=my_bias)


def test_mask_mod_passed_as_score_mod_gets_a_hint():
    q, k, v = random_qkv(1, 2, 16, 16, 8)
    with pytest.raises(TypeError, match="looks like a mask_mod"):
        flexlab.flex_attention(q, k, v, score_mod=causal)


def test_create_block_mask_rejects_a_score_mod():
    def softcap(score, b, h, q_idx, kv_idx):
        return score

    with pytest.raises(TypeError, match="'softcap' takes 5"):
        flexlab.create_block_mask(softcap, 1, 1, 16, 16)


def test_create_block_mask_bad_length():
    with pytest.raises(ValueError, match="Q_LEN must be a positive int"):
        flexlab.create_block_mask(causal, 1, 1, 0, 16)


def test_block_mask_for_other_lengths():
    q, k, v = random_qkv(1, 2, 16, 16, 8)
    bm = flexlab.create_block_mask(causal, 1, 1, 32, 32)
    with pytest.raises(ValueError, match=r"built for \(Q_LEN, KV_LEN\) = \(32, 32\)"):
        flexlab.flex_attention(q, k, v, block_mask=bm)


def test_block_mask_with_wrong_heads():
    q, k, v = random_qkv(1, 2, 16, 16, 8)
    bm = flexlab.create_block_mask(causal, 1, 3, 16, 16)
    with pytest.raises(ValueError, match="block_mask has"):
        flexlab.flex_attention(q, k, v, block_mask=bm)


def test_block_mask_not_a_block_mask():
    q, k, v = random_qkv(1, 2, 16, 16, 8)
    with pytest.raises(TypeError, match="block_mask must be a BlockMask"):
        flexlab.flex_attention(q, k, v, block_mask=torch.ones(16, 16, dtype=torch.bool))


def test_mask_mod_returning_floats():
    def not_bool(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).float()

    with pytest.raises(TypeError, match="must return a bool"):
        flexlab.create_block_mask(not_bool, 1, 1, 16, 16)


def test_unknown_backend():
    q, k, v = random_qkv(1, 2, 16, 16, 8)
    with pytest.raises(ValueError, match="backend must be one of"):
        flexlab.flex_attention(q, k, v, backend="triton")


def test_bad_scale_type():
    q, k, v = random_qkv(1, 2, 16, 16, 8)
    with pytest.raises(TypeError, match="scale must be a float"):
        flexlab.flex_attention(q, k, v, scale="0.5")
