"""Hand-written CuTeDSL mods with exactly the code generator's contract, so kernel tests do not depend on codegen.

score_mod(score, b, h, q_idx, kv_idx, aux_tensors, aux_scalars) -> Float32 (score already scaled)
mask_mod(b, h, q_idx, kv_idx, aux_tensors, aux_scalars) -> Boolean
Each has a torch twin (same math on 0-d tensors) used to build the float64 reference.
"""
from __future__ import annotations


import cutlass.cute as cute
import torch
from cutlass import Float32


@cute.jit
def causal_mask(b, h, q_idx, kv_idx, aux_tensors, aux_scalars):
    return q_idx >= kv_idx


def causal_mask_torch(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@cute.jit
def document_mask(b, h, q_idx, kv_idx, aux_tensors, aux_scalars):
    doc = aux_tensors[0]
    return doc[q_idx] == doc[kv_idx]


def document_mask_torch(doc):
    def mask_mod(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]
    return mask_mod


@cute.jit
def softcap_score(score, b, h, q_idx, kv_idx, aux_tensors, aux_scalars):
    cap = Float32(aux_scalars[0])
    return cap * cute.math.tanh(score / cap, fastmath=False)


def softcap_score_torch(cap):
    def score_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)
    return score_mod


@cute.jit
def alibi_score(score, b, h, q_idx, kv_idx, aux_tensors, aux_scalars):
    slopes = aux_tensors[0]
    return score + Float32(slopes[h]) * Float32(kv_idx - q_idx)


def alibi_score_torch(slopes):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    return score_mod




@cute.jit
def holes_causal_mask(b, h, q_idx, kv_idx, aux_tensors, aux_scalars):
    """Causal, with every 7th query row fully masked (checks output 0 / LSE -inf)."""
    return (q_idx % 7 != 0) & (q_idx >= kv_idx)


def holes_causal_mask_torch(b, h, q_idx, kv_idx):
    return (q_idx % 7 != 0) & (q_idx >= kv_idx)
