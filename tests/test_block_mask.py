"""create_block_mask equals torch's, is built without an S×S mask, and block_states splits full from partial."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch.nn.attention.flex_attention import and_masks, or_masks
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

import flexlab
from flexlab.mask import BLOCK_EMPTY, BLOCK_FULL, BLOCK_PARTIAL, block_states
from mod_matrix import MOD_NAMES, make_mods

FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
          "full_q_num_blocks", "full_q_indices")


def assert_same_block_mask(ours, theirs):
    for f in FIELDS:
        a, b = getattr(ours, f), getattr(theirs, f)
        assert (a is None and b is None) or torch.equal(a, b), f
    assert tuple(ours.BLOCK_SIZE) == tuple(theirs.BLOCK_SIZE)
    assert tuple(ours.seq_lengths) == tuple(theirs.seq_lengths)


MASK_NAMES = [n for n in MOD_NAMES if make_mods(1, 1, 8, 8)[n][1] is not None]


@pytest.mark.parametrize("size", [(1, 2, 1000, 1000), (2, 3, 129, 300), (1, 2, 300, 127), (2, 1, 1, 1)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", MASK_NAMES)
@pytest.mark.parametrize("block", [128, (64, 128)], ids=["b128", "b64x128"])
def test_equals_torch(name, size, block):
    B, H, Sq, Skv = size
    mask_mod = make_mods(B, H, Sq, Skv)[name][1]
    ours = flexlab.create_block_mask(mask_mod, B, H, Sq, Skv, BLOCK_SIZE=block)
    theirs = torch_create_block_mask(mask_mod, B, H, Sq, Skv, device="cpu", BLOCK_SIZE=block)
    assert_same_block_mask(ours, theirs)


def test_takes_every_torch_argument_in_torchs_order():
    """torch's create_block_mask calls run unchanged (the device default stays the CPU; None is torch's)."""
    import inspect
    ours = inspect.signature(flexlab.create_block_mask).parameters
    theirs = inspect.signature(torch_create_block_mask).parameters
    positional = [n for n, p in theirs.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert [n for n, p in ours.items() if p.kind == p.POSITIONAL_OR_KEYWORD][:len(positional)] == positional
    for name in positional:
        if name != "device":
            assert ours[name].default == theirs[name].default, name
    built_on = flexlab.create_block_mask(lambda b, h, q, kv: q >= kv, 1, 1, 64, 64, None).kv_num_blocks.device
    assert built_on.type == (torch.accelerator.current_accelerator().type if torch.accelerator.is_available()
                             else "cpu")


@pytest.mark.parametrize("name", ["causal", "document", "fully_masked_rows"])
def test_without_separate_full_blocks_every_block_is_partial(name):
    """separate_full_blocks=False: torch's lists with no full ones; flexlab's attention (the reference, run by the
    block lists) still gives the same output, now with mask_mod on every block."""
    import inspect
    B, H, S = 2, 2, 300
    mask_mod = make_mods(B, H, S, S)[name][1]
    ours = flexlab.create_block_mask(mask_mod, B, H, S, S, BLOCK_SIZE=64, separate_full_blocks=False)
    assert ours.full_kv_num_blocks is None and ours.full_q_num_blocks is None
    separate = flexlab.create_block_mask(mask_mod, B, H, S, S, BLOCK_SIZE=64)
    assert torch.equal(ours.kv_num_blocks, separate.kv_num_blocks + separate.full_kv_num_blocks)
    if "separate_full_blocks" in inspect.signature(torch_create_block_mask).parameters:
        theirs = torch_create_block_mask(mask_mod, B, H, S, S, device="cpu", BLOCK_SIZE=64,
                                         separate_full_blocks=False)
        assert_same_block_mask(ours, theirs)
    q, k, v = (torch.randn(B, H, S, 16, dtype=torch.float64) for _ in range(3))
    a = flexlab.flex_attention(q, k, v, block_mask=ours, backend="reference")
    b = flexlab.flex_attention(q, k, v, block_mask=separate, backend="reference")
    assert torch.allclose(a, b, atol=1e-12) and a.abs().sum() > 0


def test_dq_write_order_is_torchs_where_torch_has_it():
    from torch.nn.attention import flex_attention as torch_flex
    causal = make_mods(1, 1, 512, 512)["causal"][1]
    if not hasattr(torch_flex, "_compute_dq_write_order_from_block_mask"):
        with pytest.raises(flexlab.BackendUnavailableError, match="compute_dq_write_order=True needs torch's"):
            flexlab.create_block_mask(causal, 1, 1, 512, 512, compute_dq_write_order=True)
        return
    for order in (True, False):
        ours = flexlab.create_block_mask(causal, 1, 1, 512, 512, compute_dq_write_order=True, dq_kv_order=order)
        theirs = torch_create_block_mask(causal, 1, 1, 512, 512, device="cpu", compute_dq_write_order=True,
                                         dq_kv_order=order)
        assert torch.equal(ours.dq_write_order, theirs.dq_write_order)
        assert torch.equal(ours.dq_write_order_full, theirs.dq_write_order_full)
        assert ours.dq_kv_order_spt == theirs.dq_kv_order_spt == order


@pytest.mark.parametrize("name", ["_compile", "separate_full_blocks", "compute_dq_write_order", "dq_kv_order"])
def test_flags_are_checked_by_name(name):
    with pytest.raises(TypeError, match=f"create_block_mask: {name} must be True or False"):
        flexlab.create_block_mask(lambda b, h, q, kv: q >= kv, 1, 1, 64, 64, **{name: "yes"})


def test_create_mask_of_a_score_mod_is_torchs():
    """torch's create_mask takes a score_mod too: the pairs it does not send to -inf."""
    from torch.nn.attention.flex_attention import create_mask as torch_create_mask

    def causal_drift(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx >= kv_idx + h, score + 0.1 * (q_idx - kv_idx), -float("inf"))

    ours = flexlab.create_mask(causal_drift, 2, 3, 70, 90)
    theirs = torch_create_mask(causal_drift, 2, 3, 70, 90, device="cpu")
    assert ours.dtype == torch.bool and torch.equal(ours, theirs) and 0 < ours.sum() < ours.numel()


def test_small_chunks_give_the_same_answer():
    mask_mod = make_mods(2, 3, 700, 900)["document"][1]
    a = flexlab.create_block_mask(mask_mod, 2, 3, 700, 900, BLOCK_SIZE=64, chunk_elements=5000)
    b = torch_create_block_mask(mask_mod, 2, 3, 700, 900, device="cpu", BLOCK_SIZE=64)
    assert_same_block_mask(a, b)


def test_head_dependent_mask_and_combinators():
    def even_heads_causal(b, h, q_idx, kv_idx):
        return (h % 2 == 0) & (q_idx >= kv_idx)

    def local(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() < 40

    for mod in (and_masks(even_heads_causal, local), or_masks(even_heads_causal, local), flexlab.noop_mask):
        a = flexlab.create_block_mask(mod, 2, 4, 300, 260, BLOCK_SIZE=32)
        b = torch_create_block_mask(mod, 2, 4, 300, 260, device="cpu", BLOCK_SIZE=32)
        assert_same_block_mask(a, b)


def test_block_states_partition_the_tiles():
    mask_mod = make_mods(1, 1, 1000, 1000)["sliding_window"][1]
    bm = flexlab.create_block_mask(mask_mod, None, None, 1000, 1000, BLOCK_SIZE=16)
    states = block_states(bm)
    dense = flexlab.create_mask(mask_mod, 1, 1, 1000, 1000)
    padded = torch.nn.functional.pad(dense, (0, 8, 0, 8)).view(1, 1, 63, 16, 63, 16).permute(0, 1, 2, 4, 3, 5)
    kept = padded.sum(dim=(-1, -2))
    assert torch.equal(states == BLOCK_EMPTY, kept == 0)
    assert torch.equal(states == BLOCK_FULL, kept == 16 * 16)
    assert torch.equal(states == BLOCK_PARTIAL, (kept > 0) & (kept < 16 * 16))
    assert (states == BLOCK_FULL).any() and (states == BLOCK_PARTIAL).any() and (states == BLOCK_EMPTY).any()


def test_block_states_of_a_torch_block_mask():
    mask_mod = make_mods(1, 1, 512, 512)["causal"][1]
    states = block_states(torch_create_block_mask(mask_mod, 1, 1, 512, 512, device="cpu"))
    expected = torch.tensor([[2, 0, 0, 0], [2, 2, 0, 0], [2, 2, 2, 0], [2, 2, 2, 2]], dtype=torch.int8)
    expected.fill_diagonal_(1)
    assert torch.equal(states[0, 0], expected)


def test_64k_causal_mask_peak_memory_is_far_below_s_squared():
    """64k² bools would be 4 GiB; the chunked build must stay within a small, fixed budget above the baseline."""
    script = textwrap.dedent("""
        import resource, torch, flexlab
        def causal(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx
        flexlab.create_block_mask(causal, 1, 1, 64, 64)            # warm up lazy imports
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        bm = flexlab.create_block_mask(causal, 1, 1, 65536, 65536)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        assert int(bm.kv_num_blocks.sum()) == 512 and int(bm.full_kv_num_blocks.sum()) == 512 * 511 // 2
        print((peak - base) * 1024)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    grown = int(out.stdout.strip().splitlines()[-1])
    assert grown < 256 * 2 ** 20, f"peak memory grew by {grown / 2**20:.0f} MiB (64k² bools = 4096 MiB)"
