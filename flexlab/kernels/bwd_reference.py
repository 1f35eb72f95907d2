"""The backward kernel's algorithm in dense torch math: the CPU implementation of the backward op.

It walks the same steps as `bwd_preprocess` + `bwd_sm90` + `bwd_postprocess`, on whole (Sq, Skv) matrices instead of
tiles, and uses the code generator's derivative exactly as the kernel inlines it:

    D      = rowsum(dO * O) - dLSE                     (preprocess; dLSE only when the LSE output is used)
    P      = exp(score_mod(s) - LSE), 0 where masked   (recomputed from the saved LSE, never stored by the forward)
    dP     = dO V^T
    dS     = P * (dP - D)                              (gradient w.r.t. the modified score)
    dscore = score_mod_bwd(dS, s)                      (gradient w.r.t. the scaled score s = scale * Q K^T)
    dQ = scale * dscore K,  dK = scale * dscore^T Q,  dV = P^T dO   (dK, dV summed over a GQA group)
    captured-tensor grads = score_mod_aux_grad(dS, s)

Comparing this against torch autograd through the reference backend checks the algorithm and the generated
derivative on CPU; the GPU tests then compare the kernel against the same float64 ground truth.
Unlike the other modules in this package it needs only torch.
"""
from __future__ import annotations

import torch


def _index_grid(B: int, H: int, Sq: int, Skv: int, device) -> list[torch.Tensor]:
    """Broadcastable (B,1,1,1), (1,H,1,1), (1,1,Sq,1), (1,1,1,Skv) indices, as the generated evaluators take them."""
    from ..mods import index_grid
    return [t.view([-1 if d == i else 1 for d in range(4)]) for i, t in enumerate(index_grid(B, H, Sq, Skv, device))]


def kept_pairs(block_mask, generated, B: int, H: int, Sq: int, Skv: int, device) -> torch.Tensor | None:
    """(B, H, Sq, Skv) bool of the pairs the kernel keeps: full blocks, and partial blocks where mask_mod is True."""
    if block_mask is None:
        return None
    from ..mask import BLOCK_FULL, BLOCK_PARTIAL, block_states
    q_bs, kv_bs = (int(x) for x in block_mask.BLOCK_SIZE)
    states = block_states(block_mask).to(device)
    states = states.repeat_interleave(q_bs, dim=2)[:, :, :Sq].repeat_interleave(kv_bs, dim=3)[:, :, :, :Skv]
    keep = states == BLOCK_FULL
    partial = states == BLOCK_PARTIAL
    if generated is not None and generated.has_mask_mod:
        partial = partial & generated.evaluate_mask_mod(*_index_grid(B, H, Sq, Skv, device))
    return (keep | partial).expand(B, H, Sq, Skv)


def _scores(q, k, scale: float, generated, compute):
    """(s, score_mod(s)): the scaled scores, before and after the mod, with K/V heads repeated for GQA."""
    B, Hq, Sq, _ = q.shape
    kf = k.to(compute).repeat_interleave(Hq // k.shape[1], dim=1)
    s = (q.to(compute) @ kf.transpose(-1, -2)) * scale
    if generated is None or not generated.has_score_mod:
        return s, s
    idx = _index_grid(B, Hq, Sq, k.shape[2], q.device)
    return s, generated.evaluate_score_mod(s, *idx).to(compute)


def dense_forward(q, k, v, scale: float, generated, keep: torch.Tensor | None):
    """(out in q's dtype, lse fp32): the forward the backward differentiates, with the generated mods."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    _, modded = _scores(q, k, scale, generated, compute)
    if keep is not None:
        modded = modded.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(modded, dim=-1, keepdim=True)
    alive = torch.isfinite(lse)  # fully masked rows: output 0, LSE -inf
    p = torch.where(alive, torch.exp(modded - torch.where(alive, lse, torch.zeros_like(lse))),
                    torch.zeros_like(modded))
    vf = v.to(compute).repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return (p @ vf).to(q.dtype), lse.squeeze(-1).float()


def preprocess(out: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None, compute) -> torch.Tensor:
    """D = rowsum(dO * O) - dLSE, (B, H, Sq) in `compute` dtype."""
    d = (dout.to(compute) * out.to(compute)).sum(-1)
    return d if dlse is None else d - dlse.to(compute)


def dense_backward(dout, q, k, v, out, lse, dlse, scale: float, generated, keep: torch.Tensor | None):
    """(dq, dk, dv, aux_grads) in the inputs' dtypes; aux grads (fp32) for the captured tensors that require grad.

    `generated` is the code generator's `GeneratedMods` (or None); `keep` is `kept_pairs(...)`.
    """
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, Hq, Sq, _ = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    qf, kf, vf, dof = (t.to(compute) for t in (q, k, v, dout))
    kf, vf = kf.repeat_interleave(group, dim=1), vf.repeat_interleave(group, dim=1)
    idx = _index_grid(B, Hq, Sq, Skv, q.device)

    s, modded = _scores(q, k, scale, generated, compute)
    has_score_mod = generated is not None and generated.has_score_mod
    lse_c = lse.to(compute).unsqueeze(-1)
    alive = torch.isfinite(lse_c)  # fully masked rows have LSE = -inf and no gradient
    p = torch.where(alive, torch.exp(modded - torch.where(alive, lse_c, torch.zeros_like(lse_c))),
                    torch.zeros_like(modded))
    if keep is not None:
        p = p.masked_fill(~keep, 0.0)

    d = preprocess(out, dout, dlse, compute).unsqueeze(-1)
    dp = dof @ vf.transpose(-1, -2)
    ds = p * (dp - d)
    dscore = generated.evaluate_score_mod_bwd(ds, s, *idx).to(compute) if has_score_mod else ds
    if keep is not None:
        dscore = dscore.masked_fill(~keep, 0.0)

    dq = (dscore @ kf) * scale
    dk = (dscore.transpose(-1, -2) @ qf) * scale
    dv = p.transpose(-1, -2) @ dof
    if group > 1:
        dk = dk.view(B, Hkv, group, Skv, -1).sum(2)
        dv = dv.view(B, Hkv, group, Skv, -1).sum(2)
    aux_grads = []
    if has_score_mod and any(generated.aux_requires_grad):
        aux_grads = [g.float() for g in generated.evaluate_aux_grads(ds, s, *idx)]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), aux_grads
