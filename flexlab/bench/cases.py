"""The attention variants of the benchmark, built from the gallery, and how each peer can express them.

A peer only gets a row when it computes the same function: SDPA has no score_mod and a mask tensor would turn it
into a different (dense, materialized) algorithm, so it runs dense and causal only; FA4's own entry points have
built-in causal, sliding-window, soft-capping and variable-length (packed documents) modes but no ALiBi.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import torch

# Sizes of the benchmark's variants (the rows of the performance issues).
SLIDING_WINDOW = 1024
NUM_DOCUMENTS = 8
SOFTCAP = 20.0


@dataclass(frozen=True, eq=False)
class Case:
    """One variant at one shape: the mods every flex peer runs, and how the other peers spell the same thing.

    ``fa4`` holds keyword arguments for ``flash_attn.cute.flash_attn_func`` (or, with ``cu_seqlens`` present, for
    ``flash_attn_varlen_func``); ``sdpa`` those for ``scaled_dot_product_attention``. ``None`` means that peer
    cannot express the variant and the row marks it n/a.
    """

    variant: str
    score_mod: Callable | None
    mask_mod: Callable | None
    tensors: dict = field(default_factory=dict)
    fa4: dict | None = None
    sdpa: dict | None = None
    autotune_peer: bool = False
    mods_source: str = ""

    @property
    def gallery_variants(self) -> list[str]:
        """Names of the gallery variants whose mods this case runs (for tools that index results by variant)."""
        return re.findall(r"gallery:(\w+)", self.mods_source)


def _gallery_mods(name: str, B: int, H: int, S: int, device, **params):
    from ..gallery import get_variant
    return get_variant(name).build(B=B, H=H, Q_LEN=S, KV_LEN=S, device=device, **params)


def document_cu_seqlens(document_id: torch.Tensor, B: int) -> tuple[torch.Tensor, int]:
    """Packed-sequence offsets for FA4's varlen API: every batch row holds the same documents (int32, max length)."""
    S = document_id.numel()
    lengths = torch.bincount(document_id.long().cpu())
    lengths = lengths[lengths > 0]
    starts = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)])
    cu = torch.cat([starts[:-1] + b * S for b in range(B)] + [torch.tensor([B * S])]).to(torch.int32)
    return cu.to(document_id.device), int(lengths.max())


def build_case(variant: str, B: int, H: int, S: int, device) -> Case:
    """The mods and peer spellings for one benchmark variant (see `flexlab.bench.rows` for the names)."""
    if variant == "dense":
        return Case(variant, None, None, fa4={"causal": False}, sdpa={"is_causal": False}, mods_source="none")
    causal = _gallery_mods("causal", B, H, S, device).mask_mod
    if variant == "causal":
        return Case(variant, None, causal, fa4={"causal": True}, sdpa={"is_causal": True},
                    mods_source="gallery:causal")
    if variant == "sliding_window":
        mods = _gallery_mods("sliding_window", B, H, S, device, window=SLIDING_WINDOW)
        # The gallery's window counts the query itself; FA4's left window does not.
        return Case(variant, None, mods.mask_mod, fa4={"causal": True, "window_size": (SLIDING_WINDOW - 1, 0)},
                    mods_source=f"gallery:sliding_window(window={SLIDING_WINDOW})")
    if variant == "document":
        mods = _gallery_mods("document", B, H, S, device, num_documents=NUM_DOCUMENTS)
        cu, max_len = document_cu_seqlens(mods.tensors["document_id"], B)
        return Case(variant, None, mods.mask_mod, dict(mods.tensors),
                    fa4={"causal": True, "cu_seqlens": cu, "max_seqlen": max_len}, autotune_peer=True,
                    mods_source=f"gallery:document(num_documents={NUM_DOCUMENTS})")
    if variant == "alibi_causal":
        mods = _gallery_mods("alibi", B, H, S, device)
        return Case(variant, mods.score_mod, causal, mods_source="gallery:alibi + gallery:causal")
    if variant == "softcap_causal":
        mods = _gallery_mods("softcap", B, H, S, device, cap=SOFTCAP)
        return Case(variant, mods.score_mod, causal, fa4={"causal": True, "softcap": SOFTCAP},
                    mods_source=f"gallery:softcap(cap={SOFTCAP:g}) + gallery:causal")
    raise ValueError(f"unknown benchmark variant {variant!r}; known: {', '.join(VARIANTS)}")


VARIANTS = ("dense", "causal", "sliding_window", "document", "alibi_causal", "softcap_causal")
