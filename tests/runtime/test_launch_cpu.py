"""Host-side pieces of the launch path that need no GPU."""
from __future__ import annotations

import torch

from flexlab.backends import cute as backend
from flexlab.codegen.generated import row_major
from flexlab.runtime.launch import tma_ready


def test_tma_ready_copies_only_when_needed():
    t = torch.randn(2, 3, 40, 64, dtype=torch.bfloat16)
    assert tma_ready(t) is t
    bshd = torch.randn(2, 40, 3, 64, dtype=torch.bfloat16).transpose(1, 2)
    assert tma_ready(bshd) is bshd  # strided but TMA-legal
    odd = torch.randn(2, 3, 40, 65, dtype=torch.bfloat16)[..., :64]
    assert tma_ready(odd) is not odd and tma_ready(odd).is_contiguous()
    d_strided = torch.randn(2, 3, 64, 40, dtype=torch.bfloat16).transpose(-1, -2)
    assert tma_ready(d_strided).stride(-1) == 1


def test_tma_ready_copies_a_contiguous_but_misaligned_view():
    """`contiguous()` returns such a view as it is, and the kernel call then refuses its base address."""
    buf = torch.randn(3 * 40 * 64 + 8, dtype=torch.bfloat16)
    shifted = buf[4:4 + 3 * 40 * 64].view(1, 3, 40, 64)  # 8 bytes past a 16-byte boundary
    assert shifted.is_contiguous() and shifted.data_ptr() % 16
    fixed = tma_ready(shifted)
    assert fixed.data_ptr() % 16 == 0 and torch.equal(fixed, shifted)
    odd_batch_stride = torch.randn(3, 40, 64, dtype=torch.bfloat16).as_strided((1, 3, 40, 64), (7, 2560, 64, 1))
    assert odd_batch_stride.is_contiguous()  # torch ignores the stride of a size-1 dim; TMA does not
    assert tma_ready(odd_batch_stride).stride(0) % 8 == 0


def test_row_major_fixes_what_contiguous_lets_through():
    """Captured tensors are compiled with a static unit stride on the last mode; torch calls these contiguous."""
    table = torch.arange(12, dtype=torch.int32).view(3, 4)
    assert row_major(table) is table
    expanded = torch.tensor(5.0).expand(1)
    column = torch.randn(1, 5).t()
    for t in (expanded, column):
        assert t.is_contiguous() and t.stride(-1) != 1
        fixed = row_major(t)
        assert fixed.stride(-1) == 1 and torch.equal(fixed, t)
    assert row_major(column).stride() == (1, 1)
    assert row_major(table[:, 1:3]).stride() == (2, 1)


def test_cpu_tensors_are_not_supported_with_a_reason():
    q = torch.randn(1, 2, 16, 64, dtype=torch.bfloat16)
    ok, reason = backend.is_supported(q, q, q, None, None, None, False)
    assert not ok and "CUDA" in reason


def test_mask_block_size_rule_names_the_fix():
    assert "BLOCK_SIZE=128" in backend._mask_reason((64, 64), 128)
    assert backend._mask_reason((256, 128), 128) == ""
    assert backend._mask_reason((128, 128), 256) == ""  # D=256 uses 128x64 tiles; 128 is a multiple of both
