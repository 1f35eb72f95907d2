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


@pytest.mark.parametrize("arg,value", [("enable_gqa", "no"), ("return_lse", "yes"), ("return_lse", 0),
                                       ("deterministic", "x")])
def test_flags_are_checked_by_type_not_truthiness(arg, value):
    q, k, v = random_qkv(1, 4, 16, 16, 8, Hkv=2)
    with pytest.raises(TypeError, match=f"{arg} must be True"):
        flexlab.flex_attention(q, k, v, backend="reference", **{"enable_gqa": True, arg: value})


def test_a_fraction_scale_is_taken_as_its_float():
    from fractions import Fraction
    q, k, v = random_qkv(1, 2, 16, 16, 8)
    for backend in ("reference", "torch"):
        a = flexlab.flex_attention(q, k, v, scale=Fraction(1, 2), backend=backend)
        torch.testing.assert_close(a, flexlab.flex_attention(q, k, v, scale=0.5, backend=backend))


def test_a_mod_with_a_vector_result_is_named():
    def per_point_vector(score, b, h, q_idx, kv_idx):
        return torch.stack([score, score])

    q, k, v = random_qkv(1, 2, 16, 16, 8)
    for backend in ("reference", "torch", "auto"):  # (torch's own error would be a shape mismatch deep inside it)
        with pytest.raises(ValueError, match="score_mod 'per_point_vector' must return one value"):
            flexlab.flex_attention(q, k, v, score_mod=per_point_vector, backend=backend)

    def vector_mask(b, h, q_idx, kv_idx):
        return torch.stack([q_idx >= kv_idx, q_idx >= kv_idx])

    with pytest.raises(ValueError, match="mask_mod 'vector_mask' must return one value"):
        flexlab.create_block_mask(vector_mask, 1, 1, 16, 16)


def test_torch_backend_keeps_a_mods_own_error():
    """A mod that raises is not re-labelled by the torch backend's diagnosis: its own error reaches the caller."""
    def raises_inside(score, b, h, q_idx, kv_idx):
        raise KeyError("missing table entry")

    q, k, v = random_qkv(1, 2, 16, 16, 8)
    with pytest.raises(KeyError, match="missing table entry"):
        flexlab.flex_attention(q, k, v, score_mod=raises_inside, backend="torch")


def test_a_mod_returning_a_python_number_means_a_constant():
    def keep_all(b, h, q_idx, kv_idx):
        return True

    def flat(score, b, h, q_idx, kv_idx):
        return 0.0

    bm = flexlab.create_block_mask(keep_all, 1, 1, 256, 256)
    assert bm.full_kv_num_blocks.sum().item() == 4 and bm.kv_num_blocks.sum().item() == 0
    q, k, v = random_qkv(1, 2, 16, 16, 8)
    out = flexlab.flex_attention(q, k, v, score_mod=flat, backend="reference")
    torch.testing.assert_close(out, v.mean(dim=2, keepdim=True).expand_as(out))

    def returns_none(score, b, h, q_idx, kv_idx):
        return None

    with pytest.raises(TypeError, match="score_mod 'returns_none' returned NoneType"):
        flexlab.flex_attention(q, k, v, score_mod=returns_none, backend="reference")


def test_an_error_inside_a_mod_keeps_its_type_and_names_the_mod():
    table = torch.arange(4.0)

    def out_of_range(score, b, h, q_idx, kv_idx):
        return score + table[q_idx]

    q, k, v = random_qkv(1, 2, 16, 16, 8)
    with pytest.raises(IndexError) as info:
        flexlab.flex_attention(q, k, v, score_mod=out_of_range, backend="reference")
    if hasattr(info.value, "add_note"):
        assert "score_mod 'out_of_range'" in "\n".join(info.value.__notes__)


def test_a_required_keyword_only_argument_is_refused_by_name():
    def kw(score, b, h, q_idx, kv_idx, *, bias):
        return score + bias

    q, k, v = random_qkv(1, 2, 16, 16, 8)
    with pytest.raises(TypeError, match="score_mod 'kw' has a keyword-only argument"):
        flexlab.flex_attention(q, k, v, score_mod=kw, backend="reference")


@pytest.mark.parametrize("size", [1.5, None, "128", (64,), (64, 64, 64), True])
def test_block_size_is_checked(size):
    with pytest.raises(ValueError, match="BLOCK_SIZE"):
        flexlab.create_block_mask(causal, 1, 1, 128, 128, BLOCK_SIZE=size)


def test_create_block_mask_without_a_mask_mod_names_it():
    with pytest.raises(TypeError, match="mask_mod must be a callable"):
        flexlab.create_block_mask(None, 1, 1, 128, 128)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a torch without CUDA")
def test_create_block_mask_on_a_missing_gpu_names_the_device():
    with pytest.raises(flexlab.BackendUnavailableError, match="device='cuda'"):
        flexlab.create_block_mask(causal, 1, 1, 128, 128, device="cuda")


@pytest.mark.parametrize("kwargs,match", [({"q_len": 64.0}, "q_len"), ({"q_len": 64, "samples": 0}, "samples"),
                                          ({"q_len": 64, "head_dim": 0}, "head_dim")])
def test_plot_mask_arguments_are_checked(kwargs, match):
    pytest.importorskip("plotly")
    from flexlab.viz import plot_mask

    def soft(score, b, h, q_idx, kv_idx):
        return score

    with pytest.raises(ValueError, match=f"{match} must be a positive int"):
        plot_mask(causal, soft, **kwargs)


@pytest.mark.parametrize("kwargs,match", [({"num_sms": 0}, "num_sms"), ({"Q_LEN": 100.7}, "Q_LEN"),
                                          ({"head_dim": 0}, "head_dim"), ({"partial_cost": -1}, "partial_cost")])
def test_inspect_blocks_arguments_are_checked(kwargs, match):
    from flexlab.viz import inspect_blocks
    kwargs = {"Q_LEN": 256, **kwargs}
    with pytest.raises(ValueError, match=match):
        inspect_blocks(causal, **kwargs)
