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

import math

import torch

LOG2_E = math.log2(math.e)


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


def preprocess_padded(out, dout, lse, dlse, seqlen_padded: int):
    """What `bwd_preprocess` writes, in torch: (D, LSE2), padded to `seqlen_padded` rows; padded and fully masked
    rows get D = 0 and LSE2 = +inf (so every P of theirs is exactly 0)."""
    B, H, Sq, _ = out.shape
    compute = torch.float64 if out.dtype == torch.float64 else torch.float32
    d = torch.zeros((B, H, seqlen_padded), dtype=compute, device=out.device)
    lse2 = torch.full((B, H, seqlen_padded), float("inf"), dtype=compute, device=out.device)
    alive = torch.isfinite(lse)
    dot = preprocess(out, dout, dlse, compute)
    d[:, :, :Sq] = torch.where(alive, dot, torch.zeros_like(dot))
    lse2[:, :, :Sq] = torch.where(alive, lse.to(compute) * LOG2_E, torch.full_like(dot, float("inf")))
    return d, lse2


def tiled_backward(dout, q, k, v, out, lse, dlse, scale: float, generated, block_mask: list, block_size: list,
                   tile_m: int = 64, tile_n: int = 128):
    """The backward kernel's walk, tile by tile, in torch: one "CTA" per (batch, KV head, KV tile) visits the Q tiles
    of every query head of its group that the Q-direction lists name (partial ones with mask_mod, in list order), or
    all Q tiles from the last without a mask; dQ partials are summed in increasing KV-tile order.

    It reads the same padded D/LSE2 and the same Q-direction lists as the kernel, so on CPU it checks the schedule,
    padding and masking rules the GPU kernel relies on; on a GPU its per-tile values are a debugging oracle.
    """
    from .bwd_config import BwdConfig
    from .bwd_launch import q_direction_tensors

    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, Hq, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    cfg = BwdConfig(head_dim=D, tile_m=tile_m, tile_n=tile_n)
    sparse, pad = None, tile_m
    if block_mask:
        sparse = q_direction_tensors(block_mask, block_size, cfg, Skv)
        pad = math.lcm(tile_m, int(block_size[0]))
    sq_pad, n_tiles = -(-Sq // pad) * pad, -(-Skv // tile_n)
    d, lse2 = preprocess_padded(out, dout, lse, dlse, sq_pad)
    qp, dop = (torch.nn.functional.pad(t.to(compute), (0, 0, 0, sq_pad - Sq)) for t in (q, dout))
    kp, vp = (torch.nn.functional.pad(t.to(compute), (0, 0, 0, n_tiles * tile_n - Skv)) for t in (k, v))
    has_mod = generated is not None and generated.has_score_mod
    has_mask = generated is not None and generated.has_mask_mod and sparse is not None
    c = LOG2_E if has_mod else scale * LOG2_E
    dq = torch.zeros((B, Hq, sq_pad, D), dtype=compute)
    dk, dv = torch.zeros_like(kp), torch.zeros_like(vp)
    aux_grads = None
    for b in range(B):
        for hk in range(Hkv):
            for n in range(n_tiles):
                kv_idx = torch.arange(n * tile_n, (n + 1) * tile_n)
                kt, vt = kp[b, hk, kv_idx], vp[b, hk, kv_idx]
                for h in range(hk * group, (hk + 1) * group):
                    if sparse is None:
                        steps = [(m, False) for m in reversed(range(sq_pad // tile_m))]
                    else:
                        num, idx, fnum, fidx = sparse
                        mb, mh = b % num.shape[0], h % num.shape[1]
                        steps = ([(int(m), True) for m in idx[mb, mh, n, :num[mb, mh, n]]]
                                 + [(int(m), False) for m in fidx[mb, mh, n, :fnum[mb, mh, n]]])
                    for m, partial in steps:
                        q_idx = torch.arange(m * tile_m, (m + 1) * tile_m)
                        qi = q_idx.clamp(max=Sq - 1).view(-1, 1)
                        ki = kv_idx.clamp(max=Skv - 1).view(1, -1)
                        bi, hi = torch.tensor(b), torch.tensor(h)
                        qk = qp[b, h, q_idx] @ kt.T
                        raw = qk * scale  # what the score_mod sees; without one the scale rides in c instead
                        x = generated.evaluate_score_mod(raw, bi, hi, qi, ki).to(compute) if has_mod else qk
                        if partial and has_mask:
                            x = x.masked_fill(~generated.evaluate_mask_mod(bi, hi, qi, ki), float("-inf"))
                        x = x.masked_fill((kv_idx >= Skv).view(1, -1), float("-inf"))
                        p = torch.exp2(x * c - lse2[b, h, q_idx].view(-1, 1))
                        ds = p * (dop[b, h, q_idx] @ vt.T - d[b, h, q_idx].view(-1, 1))
                        if has_mod and any(generated.aux_requires_grad):
                            step = generated.evaluate_aux_grads(ds, raw, bi, hi, qi, ki)
                            aux_grads = step if aux_grads is None else [a + s for a, s in zip(aux_grads, step)]
                        if has_mod:
                            ds = generated.evaluate_score_mod_bwd(ds, raw, bi, hi, qi, ki).to(compute)
                        dv[b, hk, kv_idx] += p.T @ dop[b, h, q_idx]
                        dk[b, hk, kv_idx] += ds.T @ qp[b, h, q_idx]
                        dq[b, h, q_idx] += ds @ kt
    grads = [] if aux_grads is None else [g.float() for g in aux_grads]
    return ((dq[:, :, :Sq] * scale).to(q.dtype), (dk[:, :, :Skv] * scale).to(k.dtype), dv[:, :, :Skv].to(v.dtype),
            grads)
