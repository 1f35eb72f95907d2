"""Sliding tile attention (STA): NATTEN at tile granularity, so whole tiles are either kept or skipped."""
import torch

from flexlab.gallery import Mods, Param, Variant


def generate_sliding_tile(tile: int, tiles_per_row: int, tile_rows: int, window: int):
    """Tokens are stored tile by tile (each tile x tile tile contiguous, tiles row-major over the image)."""
    tokens_per_tile = tile * tile
    half = window // 2

    def sliding_tile(b, h, q_idx, kv_idx):
        q_tile = q_idx // tokens_per_tile
        kv_tile = kv_idx // tokens_per_tile
        q_row, q_col = q_tile // tiles_per_row, q_tile % tiles_per_row
        kv_row, kv_col = kv_tile // tiles_per_row, kv_tile % tiles_per_row
        centre_row = torch.clamp(q_row, half, tile_rows - 1 - half)
        centre_col = torch.clamp(q_col, half, tiles_per_row - 1 - half)
        return (torch.abs(kv_row - centre_row) <= half) & (torch.abs(kv_col - centre_col) <= half)

    sliding_tile.__name__ = f"sliding_tile_t{tile}_w{window}"
    return sliding_tile


def make(B, H, Q_LEN, KV_LEN, device="cpu", tile=4, tiles_per_row=8, window=3):
    tile_rows = -(-KV_LEN // (tile * tile * tiles_per_row))
    return Mods(mask_mod=generate_sliding_tile(tile, tiles_per_row, tile_rows, window))


VARIANT = Variant(
    name="sliding_tile",
    description="Each tile of tokens attends to a window x window neighbourhood of tiles (clamped at borders).",
    paper="https://arxiv.org/abs/2502.04507",
    kind="mask",
    make=make,
    params=(Param("tile", 4, 1, 16, 1, "tile side in pixels (tile*tile tokens per tile)"),
            Param("tiles_per_row", 8, 1, 64, 1, "image width in tiles"),
            Param("window", 3, 1, 15, 2, "neighbourhood side in tiles, odd")),
    lengths_rule="Q_LEN == KV_LEN (tile-major token order; a partial last tile row is fine)",
    accepts=lambda q_len, kv_len: q_len == kv_len,
    example_lengths=(1024, 1024),
)
