"""The backward's transposed-score coordinates, read from the layout algebra at trace time (no GPU).

The consumers compute S^T = K Q^T, so accumulator rows are keys and columns are queries; the mask, score_mod and
LSE/D lookups index by `coords[i] = (q, kv)`. This pins that view against the wgmma accumulator geometry: lane `l` of
warp `w` in warpgroup `g` holds key rows 64g + 16w + l//4 (+8) and query columns 2(l%4) (+1, +8j).
"""
from __future__ import annotations

import warnings

import pytest

cutlass = pytest.importorskip("cutlass")


def _coords(tile_m: int, tile_n: int, threads) -> dict:
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass import Float32
    from cutlass.cute.nvgpu import OperandMajorMode

    from flexlab.kernels.layout import transpose_smem
    found = {}

    @cute.jit
    def probe():
        tiled = sm90_utils.make_trivial_tiled_mma(cutlass.BFloat16, cutlass.BFloat16, OperandMajorMode.K,
                                                  OperandMajorMode.K, Float32, atom_layout_mnk=(tile_n // 64, 1, 1),
                                                  tiler_mn=(64, tile_m))
        for t in threads:
            c = tiled.get_slice(t).partition_C(transpose_smem(cute.make_identity_tensor((tile_m, tile_n))))
            found[t] = [tuple(c[i]) for i in range(cute.size(c))]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cute.compile(probe, options="--gpu-arch sm_90a")
    return found


def test_transposed_accumulator_coordinates_are_query_then_key():
    tile_m, tile_n = 64, 128
    threads = (0, 5, 37, 127, 130, 255)
    for t, coords in _coords(tile_m, tile_n, threads).items():
        g, w, lane = t // 128, (t % 128) // 32, t % 32
        keys = {64 * g + 16 * w + lane // 4 + 8 * r for r in (0, 1)}
        queries = {2 * (lane % 4) + c + 8 * j for c in (0, 1) for j in range(tile_m // 8)}
        assert len(coords) == 2 * 2 * tile_m // 8
        assert {q for q, _ in coords} == queries, t
        assert {kv for _, kv in coords} == keys, t
        assert len(set(coords)) == len(coords)
