"""Correctness inside the benchmark: every backend's output is compared with a float64 reference before its time
counts, so a broken or silently different peer cannot post a number.

The reference covers two (batch, head) pairs in full (all queries and keys), computed in float64 chunk by chunk of
query rows, so it stays cheap at S=16k. For forward+backward rows the same chunked graph gives exact dQ, dK and dV for
those pairs (rows are independent, so per-chunk gradients of K and V add up exactly).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..mods import evaluate_mask_mod, evaluate_score_mod
from ..testing import TOLERANCES, rel_l2

# Gradients accumulate over the whole sequence in low precision; allow twice the output's tolerance.
GRAD_TOLERANCE_FACTOR = 2.0
ROWS_PER_CHUNK = 1024


def checked_pairs(B: int, H: int) -> list[tuple[int, int]]:
    """The (b, h) pairs the reference covers: first and last, so batch and head indexing are both exercised."""
    return sorted({(0, 0), (B - 1, H - 1)})


@dataclass
class Reference:
    pairs: list[tuple[int, int]]
    out: torch.Tensor                 # (P, S, D) float64
    grads: tuple | None = None        # (dq, dk, dv), each (P, S, D) float64, for forward+backward rows


def _pair_attention(q, k, v, score_mod, mask_mod, b: int, h: int, rows: torch.Tensor, scale: float):
    """float64 attention of query rows `rows` of one (b, h) against all keys; q is (len(rows), D), k/v (S, D)."""
    device = q.device
    scores = (q @ k.transpose(0, 1)) * scale
    bi, hi = torch.tensor([b], device=device), torch.tensor([h], device=device)
    kv_idx = torch.arange(k.shape[0], device=device)
    if score_mod is not None:
        scores = evaluate_score_mod(score_mod, scores[None, None], bi, hi, rows, kv_idx)[0, 0]
    if mask_mod is not None:
        keep = evaluate_mask_mod(mask_mod, bi, hi, rows, kv_idx)[0, 0]
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    alive = torch.isfinite(lse)
    probs = torch.where(alive, torch.exp(scores - torch.where(alive, lse, torch.zeros_like(lse))),
                        torch.zeros_like(scores))
    return probs @ v


def reference(q, k, v, score_mod, mask_mod, dout=None) -> Reference:
    """float64 output (and gradients when `dout` is given) on the checked pairs; q, k, v, dout are (B, H, S, D)."""
    B, H, S, D = q.shape
    scale = D ** -0.5
    pairs = checked_pairs(B, H)
    outs, grads = [], []
    for b, h in pairs:
        qp, kp, vp = (t[b, h].detach().double() for t in (q, k, v))
        if dout is not None:
            qp, kp, vp = (t.clone().requires_grad_(True) for t in (qp, kp, vp))
        chunks = []
        for r0 in range(0, S, ROWS_PER_CHUNK):
            rows = torch.arange(r0, min(S, r0 + ROWS_PER_CHUNK), device=q.device)
            with torch.set_grad_enabled(dout is not None):
                o = _pair_attention(qp[rows], kp, vp, score_mod, mask_mod, b, h, rows, scale)
                if dout is not None:
                    (o * dout[b, h, rows].double()).sum().backward()
            chunks.append(o.detach())
        outs.append(torch.cat(chunks))
        if dout is not None:
            grads.append((qp.grad, kp.grad, vp.grad))
    out = torch.stack(outs)
    stacked = None if dout is None else tuple(torch.stack([g[i] for g in grads]) for i in range(3))
    return Reference(pairs, out, stacked)


def _take(t: torch.Tensor, pairs) -> torch.Tensor:
    return torch.stack([t[b, h] for b, h in pairs])


def compare(ref: Reference, out: torch.Tensor, grads: tuple | None, dtype: torch.dtype) -> dict:
    """rel-L2 errors of a backend's (B, H, S, D) output (and grads) vs the reference, and whether they pass."""
    tol = TOLERANCES[dtype]
    got = _take(out, ref.pairs)
    errors = {"out": rel_l2(got, ref.out)}
    finite = bool(torch.isfinite(got).all())
    passed = finite and errors["out"] <= tol
    if ref.grads is not None:
        if grads is None or any(g is None for g in grads):
            return {"rel_l2": errors, "passed": False, "why": "no gradients were produced"}
        for name, g, r in zip(("dq", "dk", "dv"), grads, ref.grads):
            gp = _take(g, ref.pairs)
            errors[name] = rel_l2(gp, r)
            finite = finite and bool(torch.isfinite(gp).all())
            passed = passed and errors[name] <= tol * GRAD_TOLERANCE_FACTOR
        passed = passed and finite
    result = {"rel_l2": errors, "passed": passed}
    if not passed:
        limits = f"out ≤ {tol:g}" + (f", grads ≤ {tol * GRAD_TOLERANCE_FACTOR:g}" if ref.grads is not None else "")
        result["why"] = ("non-finite values" if not finite else
                         "error above tolerance (" + limits + "): " +
                         ", ".join(f"{k}={v:.2e}" for k, v in errors.items()))
    return result
