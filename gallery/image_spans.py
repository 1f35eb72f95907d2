"""Bidirectional image spans inside causal text (Gemma 3, PaliGemma): image tokens see their whole image."""
import torch

from flexlab.gallery import Mods, Param, Variant


def generate_image_spans(span_id: torch.Tensor):
    """`span_id[i]` is 0 for text tokens and k + 1 for tokens of image k."""

    def image_spans(b, h, q_idx, kv_idx):
        causal = q_idx >= kv_idx
        same_image = (span_id[q_idx] == span_id[kv_idx]) & (span_id[q_idx] > 0)
        return causal | same_image

    return image_spans


def span_ids(seq_len: int, num_images: int, image_tokens: int, device="cpu") -> torch.Tensor:
    """Images of `image_tokens` tokens placed evenly along the text, each after a stretch of text."""
    ids = torch.zeros(seq_len, dtype=torch.int32)
    stride = seq_len // max(1, num_images)
    for k in range(num_images):
        start = k * stride + stride // 4
        ids[start: min(start + image_tokens, seq_len)] = k + 1
    return ids.to(device)


def make(B, H, Q_LEN, KV_LEN, device="cpu", num_images=2, image_tokens=48):
    span_id = span_ids(KV_LEN, num_images, image_tokens, device)
    return Mods(mask_mod=generate_image_spans(span_id), tensors={"span_id": span_id})


VARIANT = Variant(
    name="image_spans",
    description="Causal over text; tokens of the same image attend to each other in both directions.",
    paper="https://arxiv.org/abs/2503.19786",
    kind="mask",
    make=make,
    params=(Param("num_images", 2, 0, 16, 1, "images in the row"),
            Param("image_tokens", 48, 1, 1024, 1, "tokens per image (256 in Gemma 3)")),
    lengths_rule="Q_LEN == KV_LEN (one interleaved row)",
    accepts=lambda q_len, kv_len: q_len == kv_len,
)
