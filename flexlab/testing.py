"""Test helpers shared by flexlab's tests, notebooks and benchmarks: tolerances, errors, inputs, ground truth."""
from __future__ import annotations

import torch

# Largest rel-L2 error vs the float64 reference that a backend may show, per input dtype. bf16 has 8 mantissa bits
# (eps 2^-8), fp16 11; attention output is an average, so its error sits well under one eps.
TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1e-2,
}

# Largest absolute error of a kernel's log-sum-exp (natural log) vs float64. Scores come from exact products of the
# 16-bit inputs summed in fp32, so the LSE is good to ~1e-5; the margin is for score_mods under fastmath, whose
# tanh.approx (relative error ~2^-11) shifts a softcapped score by up to ~cap * 5e-4.
LSE_ABS_TOL = 5e-3

# Lengths that catch tile-boundary bugs: single rows, one below/above a tile, non-multiples, unequal Q/KV.
AWKWARD_LENGTHS: tuple[tuple[int, int], ...] = ((1, 1), (127, 127), (129, 129), (1000, 1000), (1023, 1024),
                                                (200, 333), (333, 200))


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖₂ / ‖expected‖₂ in float64 (0 when both are zero)."""
    a, e = actual.detach().double(), expected.detach().double()
    denom = e.norm().item()
    diff = (a - e).norm().item()
    return diff if denom == 0 else diff / denom


def max_abs(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.detach().double() - expected.detach().double()).abs().max().item()


def random_qkv(B: int, H: int, Sq: int, Skv: int, D: int, dtype=torch.float32, device="cpu", Hkv: int | None = None,
               requires_grad: bool = False, generator: torch.Generator | None = None):
    """Fresh normal q, k, v of shapes (B, H, Sq, D), (B, Hkv, Skv, D) ×2 — never zeros, so bugs can't hide."""
    Hkv = H if Hkv is None else Hkv
    q = torch.randn(B, H, Sq, D, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)
    k = torch.randn(B, Hkv, Skv, D, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)
    v = torch.randn(B, Hkv, Skv, D, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)
    if requires_grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


def reference(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False):
    """Float64 ground truth: (out, lse), both float64."""
    from .backends.reference import reference_attention
    return reference_attention(query, key, value, score_mod, block_mask, scale, enable_gqa, torch.float64)
