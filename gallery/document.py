"""Document masking for packed sequences: several documents share one row, none sees another."""
import torch

from flexlab.gallery import Mods, Param, Variant


def generate_document(document_id: torch.Tensor):
    """`document_id[i]` is the document that token i belongs to (one packed row, shared by queries and keys)."""

    def document_causal(b, h, q_idx, kv_idx):
        same_document = document_id[q_idx] == document_id[kv_idx]
        causal = q_idx >= kv_idx
        return same_document & causal

    return document_causal


def document_ids(seq_len: int, num_documents: int, device="cpu", seed: int = 0) -> torch.Tensor:
    """Split `seq_len` tokens into `num_documents` documents of uneven, reproducible lengths."""
    num_documents = max(1, min(num_documents, seq_len))
    generator = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(seq_len - 1, generator=generator)[: num_documents - 1] + 1
    starts = torch.zeros(seq_len, dtype=torch.int32)
    starts[cuts] = 1
    return torch.cumsum(starts, 0).to(torch.int32).to(device)


def make(B, H, Q_LEN, KV_LEN, device="cpu", num_documents=4):
    document_id = document_ids(KV_LEN, num_documents, device)
    return Mods(mask_mod=generate_document(document_id), tensors={"document_id": document_id})


VARIANT = Variant(
    name="document",
    description="Packed sequences: causal attention that never crosses a document boundary (captured doc ids).",
    paper="https://arxiv.org/abs/2107.02027",
    kind="mask",
    make=make,
    params=(Param("num_documents", 4, 1, 64, 1, "documents packed into the row (uneven lengths)"),),
    lengths_rule="Q_LEN == KV_LEN (queries and keys are the same packed row)",
    accepts=lambda q_len, kv_len: q_len == kv_len,
    builtin_equivalent="flash_attn_varlen_func(cu_seqlens_q=cu_seqlens_k, causal=True)",
)
