"""Block masks: torch-compatible `BlockMask` construction without an S×S mask, tile states and statistics."""
from torch.nn.attention.flex_attention import BlockMask, and_masks, noop_mask, or_masks

from .block_mask import as_block_mask_tensors, block_states, BLOCK_EMPTY, BLOCK_FULL, BLOCK_PARTIAL
from .build import create_block_mask, create_mask

__all__ = ["BlockMask", "create_block_mask", "create_mask", "and_masks", "or_masks", "noop_mask", "block_states",
           "as_block_mask_tensors", "BLOCK_EMPTY", "BLOCK_PARTIAL", "BLOCK_FULL"]
