"""Dilated 2-D neighborhood attention (DiNAT): the NATTEN window over every `dilation`-th row and column."""
import torch

from flexlab.gallery import Mods, Param, Variant


def generate_natten_2d_dilated(width: int, height: int, kernel: int, dilation: int):
    """Pixels split into dilation x dilation interleaved sub-grids; attention is NATTEN within a sub-grid."""
    half = kernel // 2

    def natten_2d_dilated(b, h, q_idx, kv_idx):
        q_row, q_col = q_idx // width, q_idx % width
        kv_row, kv_col = kv_idx // width, kv_idx % width
        same_grid = (q_row % dilation == kv_row % dilation) & (q_col % dilation == kv_col % dilation)
        # size of the query's sub-grid, then the clamped window centre in sub-grid coordinates
        grid_rows = (height - q_row % dilation + dilation - 1) // dilation
        grid_cols = (width - q_col % dilation + dilation - 1) // dilation
        centre_row = torch.minimum(torch.clamp(q_row // dilation, min=half), grid_rows - 1 - half)
        centre_col = torch.minimum(torch.clamp(q_col // dilation, min=half), grid_cols - 1 - half)
        near_row = torch.abs(kv_row // dilation - centre_row) <= half
        near_col = torch.abs(kv_col // dilation - centre_col) <= half
        return same_grid & near_row & near_col

    natten_2d_dilated.__name__ = f"natten_2d_{height}x{width}_k{kernel}_d{dilation}"
    return natten_2d_dilated


def make(B, H, Q_LEN, KV_LEN, device="cpu", width=16, kernel=5, dilation=2):
    height = -(-KV_LEN // width)
    return Mods(mask_mod=generate_natten_2d_dilated(width, height, kernel, dilation))


VARIANT = Variant(
    name="natten_2d_dilated",
    description="NATTEN with dilation: the kernel x kernel window spans every dilation-th row and column.",
    paper="https://arxiv.org/abs/2209.15001",
    kind="mask",
    make=make,
    params=(Param("width", 16, 4, 256, 1, "image width in tokens (height = ceil(KV_LEN / width))"),
            Param("kernel", 5, 1, 31, 2, "window side in sub-grid pixels, odd"),
            Param("dilation", 2, 1, 8, 1, "spacing between the pixels of a window")),
    lengths_rule="Q_LEN == KV_LEN (self-attention over one image, flattened row-major)",
    accepts=lambda q_len, kv_len: q_len == kv_len,
)
