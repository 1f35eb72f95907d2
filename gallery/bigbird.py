"""BigBird: block-sparse attention mixing a window of blocks, global blocks and random blocks."""
import torch

from flexlab.gallery import Mods, Param, Variant


def generate_bigbird(random_blocks: torch.Tensor, block_size: int, num_global_blocks: int):
    """`random_blocks[i, j]` says whether query block i attends to key block j at random."""

    def bigbird(b, h, q_idx, kv_idx):
        q_block = q_idx // block_size
        kv_block = kv_idx // block_size
        window = torch.abs(q_block - kv_block) <= 1
        global_blocks = (q_block < num_global_blocks) | (kv_block < num_global_blocks)
        return window | global_blocks | random_blocks[q_block, kv_block]

    bigbird.__name__ = f"bigbird_block{block_size}"
    return bigbird


def random_block_table(num_q_blocks: int, num_kv_blocks: int, per_row: int, seed: int = 0, device="cpu"):
    """Each query block picks `per_row` distinct key blocks at random (reproducibly)."""
    generator = torch.Generator().manual_seed(seed)
    table = torch.zeros(num_q_blocks, num_kv_blocks, dtype=torch.bool)
    for row in range(num_q_blocks):
        picks = torch.randperm(num_kv_blocks, generator=generator)[:per_row]
        table[row, picks] = True
    return table.to(device)


def make(B, H, Q_LEN, KV_LEN, device="cpu", block_size=32, num_random=2, num_global_blocks=1):
    table = random_block_table(-(-Q_LEN // block_size), -(-KV_LEN // block_size), num_random, device=device)
    return Mods(mask_mod=generate_bigbird(table, block_size, num_global_blocks), tensors={"random_blocks": table})


VARIANT = Variant(
    name="bigbird",
    description="Blocks attend to neighbouring blocks, global blocks and a few random blocks (captured table).",
    paper="https://arxiv.org/abs/2007.14062",
    kind="mask",
    make=make,
    params=(Param("block_size", 32, 8, 256, 8, "tokens per block"),
            Param("num_random", 2, 0, 16, 1, "random key blocks per query block"),
            Param("num_global_blocks", 1, 0, 8, 1, "leading blocks with global attention")),
    lengths_rule="any Q_LEN and KV_LEN",
)
