"""How many backward steps the benchmark's document rows cost flexlab's block-mask kernel and FA4's varlen kernel
(not a test; runs on a CPU in a second).

    python benchmarks/probes/document_steps.py

Both backward kernels walk 64 query rows against 128 key rows per step at D=128. FA4's varlen path starts each
document's tiles at the document's first token, so a document of L tokens costs it the causal staircase of its own
ceil(L / 128) key tiles. flexlab's kernel reads a BlockMask, whose tiles sit at multiples of the tile size in the
packed sequence: a tile that straddles a document boundary is walked (masked) for both documents' rows it holds, and
the first and last tiles of each document are partial more often. The ratio of the two counts is the extra work the
block grid costs on each row; `useful` is the fraction of the walked scores the mask keeps. `key_aligned_steps`
counts a middle design: key tiles started at each document (what dK/dV stores of arbitrary row ranges would allow),
query steps left on the packed grid (where the dQ sums are).
"""
from __future__ import annotations

import argparse
import json

import torch

TILE_Q, TILE_KV = 64, 128


def varlen_steps(lengths: list[int]) -> int:
    """Steps of a causal varlen backward: per document, per key tile, the query tiles from the diagonal down."""
    return sum(-(-L // TILE_Q) - (n * TILE_KV) // TILE_Q for L in lengths for n in range(-(-L // TILE_KV)))


def key_aligned_steps(lengths: list[int]) -> int:
    """Steps with each document's key tiles starting at its first token and query steps on the packed grid: per key
    tile, the grid's query tiles from the one holding the tile's first key to the document's last."""
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return sum(-(-(a + L) // TILE_Q) - k // TILE_Q for a, L in zip(starts, lengths) for k in range(a, a + L, TILE_KV))


def block_grid_steps(document_id: torch.Tensor) -> tuple[int, int]:
    """(full, partial) (query tile, key tile) pairs of the causal document mask on the packed sequence's grid;
    empty pairs are never walked."""
    S = document_id.numel()
    q = torch.arange(S)
    keep = (document_id[:, None] == document_id[None, :]) & (q[:, None] >= q[None, :])
    tiles = keep.view(S // TILE_Q, TILE_Q, S // TILE_KV, TILE_KV).sum(dim=(1, 3))
    full = int((tiles == TILE_Q * TILE_KV).sum())
    return full, int((tiles > 0).sum()) - full


def main() -> None:
    from flexlab.bench.cases import NUM_DOCUMENTS, build_case
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the counts here")
    args = ap.parse_args()
    rows = []
    for B, S in ((4, 4096), (1, 16384)):
        case = build_case("document", B, 16, S, "cpu")
        cu = case.fa4["cu_seqlens"][:NUM_DOCUMENTS + 1].tolist()
        lengths = [b - a for a, b in zip(cu, cu[1:])]
        document_id = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        full, partial = block_grid_steps(document_id)
        varlen = varlen_steps(lengths)
        key_aligned = key_aligned_steps(lengths)
        kept = sum(L * (L + 1) // 2 for L in lengths)
        row = {"row": f"documents B{B}·S{S // 1024}k", "document_lengths": lengths, "flexlab_steps": full + partial,
               "flexlab_partial_steps": partial, "fa4_varlen_steps": varlen,
               "key_aligned_steps": key_aligned,
               "ratio": round((full + partial) / varlen, 3),
               "useful_flexlab": round(kept / ((full + partial) * TILE_Q * TILE_KV), 3),
               "useful_fa4": round(kept / (varlen * TILE_Q * TILE_KV), 3)}
        rows.append(row)
        print(f"{row['row']}: flexlab {row['flexlab_steps']} steps per head ({partial} partial), FA4 varlen "
              f"{varlen}: {row['ratio']}x; key tiles at document starts {key_aligned}; scores kept "
              f"{row['useful_flexlab']:.1%} / {row['useful_fa4']:.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
