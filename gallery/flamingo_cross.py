"""Flamingo-style cross attention: each text token sees only the image that most recently preceded it."""
import torch

from flexlab.gallery import Mods, Param, Variant


def generate_flamingo_cross(image_of_text: torch.Tensor, image_of_key: torch.Tensor):
    """`image_of_text[q]`: last image before text token q (-1: none yet); `image_of_key[kv]`: image of key kv."""

    def flamingo_cross(b, h, q_idx, kv_idx):
        return image_of_text[q_idx] == image_of_key[kv_idx]

    return flamingo_cross


def interleaving(q_len: int, kv_len: int, num_images: int, device="cpu"):
    """Images spread evenly over the text (the first a little after the start); image tokens split evenly."""
    num_images = max(1, min(num_images, kv_len))
    starts = torch.tensor([round((i + 0.25) * q_len / num_images) for i in range(num_images)])
    text = torch.arange(q_len)
    image_of_text = (text[:, None] >= starts[None, :]).sum(1) - 1
    image_of_key = torch.arange(kv_len) * num_images // kv_len
    return image_of_text.to(torch.int32).to(device), image_of_key.to(torch.int32).to(device)


def make(B, H, Q_LEN, KV_LEN, device="cpu", num_images=4):
    image_of_text, image_of_key = interleaving(Q_LEN, KV_LEN, num_images, device)
    return Mods(mask_mod=generate_flamingo_cross(image_of_text, image_of_key),
                tensors={"image_of_text": image_of_text, "image_of_key": image_of_key})


VARIANT = Variant(
    name="flamingo_cross",
    description="Text queries attend to the visual tokens of the latest preceding image; text before any image "
                "sees nothing.",
    paper="https://arxiv.org/abs/2204.14198",
    kind="mask",
    make=make,
    params=(Param("num_images", 4, 1, 32, 1, "images interleaved with the text"),),
    lengths_rule="any Q_LEN (text tokens) and KV_LEN (visual tokens of all images); usually Q_LEN != KV_LEN",
    example_lengths=(300, 256),
)
