"""Build torch `BlockMask`s tile by tile, never materializing the dense Q_LEN × KV_LEN mask.

torch's `create_block_mask` evaluates the mask_mod on the whole (B, H, Q_LEN, KV_LEN) grid, which is 16 GiB of bools
at 128k tokens. Here the grid is walked in chunks of whole blocks: each chunk is evaluated, reduced to per-block
counts, and dropped. Peak memory is O(B·H·n_q_blocks·n_kv_blocks + one chunk), and the result is the same BlockMask
torch would build (same counts, same index order), so it can be passed to any consumer of torch's BlockMask.
"""
from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

from ..errors import BackendUnavailableError, FlexlabTypeError, FlexlabValueError, check_positive_int
from ..mods import (MaskMod, check_mask_mod, check_score_mod, evaluate_mask_mod, evaluate_score_mod, index_grid,
                    positional_arity)

# Elements of the index grid evaluated at once. A mask_mod's temporaries are int64 over the chunk, so this keeps a
# chunk's working set to a few tens of MiB whatever the sequence length.
DEFAULT_CHUNK_ELEMENTS = 1 << 22


def _check_lengths(B, H, Q_LEN, KV_LEN, block_sizes):
    for name, val in (("B", B), ("H", H), ("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN)):
        check_positive_int(name, val, "create_block_mask")
    for name, val in zip(("Q block size", "KV block size"), block_sizes):
        check_positive_int(f"BLOCK_SIZE ({name})", val, "create_block_mask")


def _block_sizes(BLOCK_SIZE) -> tuple:
    """(q_block, kv_block) from an int or a pair (their values checked by `_check_lengths`); anything else refused
    by name."""
    if isinstance(BLOCK_SIZE, int):
        return BLOCK_SIZE, BLOCK_SIZE
    if isinstance(BLOCK_SIZE, (tuple, list)) and len(BLOCK_SIZE) == 2:
        return tuple(BLOCK_SIZE)
    raise FlexlabValueError(f"create_block_mask: BLOCK_SIZE must be a positive int or a (q_block, kv_block) pair, "
                            f"got {BLOCK_SIZE!r}")


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, nQ, nKV) 0/1 → (count per row, column indices with the set ones first, in ascending order)."""
    blocks = blocks.to(torch.int32)
    counts = blocks.sum(dim=-1, dtype=torch.int32)
    indices = torch.argsort(blocks, dim=-1, descending=True, stable=True).to(torch.int32)
    return counts.contiguous(), indices.contiguous()


def block_counts(mask_mod: MaskMod, B: int, H: int, Q_LEN: int, KV_LEN: int, q_block: int, kv_block: int,
                 device="cpu", chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> torch.Tensor:
    """Number of kept (q, kv) pairs in every block: int32 (B, H, ceil(Q_LEN/q_block), ceil(KV_LEN/kv_block))."""
    n_q, n_kv = -(-Q_LEN // q_block), -(-KV_LEN // kv_block)
    counts = torch.zeros(B, H, n_q, n_kv, dtype=torch.int32, device=device)
    b_idx, h_idx, q_all, kv_all = index_grid(B, H, Q_LEN, KV_LEN, device)
    # Chunk in whole blocks: as many kv blocks as fit (for one q block over all b, h), then as many q blocks.
    per_q_block = B * H * q_block
    kv_blocks_per_chunk = max(1, min(n_kv, chunk_elements // max(1, per_q_block * kv_block)))
    q_blocks_per_chunk = max(1, min(n_q, chunk_elements // max(1, per_q_block * kv_blocks_per_chunk * kv_block)))
    # When B*H alone is too large for one block, walk heads in groups too.
    h_step = H if B * H * q_block * kv_block <= chunk_elements else max(1, chunk_elements // (B * q_block * kv_block))
    for h0 in range(0, H, h_step):
        h_sl = slice(h0, min(H, h0 + h_step))
        for qb0 in range(0, n_q, q_blocks_per_chunk):
            qb1 = min(n_q, qb0 + q_blocks_per_chunk)
            q = q_all[qb0 * q_block: min(Q_LEN, qb1 * q_block)]
            for kb0 in range(0, n_kv, kv_blocks_per_chunk):
                kb1 = min(n_kv, kb0 + kv_blocks_per_chunk)
                kv = kv_all[kb0 * kv_block: min(KV_LEN, kb1 * kv_block)]
                tile = evaluate_mask_mod(mask_mod, b_idx, h_idx[h_sl], q, kv)
                # Pad the ragged tail with False (as torch does) so the tile reshapes into whole blocks.
                pad_q, pad_kv = (qb1 - qb0) * q_block - len(q), (kb1 - kb0) * kv_block - len(kv)
                if pad_q or pad_kv:
                    tile = torch.nn.functional.pad(tile, (0, pad_kv, 0, pad_q))
                nb, nh = tile.shape[:2]
                tile = tile.view(nb, nh, qb1 - qb0, q_block, kb1 - kb0, kv_block)
                counts[:, h_sl, qb0:qb1, kb0:kb1] = tile.sum(dim=(3, 5), dtype=torch.int32)
                del tile
    return counts


def create_block_mask(mask_mod: MaskMod, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int,
                      device="cpu", BLOCK_SIZE: int | tuple[int, int] = 128, _compile: bool = False,
                      separate_full_blocks: bool = True, compute_dq_write_order: bool = False,
                      dq_kv_order: bool = True, *, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> BlockMask:
    """Drop-in for torch's `create_block_mask`, built chunk by chunk (memory independent of Q_LEN × KV_LEN).

    Args:
        mask_mod: `mask_mod(b, h, q_idx, kv_idx) -> bool`; True keeps the pair.
        B, H: batch size and query heads the mask varies over; None (or 1) broadcasts over that dimension.
        Q_LEN, KV_LEN: sequence lengths.
        device: where the block tensors live (and where the mask_mod is evaluated); None: torch's default, the
            current accelerator if there is one, else the CPU.
        BLOCK_SIZE: block size, or (q_block, kv_block).
        _compile: accepted for torch's signature (torch deprecates it); the chunked build needs no compile.
        separate_full_blocks: False lists every non-empty block as partial (no full lists), so kernels run
            mask_mod on all of them.
        compute_dq_write_order, dq_kv_order: torch's dQ write-order metadata for its FLASH backend's
            deterministic backward, computed by torch where it has them; flexlab's kernels do not need them.
    Returns:
        torch.nn.attention.flex_attention.BlockMask, equal to torch's (kv/full_kv counts and indices, q-side
        transposes, BLOCK_SIZE, mask_mod, seq_lengths).
    """
    if mask_mod is None:
        raise FlexlabTypeError("create_block_mask: mask_mod must be a callable (b, h, q_idx, kv_idx) -> bool Tensor, "
                               "got None (flexlab.noop_mask keeps every pair)")
    check_mask_mod(mask_mod)
    for name, flag in (("_compile", _compile), ("separate_full_blocks", separate_full_blocks),
                       ("compute_dq_write_order", compute_dq_write_order), ("dq_kv_order", dq_kv_order)):
        if not isinstance(flag, bool):
            raise FlexlabTypeError(f"create_block_mask: {name} must be True or False, got {flag!r}")
    B = 1 if B is None else B
    H = 1 if H is None else H
    q_block, kv_block = _block_sizes(BLOCK_SIZE)
    _check_lengths(B, H, Q_LEN, KV_LEN, (q_block, kv_block))
    device = _default_device() if device is None else device
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise BackendUnavailableError(f"create_block_mask: device={device!r} but this torch has no CUDA device; "
                                      "build the mask with device='cpu'")
    write_order = _dq_write_order_builder() if compute_dq_write_order else None
    counts = block_counts(mask_mod, B, H, Q_LEN, KV_LEN, q_block, kv_block, device, chunk_elements)
    if separate_full_blocks:
        full = counts == q_block * kv_block
        partial = (counts > 0) & ~full
        full_num, full_idx = _ordered(full)
    else:
        partial, full_num, full_idx = counts > 0, None, None
    kv_num, kv_idx = _ordered(partial)
    block_mask = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(q_block, kv_block),
                                          mask_mod=mask_mod, seq_lengths=(Q_LEN, KV_LEN))
    if write_order is not None:  # (as torch's create_block_mask records them)
        block_mask.dq_write_order, block_mask.dq_write_order_full = write_order(block_mask, dq_kv_order=dq_kv_order)
        block_mask.dq_kv_order, block_mask.dq_kv_order_spt = None, dq_kv_order
    return block_mask


def _default_device():
    """torch's default for create_block_mask's device: the current accelerator where one is available, else the
    CPU (a CUDA build of torch on a machine without a GPU names CUDA as its accelerator all the same)."""
    return torch.accelerator.current_accelerator() if torch.accelerator.is_available() else torch.device("cpu")


def _dq_write_order_builder():
    """torch's builder of the dQ write-order metadata, or a clear error where this torch has none."""
    from torch.nn.attention import flex_attention as torch_flex
    builder = getattr(torch_flex, "_compute_dq_write_order_from_block_mask", None)
    if builder is None:
        raise BackendUnavailableError(
            f"create_block_mask: compute_dq_write_order=True needs torch's dQ write-order metadata, which torch "
            f"{torch.__version__} does not have; flexlab's own deterministic backward needs no such metadata")
    return builder


def create_mask(mod_fn, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int, device="cpu") -> torch.Tensor:
    """The dense (B, H, Q_LEN, KV_LEN) bool mask of a mask_mod, or of a score_mod (as torch's: the pairs where it
    does not turn a zero score into -inf). For small sizes only (tests, pictures): it is S×S. device=None: torch's
    default, the current accelerator if there is one."""
    B = 1 if B is None else B
    H = 1 if H is None else H
    device = _default_device() if device is None else device
    if callable(mod_fn) and positional_arity(mod_fn) == 5:
        check_score_mod(mod_fn, "create_mask: mod_fn")
        grid = index_grid(B, H, Q_LEN, KV_LEN, device)
        return ~torch.isneginf(evaluate_score_mod(mod_fn, torch.zeros(B, H, Q_LEN, KV_LEN, device=device), *grid))
    check_mask_mod(mod_fn)
    return evaluate_mask_mod(mod_fn, *index_grid(B, H, Q_LEN, KV_LEN, device))
