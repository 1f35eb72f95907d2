"""The backward's transposed-score coordinates, read from the layout algebra at trace time (no GPU).

The consumers compute S^T = K Q^T, so accumulator rows are keys and columns are queries; the mask, score_mod and
LSE/D lookups index by `coords[i] = (q, kv)`. This pins that view against the wgmma accumulator geometry: lane `l` of
warp `w` in warpgroup `g` holds key rows 64g + 16w + l//4 (+8) and query columns 2(l%4) (+1, +8j).

Also the dQ partial's fragment order: where the main kernel puts each element in dQaccum and where the postprocess
finds it must agree, for every dQ split the launcher runs. The tensors that reach the kernels through TVM-FFI are
checked against their compiled layouts too.
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
            found["shape"] = c.layout.shape

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cute.compile(probe, options="--gpu-arch sm_90a")
    return found


def test_transposed_accumulator_coordinates_are_query_then_key():
    tile_m, tile_n = 64, 128
    threads = (0, 5, 37, 127, 130, 255)
    for t, coords in _coords(tile_m, tile_n, threads).items():
        if t == "shape":
            continue
        g, w, lane = t // 128, (t % 128) // 32, t % 32
        keys = {64 * g + 16 * w + lane // 4 + 8 * r for r in (0, 1)}
        queries = {2 * (lane % 4) + c + 8 * j for c in (0, 1) for j in range(tile_m // 8)}
        assert len(coords) == 2 * 2 * tile_m // 8
        assert {q for q, _ in coords} == queries, t
        assert {kv for _, kv in coords} == keys, t
        assert len(set(coords)) == len(coords)


@pytest.mark.parametrize("tile_m", [64, 128])
def test_row_major_order_walks_one_key_at_a_time(tile_m):
    """Captured-tensor gradients are added in `row_major_order`: every query of one key row, ascending, then the
    next key, so that a per-key or clipped-offset table entry forms one run (`bwd_aux_grad.GradRun`)."""
    from flexlab.kernels.layout import row_major_order
    found = _coords(tile_m, 128, (0, 37, 201))
    order = row_major_order(found.pop("shape"))
    for t, coords in found.items():
        assert sorted(order) == list(range(len(coords))), t
        walked = [coords[i] for i in order]
        assert walked == sorted(walked, key=lambda qk: (qk[1], qk[0])), t


def _stride_pattern(tensor_repr: str) -> list[str]:
    """'?' for each dynamic stride and the number for each static one, from a cute tensor's printed layout."""
    strides = tensor_repr.rsplit(":", 1)[1] if ":" in tensor_repr else tensor_repr.rsplit("), (", 1)[1]
    return ["?" if "?" in tok else tok.strip(" ()>") for tok in strides.split(",") if tok.strip(" ()>")]


def _fits(fake, tensor) -> bool:
    """The fake's static strides are the tensor's (size-1 modes aside, as TVM-FFI checks) and the last one is 1."""
    pattern = _stride_pattern(str(fake))
    return (len(pattern) == tensor.dim() and pattern[-1] == "1"
            and all(p == "?" or n == 1 or int(p) == s for p, s, n in zip(pattern, tensor.stride(), tensor.shape)))


def test_captured_tensors_reach_the_kernel_in_the_layout_it_was_compiled_for():
    """The main kernel's compiled signature and the launch's runtime tensors must agree stride for stride (TVM-FFI
    rejects a call whose tensor has another static stride; `test_bwd_ffi` checks every argument of a real launch)."""
    import torch

    from flexlab.kernels.bwd_config import default_bwd_config
    from flexlab.kernels.bwd_sm90 import fake_arguments

    table = torch.randn(4, 65)
    ids = torch.arange(12, dtype=torch.int32).view(3, 4)
    args = fake_arguments(default_bwd_config(64), cutlass.BFloat16, True, (("float32", 2), ("int32", 2)), (),
                          (2,))
    fake_aux, fake_grads = args[12], args[14]
    for fake, real in zip(fake_aux, (table, ids)):
        assert _fits(fake, real), str(fake)
    assert not _fits(fake_aux[0], table.t().contiguous().t())  # column-major would be refused
    assert _fits(fake_grads[0], torch.zeros(4, 65))
    for fake, real in zip(args[11], (torch.zeros(1, 2, 3, dtype=torch.int32), torch.zeros(1, 2, 3, 4, dtype=torch.int32),
                                     torch.zeros(1, 2, 3, dtype=torch.int32), torch.zeros(1, 2, 3, 4, dtype=torch.int32))):
        assert _fits(fake, real), str(fake)


def _dq_places(head_dim: int, tile_m: int, split_rows: bool) -> dict:
    """{(slab, offset in slab): (row, column) of the query tile} for every consumer thread's dQ fragment element, as
    the main kernel writes it (`bwd_dq.fragment_order`, read through a counting tensor) and the postprocess maps it
    back (the dQ tiled MMA's partition of the tile's coordinates)."""
    import cutlass.cute as cute

    from flexlab.kernels.bwd_dq import fragment_order, make_dq_tiled_mma
    num_wg = 2
    slab_elems = tile_m * head_dim // num_wg
    places = {}

    @cute.jit
    def probe():
        tiled = make_dq_tiled_mma(cutlass.BFloat16, head_dim, num_wg, split_rows)
        counting = cute.make_identity_tensor(slab_elems)  # value at offset k is k
        for t in cutlass.range_constexpr(128 * num_wg):  # unrolled at trace time: every index is a constant
            thr = tiled.get_slice(t)
            shape = thr.partition_shape_C((tile_m, head_dim))
            where = fragment_order(counting, t % 128, shape)
            coords = thr.partition_C(cute.make_identity_tensor((tile_m, head_dim)))
            for i in cutlass.range_constexpr(cute.size(shape)):
                places[(t // 128, where[i])] = tuple(coords[i])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cute.compile(probe, options="--gpu-arch sm_90a")
    return places


@pytest.mark.parametrize("head_dim,tile_m,split_rows", [(128, 64, False), (64, 128, True), (64, 128, False),
                                                        (64, 64, False)])
def test_dq_fragment_order_places_every_element_once(head_dim, tile_m, split_rows):
    """Each element of a query tile's dQ partial has exactly one place in its warpgroup's slab, the slabs are filled
    without gaps (the TMA reduce copies all of each), and each warpgroup's slab holds its own rows or columns."""
    places = _dq_places(head_dim, tile_m, split_rows)
    slab_elems = tile_m * head_dim // 2
    assert len(places) == tile_m * head_dim  # no two elements share a place
    assert sorted(set(places.values())) == [(r, c) for r in range(tile_m) for c in range(head_dim)]
    for w in (0, 1):
        assert sorted(off for slab, off in places if slab == w) == list(range(slab_elems))
        mine = [rc for (slab, _), rc in places.items() if slab == w]
        if split_rows:
            assert {r // 64 for r, _ in mine} == {w}
        else:
            assert {c // (head_dim // 2) for _, c in mine} == {w}
