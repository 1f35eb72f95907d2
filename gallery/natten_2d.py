"""2-D neighborhood attention (NATTEN): each pixel sees a kernel x kernel window, shifted inward at borders."""
import torch

from flexlab.gallery import Mods, Param, Variant


def generate_natten_2d(width: int, height: int, kernel: int):
    """Tokens are an image of `height` rows x `width` columns, flattened row by row."""
    half = kernel // 2

    def natten_2d(b, h, q_idx, kv_idx):
        q_row, q_col = q_idx // width, q_idx % width
        kv_row, kv_col = kv_idx // width, kv_idx % width
        # the window keeps its full size at the borders by sliding its centre inward
        centre_row = torch.clamp(q_row, half, height - 1 - half)
        centre_col = torch.clamp(q_col, half, width - 1 - half)
        near_row = torch.abs(kv_row - centre_row) <= half
        near_col = torch.abs(kv_col - centre_col) <= half
        return near_row & near_col

    natten_2d.__name__ = f"natten_2d_{height}x{width}_k{kernel}"
    return natten_2d


def make(B, H, Q_LEN, KV_LEN, device="cpu", width=16, kernel=7):
    height = -(-KV_LEN // width)
    return Mods(mask_mod=generate_natten_2d(width, height, kernel))


VARIANT = Variant(
    name="natten_2d",
    description="Neighborhood attention on a 2-D token grid: a kernel x kernel window, clamped inside the image.",
    paper="https://arxiv.org/abs/2204.07143",
    kind="mask",
    make=make,
    params=(Param("width", 16, 4, 256, 1, "image width in tokens (height = ceil(KV_LEN / width))"),
            Param("kernel", 7, 1, 31, 2, "window side, odd, at most the image side")),
    lengths_rule="Q_LEN == KV_LEN (self-attention over one image, flattened row-major; a short last row is fine)",
    accepts=lambda q_len, kv_len: q_len == kv_len,
)
