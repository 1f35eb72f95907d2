"""The backward kernels compile for sm_90a without a GPU, and ptxas agrees they are sound.

Each kernel is compiled against symbolic shapes (as the launcher compiles it), assembled with the system ptxas, and
checked for: no register spills, the instructions the design depends on (wgmma, TMA loads/stores, the TMA
reduce-add of dQ, transposing stmatrix), and no local memory. The Q-direction block lists the launcher derives from
a BlockMask are checked against the mask's own block states.
"""
from __future__ import annotations

import re
import shutil

import pytest
from ptx_dump import KEEP_PTX
import torch

cutlass = pytest.importorskip("cutlass")
pytestmark = pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs ptxas (CUDA toolkit) on PATH")


def _assemble(compiled) -> tuple[str, dict]:
    """(ptx, {'registers', 'spill_stores', 'spill_loads'}) from ptxas -v."""
    from flexlab.runtime.ptxas import assemble
    ptx = compiled.__ptx__
    info, _ = assemble(ptx)
    return ptx, {"registers": info["registers"], "spill_stores": info["spill_store_bytes"],
                 "spill_loads": info["spill_load_bytes"]}


def _no_spills(report):
    assert report["spill_stores"] == 0 and report["spill_loads"] == 0, report


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("has_dlse", [False, True])
def test_preprocess_compiles(D, has_dlse):
    from flexlab.kernels.bwd_launch import compile_preprocess
    ptx, report = _assemble(compile_preprocess("bfloat16", D, has_dlse, options=KEEP_PTX))
    _no_spills(report)
    assert "ld.global.v4" in ptx, "O and dO rows should be read with 16-byte loads"
    assert "shfl.sync.bfly" in ptx
    # the dQ sums are zeroed here with 16-byte stores of zero (no separate fill kernel)
    zero4 = ", ".join(["0f00000000"] * 4)
    assert re.search(r"st\.global\.v4\.b32\s+\[[^\]]+\],\s*\{" + zero4 + r"\}", ptx), "dQ sums not zeroed 16 B at a time"
    # chained (`BwdConfig.chained_launch`): one wait for the kernel before, before any load or store, then the main
    # kernel may launch
    wait, first_access = ptx.find("griddepcontrol.wait"), re.search(r"\b(ld|st)\.global", ptx).start()
    assert 0 <= wait < first_access and ptx.count("griddepcontrol.wait") == 1
    assert ptx.count("griddepcontrol.launch_dependents") == 1


def test_unchained_pre_and_postprocess_do_not_wait():
    from flexlab.kernels.bwd_launch import compile_postprocess, compile_preprocess
    for compiled in (compile_preprocess("bfloat16", 64, False, options=KEEP_PTX, chained=False),
                     compile_postprocess("bfloat16", 64, options=KEEP_PTX, chained=False)):
        assert "griddepcontrol" not in compiled.__ptx__


@pytest.mark.parametrize("D", [64, 128, 256])
def test_postprocess_compiles(D):
    from flexlab.kernels.bwd_launch import compile_postprocess
    ptx, report = _assemble(compile_postprocess("float16", D, options=KEEP_PTX))
    _no_spills(report)
    assert "st.global.v4" in ptx and "cvt.rn.f16x2.f32" in ptx
    # chained: it waits for the main kernel (every dQ partial) before its first read
    wait, first_read = ptx.find("griddepcontrol.wait"), ptx.find("ld.global")
    assert 0 <= wait < first_read and "griddepcontrol.launch_dependents" not in ptx


def _main_key(D, block_sparse=False, g=None, deterministic=False):
    from flexlab.kernels.bwd_config import default_bwd_config
    from flexlab.kernels.bwd_launch import BwdKey, config_for, main_key
    if g is None:
        # as the launcher picks it: without a mask, D=128 steps 80 rows with dQ transposed
        cfg = default_bwd_config(D, deterministic, q_block=128 if block_sparse else None)
        return BwdKey("", False, False, False, (), (), (), "bfloat16", cfg, block_sparse, deterministic)
    aux = g.kernel_aux_tensors()
    # as the launcher picks it for a mask at torch's default block size
    cfg = config_for(D, deterministic, g, any(g.aux_requires_grad), 128 if block_sparse else None)
    slots = [i for i, rg in enumerate(g.aux_requires_grad) if rg]
    return main_key(g, aux, slots, "bfloat16", cfg, block_sparse, deterministic)


def _check_main(ptx, report, D, tile_m=64, dq_red=False):
    _no_spills(report)
    assert "ld.local" not in ptx and "st.local" not in ptx
    # D=256 splits the head dim of dK/dV and the query columns of S^T/dP^T over the two consumer warpgroups
    n = D if D == 64 else 128
    n_scores = tile_m // 2 if D == 256 else tile_m
    assert f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16" in ptx  # dK/dV GEMMs, N = head dim
    assert f"wgmma.mma_async.sync.aligned.m64n{n_scores}k16.f32.bf16.bf16" in ptx  # S^T and dP^T, N = tile_m
    if dq_red:  # dQ partials added by the consumer threads, 16 bytes per reduction, no TMA reduce
        assert "red.global.add.v4.f32" in ptx and "cp.reduce.async.bulk.tensor" not in ptx
    else:
        assert "cp.reduce.async.bulk.tensor" in ptx and ".add." in ptx  # dQ partials reduced by TMA
    assert "cp.async.bulk.tensor.4d.shared::cta.global" in ptx  # TMA loads
    assert "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx  # dS^T written transposed
    assert "setmaxnreg.inc" in ptx and "setmaxnreg.dec" in ptx


@pytest.mark.parametrize("D,block_sparse", [(64, False), (128, False), (128, True), (256, False), (256, True)])
def test_main_kernel_compiles_without_spills(D, block_sparse):
    from flexlab.kernels.bwd_launch import compile_main
    key = _main_key(D, block_sparse)
    ptx, report = _assemble(compile_main(key, None, options=KEEP_PTX))
    _check_main(ptx, report, D, key.config.tile_m, key.config.dq_red)


@pytest.mark.parametrize("D,block_sparse,option", [(128, False, None), (64, True, None), (256, True, None),
                                                   (256, False, "dq_red_stages2")])
def test_deterministic_kernel_orders_dq_reductions(D, block_sparse, option):
    """Deterministic mode: each dQ reduce waits (acquire) for its turn and signals the next KV tile (release).
    With `dq_red` (a candidate at D=256) every warp does both around its own vector reductions, after a warp
    barrier."""
    from dataclasses import replace

    from flexlab.kernels.bwd_config import candidate_bwd_configs
    from flexlab.kernels.bwd_launch import compile_main
    key = _main_key(D, block_sparse, deterministic=True)
    if option is not None:
        key = replace(key, config=candidate_bwd_configs(D, True, q_block=128 if block_sparse else None)[option])
        assert key.config.dq_red
    ptx, report = _assemble(compile_main(key, None, options=KEEP_PTX))
    _check_main(ptx, report, D, key.config.tile_m, key.config.dq_red)
    assert "ld.acquire.gpu.global.b32" in ptx
    assert "red.release.gpu.global.add.s32" in ptx
    if key.config.dq_red:
        acquire, release = ptx.index("ld.acquire.gpu.global.b32"), ptx.index("red.release.gpu.global.add.s32")
        adds = [m.start() for m in re.finditer(r"red\.global\.add\.v4\.f32", ptx)]
        assert acquire < adds[0] and adds[-1] < release, "the adds must sit between the turn's acquire and release"
        assert re.search(r"bar\.warp\.sync[^;]*;(?:(?!red\.global\.add\.v4).)*red\.release", ptx, re.S), \
            "a warp barrier must order every lane's adds before lane 0's release"
    else:
        assert re.search(r"cp\.async\.bulk\.wait_group\s+0", ptx), "the reduce must have landed before the release"


def test_visit_ranks_count_lower_kv_tiles():
    from flexlab.kernels.bwd_launch import visit_ranks
    # One (b, h), three KV tiles, four Q tiles. KV tile 0 visits Q {0, 1}; tile 1 visits {3} partially and {1}
    # fully; tile 2 visits {3, 0} partially and {1} fully. Nobody visits Q tile 2.
    num = torch.tensor([[[2, 1, 2]]], dtype=torch.int32)
    idx = torch.tensor([[[[0, 1], [3, 0], [3, 0]]]], dtype=torch.int32)
    fnum = torch.tensor([[[0, 1, 1]]], dtype=torch.int32)
    fidx = torch.tensor([[[[0, 0], [1, 0], [1, 0]]]], dtype=torch.int32)
    rank = visit_ranks((num, idx, fnum, fidx), 4)
    assert rank[0, 0, 0, 0] == 0 and rank[0, 0, 2, 0] == 1  # tile 1 skips Q tile 0: tile 2 is second there
    assert rank[0, 0, :, 1].tolist() == [0, 1, 2]
    assert rank[0, 0, 1, 3] == 0 and rank[0, 0, 2, 3] == 1
    # the turn order under a block mask in deterministic mode: higher KV tiles first
    high = visit_ranks((num, idx, fnum, fidx), 4, higher_first=True)
    assert high[0, 0, 2, 0] == 0 and high[0, 0, 0, 0] == 1
    assert high[0, 0, :, 1].tolist() == [2, 1, 0]
    assert high[0, 0, 2, 3] == 0 and high[0, 0, 1, 3] == 1


def test_deterministic_captured_grads_compile_to_integer_atomics():
    """A per-head learnable bias whose gradient goes through add_aux_grad: int64 buffers give integer atomics."""
    import types

    import cutlass.cute as cute
    from cutlass import Float32
    from flexlab.kernels.bwd_aux_grad import add_aux_grad
    from flexlab.kernels.bwd_config import default_bwd_config
    from flexlab.kernels.bwd_launch import BwdKey, compile_main

    @cute.jit
    def score_mod(score, b, h, q_idx, kv_idx, aux_tensors, aux_scalars):
        return score + aux_tensors[0][h].to(Float32)

    @cute.jit
    def score_mod_bwd(grad, score, b, h, q_idx, kv_idx, aux_tensors, aux_scalars):
        return grad

    @cute.jit
    def score_mod_aux_grad(grad, score, b, h, q_idx, kv_idx, aux_tensors, aux_scalars, aux_grads):
        if grad != Float32(0.0):
            add_aux_grad(aux_grads[0], (h,), grad)

    module = types.SimpleNamespace(score_mod=score_mod, score_mod_bwd=score_mod_bwd,
                                   score_mod_aux_grad=score_mod_aux_grad, mask_mod=None, add_aux_grad=add_aux_grad)
    for fixed_point in (False, True):
        cfg = default_bwd_config(64, fixed_point, mod_grads=True)
        key = BwdKey("head-bias", True, False, True, (("float32", 1),), (), (1,), "bfloat16", cfg, False, fixed_point,
                     "sm_90a", fixed_point)
        ptx, report = _assemble(compile_main(key, module, options=KEEP_PTX))
        _no_spills(report)
        assert ("atom.global.add.u64" in ptx) == fixed_point
        assert ("atom.global.add.f32" in ptx) != fixed_point
        # the warp's runs are summed with shuffles before the last atomics (`bwd_aux_grad.flush_aux_grads`)
        assert "vote.sync.all" in ptx and "shfl.sync.bfly" in ptx


def test_one_test_says_whether_generated_code_adds_through_the_helper():
    """The per-thread runs and deterministic mode's refusal ask the same question of the same module: whether its
    captured-tensor gradients go through `add_aux_grad` (a look-alike of that name does not count)."""
    import types

    from flexlab.codegen import generate
    from flexlab.kernels.bwd_aux_grad import accumulates_through_add_aux_grad
    bias = torch.randn(4, requires_grad=True)
    learnable = generate(lambda s, b, h, q, kv: s + bias[h], None, fastmath=True)
    assert accumulates_through_add_aux_grad(learnable.module())
    assert not accumulates_through_add_aux_grad(generate(lambda s, b, h, q, kv: s * 2.0, None).module())
    assert not accumulates_through_add_aux_grad(types.SimpleNamespace(add_aux_grad=lambda *a: None))


def test_fixed_point_sums_are_order_independent_and_convert_back():
    from flexlab.kernels.bwd_aux_grad import FIXED_POINT_BITS, from_fixed_point
    values = torch.randn(1000, dtype=torch.float64) * 3
    fixed = (values.float().double() * 2 ** FIXED_POINT_BITS).to(torch.int64)  # what each atomic adds
    forward, backward = fixed.sum(), fixed.flip(0).sum()
    assert forward == backward  # integer addition: any order, same bits
    assert abs(from_fixed_point(forward.reshape(1)).item() - values.float().sum().item()) < 1e-3


def _learnable_bias_mods():
    from flexlab.codegen import generate
    bias = torch.randn(4, 129, requires_grad=True)

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, torch.clamp(kv_idx - q_idx, -64, 64) + 64]

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return generate(rel_bias, causal, fastmath=True)  # as the launcher compiles them


def test_main_kernel_with_learnable_bias_and_mask_d64():
    """score_mod + its derivative + captured-tensor gradient atomics + mask_mod, inlined, still without spills."""
    from flexlab.kernels.bwd_launch import compile_main
    g = _learnable_bias_mods()
    key = _main_key(64, True, g)
    ptx, report = _assemble(compile_main(key, g.module(), options=KEEP_PTX))
    _check_main(ptx, report, 64, key.config.tile_m)
    assert "atom.global.add.f32" in ptx  # the bias table's gradient


def test_head_dim_256_splits_dk_dv_over_warpgroups():
    """D=256: the two consumer warpgroups share 64 key rows; P^T and dS^T go to shared memory for the dV and dK
    GEMMs, which read them transposed (MN-major A: no register A operand), with a learnable bias and a mask too."""
    from flexlab.kernels.bwd_config import default_bwd_config
    from flexlab.kernels.bwd_launch import compile_main
    cfg = default_bwd_config(256)
    assert cfg.split_head_dim and cfg.tile_n == 64 and cfg.num_consumer_wgs == 2 and cfg.num_threads == 384
    g = _learnable_bias_mods()
    key = _main_key(256, True, g)
    ptx, report = _assemble(compile_main(key, g.module(), options=KEEP_PTX))
    _check_main(ptx, report, 256, key.config.tile_m, dq_red=True)
    assert "atom.global.add.f32" in ptx
    # two transposed stmatrix stores per step (P^T and dS^T), and no GEMM takes a register A operand
    assert not re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16\s+\{[^}]*\},\s*\{", ptx)


def test_main_kernel_with_learnable_bias_d128_nearly_fits():
    """With LSE2 and D read from shared memory (stats_in_smem) the score_mod kernel at D=128 fits its registers;
    reading them from global memory it spilled about 130 bytes. The dQ warp (`BwdConfig.dq_warp`, 1.01-1.29x on the
    swept rows) left 8 bytes of spill stores and loads here, 4 since the gradient adds walk the scores row by row
    into per-thread runs (`bwd_aux_grad.GradRun`): the ceiling; the gallery's learnable relative bias has none
    (benchmarks/results/gallery_backward_spills_2026-11-30b.json.gz)."""
    from flexlab.kernels.bwd_launch import compile_main
    g = _learnable_bias_mods()
    _, report = _assemble(compile_main(_main_key(128, True, g), g.module(), options=KEEP_PTX))
    assert report["spill_stores"] <= 4 and report["spill_loads"] <= 4, report


@pytest.mark.parametrize("tile_m", [64, 128])
def test_q_direction_lists_match_block_states(tile_m):
    """The launcher's per-KV-tile lists of Q tiles (partial, then full) are exactly the mask's block states, also
    when a 128-row mask block splits into two Q steps."""
    import dataclasses

    import flexlab
    from flexlab.kernels.bwd_config import default_bwd_config
    from flexlab.kernels.bwd_launch import q_direction_tensors
    from flexlab.mask import BLOCK_FULL, BLOCK_PARTIAL, block_states
    cfg = dataclasses.replace(default_bwd_config(64), tile_m=tile_m)
    Sq, Skv = 1000, 700
    bm = flexlab.create_block_mask(lambda b, h, q, kv: (q >= kv) & (q - kv < 300), 1, 2, Sq, Skv, BLOCK_SIZE=128)
    tensors = [bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices, bm.q_num_blocks,
               bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices]
    num, idx, fnum, fidx = q_direction_tensors(tensors, [128, 128], cfg, Skv)
    states = block_states(bm)
    n_m = -(-Sq // cfg.tile_m)
    ratio = 128 // cfg.tile_m
    for h in range(2):
        for n in range(-(-Skv // cfg.tile_n)):
            partial = sorted(idx[0, h, n, :num[0, h, n]].tolist())
            full = sorted(fidx[0, h, n, :fnum[0, h, n]].tolist())
            assert partial == [m for m in range(n_m) if states[0, h, m // ratio, n] == BLOCK_PARTIAL]
            assert full == [m for m in range(n_m) if states[0, h, m // ratio, n] == BLOCK_FULL]


def test_q_direction_lists_are_cached_per_mask():
    import flexlab
    from flexlab.kernels.bwd_config import default_bwd_config
    from flexlab.kernels.bwd_launch import _cached_q_direction
    bm = flexlab.create_block_mask(lambda b, h, q, kv: q >= kv, 1, 1, 512, 512, BLOCK_SIZE=128)
    tensors = [None] * 4 + [bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices]
    cfg = default_bwd_config(64)
    first = _cached_q_direction(tensors, [128, 128], cfg, 512)
    assert _cached_q_direction(tensors, [128, 128], cfg, 512) is first
    bm.q_indices.add_(0)
    assert _cached_q_direction(tensors, [128, 128], cfg, 512) is not first


def test_mask_block_size_must_fit_the_backward_tiles():
    from flexlab.errors import BackendUnavailableError
    from flexlab.kernels.bwd_config import default_bwd_config
    from flexlab.kernels.bwd_launch import q_direction_tensors
    with pytest.raises(BackendUnavailableError, match="BLOCK_SIZE"):
        q_direction_tensors([None] * 8, [32, 32], default_bwd_config(64), 256)


def test_head_dim_64_steps_128_query_rows_only_where_it_pays():
    """The launcher's tile choice: 128 query rows per step at D=64 without per-score gradient work and with a mask
    whose Q block divides by 128; 64 otherwise (so a BLOCK_SIZE=64 mask still runs)."""
    from flexlab.kernels.bwd_config import default_bwd_config
    assert default_bwd_config(64).tile_m == 128
    assert default_bwd_config(64, deterministic=True, q_block=256).tile_m == 128
    assert default_bwd_config(64, mod_grads=True).tile_m == 64
    assert default_bwd_config(64, q_block=64).tile_m == 64
    assert default_bwd_config(64, q_block=64).block_mask_error(64, 128) is None
    assert default_bwd_config(128, q_block=128).tile_m == 64 and not default_bwd_config(128, q_block=128).dq_swap_ab
    # without a block mask D=128 steps 80 rows, dQ computed transposed; not where every score carries gradient work
    assert default_bwd_config(128).tile_m == 80 and default_bwd_config(128).dq_swap_ab
    assert default_bwd_config(128, deterministic=True).tile_m == 80
    assert default_bwd_config(128, mod_grads=True).tile_m == 64


def test_launcher_counts_derivatives_and_captured_grads_as_gradient_work():
    import torch

    from flexlab.codegen import generate
    from flexlab.kernels.bwd_launch import config_for
    slopes = torch.rand(4)

    def alibi(score, b, h, q_idx, kv_idx):  # additive: its derivative is 1, nothing per score
        return score + slopes[h] * (kv_idx - q_idx)

    def softcap(score, b, h, q_idx, kv_idx):
        return 20.0 * torch.tanh(score / 20.0)

    assert config_for(64, False, generate(alibi, None, fastmath=True), aux_grads=False).tile_m == 128
    assert config_for(64, False, generate(alibi, None, fastmath=True), aux_grads=True).tile_m == 64
    assert config_for(64, False, generate(softcap, None, fastmath=True), aux_grads=False).tile_m == 64
    assert config_for(64, False, None, aux_grads=False, q_block=128).tile_m == 128


def test_one_block_mask_serves_forward_and_backward():
    from flexlab.kernels.bwd_config import default_bwd_config, shares_block_mask_with_forward
    for D in (64, 128):
        assert default_bwd_config(D).feasibility_error() is None
        assert shares_block_mask_with_forward(D, 128)


def _alibi_mods(with_mask: bool):
    from flexlab.codegen import generate
    slopes = torch.rand(4)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return generate(alibi, causal if with_mask else None, fastmath=True)


def test_additive_bias_keeps_the_full_register_plan():
    """A score_mod whose derivative is 1 (ALiBi) needs neither score_mod_bwd nor the pre-mod scores, so the D=128
    kernel keeps the full plan (dP^T on the tensor cores while P is formed: one `wgmma.wait_group 1`) instead of the
    lean one. Measured on the H200 at fwd+bwd ALiBi-causal B4·S4k: 2.22 ms against 2.78 ms with the lean plan.
    With the causal mask_mod it spills 32 / 36 bytes (stores / loads), still the faster of the two; the guard keeps
    that from growing."""
    import dataclasses

    from flexlab.kernels.bwd_launch import compile_main
    for with_mask, spill_limit in ((False, 0), (True, 36)):
        g = _alibi_mods(with_mask)
        assert g.score_grad_is_identity and g.has_score_mod
        key = dataclasses.replace(_main_key(128, with_mask, g), score_grad_identity=True)
        ptx, report = _assemble(compile_main(key, g.module(), options=KEEP_PTX))
        assert max(report["spill_stores"], report["spill_loads"]) <= spill_limit, (with_mask, report)
        waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d)", ptx)
        assert "1" in waits, "dP^T should still be in flight when S^T is ready (full plan)"


def test_score_grad_identity_is_read_from_the_derivative():
    from flexlab.codegen import generate
    table = torch.rand(4, requires_grad=True)

    def softcap(score, b, h, q_idx, kv_idx):
        return 20.0 * torch.tanh(score / 20.0)

    def learnable(score, b, h, q_idx, kv_idx):
        return score + table[h]

    assert _alibi_mods(False).score_grad_is_identity
    assert not generate(softcap).score_grad_is_identity
    g = generate(learnable)
    assert g.score_grad_is_identity and any(g.aux_requires_grad)  # identity, yet the table's gradient needs dS


@pytest.mark.parametrize("D", [64, 128])
def test_document_mask_reading_a_captured_tensor_has_no_spills(D):
    """The launcher's configuration for a packed-document mask (two gathers of a captured id tensor per element, on
    partial blocks) fits its registers since the dQ warp took the reduce off the consumers (8 / 4 bytes of spills at
    D=64 / 128 before; `mask_early`, which also avoided them, ran 0.93x at D=64 on the H200)."""
    from flexlab.codegen import generate
    from flexlab.kernels.bwd_launch import compile_main, config_for
    doc = torch.arange(4096, dtype=torch.int32) // 500

    def document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    g = generate(None, document_causal, fastmath=True)
    cfg = config_for(D, False, g, False, 128)
    key = _main_key(D, True, g)
    assert key.config == cfg
    _, report = _assemble(compile_main(key, g.module(), options=KEEP_PTX))
    _no_spills(report)


def test_d64_heavy_masks_keep_64_row_steps_without_spills():
    """A mask of many operations (the gallery's 2-D neighbourhood mask: 19) keeps 64-row steps at D=64, where its
    backward has no spills (460 bytes with 128-row steps); the causal mask (1 operation) takes 128."""
    from flexlab.codegen import generate
    from flexlab.gallery import load_gallery
    from flexlab.kernels.bwd_config import D64_MAX_MASK_OPS
    from flexlab.kernels.bwd_launch import compile_main, config_for
    mods = load_gallery()["natten_2d"].build(B=1, H=4, Q_LEN=1024, KV_LEN=1024)
    g = generate(mods.score_mod, mods.mask_mod, fastmath=True)
    assert g.mask_op_count > D64_MAX_MASK_OPS
    assert config_for(64, False, g, False, 128).tile_m == 64
    assert config_for(64, False, g, False, None).tile_m == 128  # without a block mask no mask_mod runs
    causal = generate(None, lambda b, h, q, kv: q >= kv, fastmath=True)
    assert causal.mask_op_count == 1 and config_for(64, False, causal, False, 128).tile_m == 128
    key = _main_key(64, True, g)
    assert key.config.tile_m == 64
    _, report = _assemble(compile_main(key, g.module(), options=KEEP_PTX))
    _no_spills(report)


# Backward spill bytes (stores, loads) of the gallery kernels that spill or once did, with the launcher's
# configuration, trainable tensors requiring grad and a block mask at 128 (benchmarks/results/
# gallery_backward_spills_2026-11-30c.json.gz: dQ slab in fragment order, dk_after_dq): a ceiling, so a change that
# makes them worse fails here; lowering them is open work. With the block-sparse CTA order (`BwdConfig.lpt_order`: the
# KV tile, head and batch come from the order table, not the block index) natten_2d_dilated D=128 went 244/252 ->
# 248/256, and others went down: block_diffusion D=128 52/56 -> 44/48, bigbird 12/12 -> 4/8 (D=128) and 4/8 -> 0/0
# (D=64), tree_attention D=64 16/24 -> 12/20; shared_prefix D=64 had reached 0 with stored mask bits.
GALLERY_BWD_SPILL_CEILINGS = {
    ("attention_sinks", 64): (0, 0), ("bigbird", 64): (0, 0), ("bigbird", 128): (4, 8),
    ("block_diffusion", 128): (44, 48), ("flamingo_cross", 64): (0, 0), ("natten_2d", 128): (0, 0),
    ("natten_2d_dilated", 128): (248, 256), ("prefix_lm", 64): (0, 0), ("shared_prefix", 64): (0, 0),
    ("shared_prefix", 128): (0, 0), ("tree_attention", 64): (12, 20), ("tree_attention", 128): (0, 0)}


# The persistent forms (`bwd_config.runs_persistent`, short KV tiles) of a few: the same as one CTA per tile except the
# sandwich bias at D=128 (none in that form; 8 bytes here, reloaded twice per step).
GALLERY_PERSISTENT_SPILL_CEILINGS = {
    ("softcap", 128): (0, 0), ("document", 64): (0, 0), ("sliding_window", 128): (0, 0), ("alibi", 128): (0, 0),
    ("block_diffusion", 128): (44, 48), ("sandwich", 128): (8, 16)}


@pytest.mark.parametrize("name,D", list(GALLERY_PERSISTENT_SPILL_CEILINGS))
def test_gallery_persistent_backward_spills(name, D):
    from gallery_bwd_spills import compile_variant
    record = compile_variant((name, D, True))  # the launcher's configuration, persistent
    assert record["status"] == "ok", record
    stores, loads = GALLERY_PERSISTENT_SPILL_CEILINGS[(name, D)]
    assert record["spill_stores"] <= stores and record["spill_loads"] <= loads, record


@pytest.mark.parametrize("name,D", list(GALLERY_BWD_SPILL_CEILINGS))
def test_gallery_backward_spills_do_not_grow(name, D):
    from bwd_option_report import compile_ptx, key_for, ptxas_report

    from flexlab.codegen import generate
    from flexlab.gallery import get_variant
    from flexlab.kernels.bwd_config import drop_gathering_kind_loops
    from flexlab.kernels.bwd_launch import config_for, mask_gathers
    variant = get_variant(name)
    sq, skv = next(ql for ql in ((1024, 1024), (1024, 2048), (2048, 1024)) if variant.accepts_lengths(*ql))
    mods = variant.build(B=1, H=4, Q_LEN=sq, KV_LEN=skv)
    for tensor_name in variant.trainable:
        mods.tensors[tensor_name].requires_grad_(True)
    g = generate(mods.score_mod, mods.mask_mod, fastmath=True)
    sparse = g.has_mask_mod
    # (the mask evaluated inline, so a mask reading captured tensors keeps one loop, as the launcher runs it)
    cfg = drop_gathering_kind_loops(config_for(D, False, g, any(g.aux_requires_grad), 128 if sparse else None),
                                    mask_gathers(g))
    report = ptxas_report(compile_ptx(key_for(cfg, g, sparse, False), g))
    stores, loads = GALLERY_BWD_SPILL_CEILINGS[(name, D)]
    assert report["spill_stores"] <= stores and report["spill_loads"] <= loads, report


@pytest.mark.parametrize("D", [64, 128])
def test_backward_reads_stored_mask_bits_without_gathers(D):
    """Masks that read captured tensors reach the backward's partial blocks as stored bits (`BwdConfig.mask_bits`):
    no spills, and the step loop drops the document-id gathers (20 loads per thread at D=128's 64-query steps, 36
    at D=64's 128) for two 4-byte loads."""
    import dataclasses

    from bwd_option_report import compile_ptx, key_for

    from flexlab.codegen import generate
    from flexlab.gallery import get_variant
    from flexlab.kernels.bwd_launch import config_for
    from flexlab.viz.compile_report import report_from_ptx
    mods = get_variant("document").build(B=1, H=4, Q_LEN=1024, KV_LEN=1024)
    g = generate(mods.score_mod, mods.mask_mod, fastmath=True)
    cfg = config_for(D, False, g, False, 128)
    loops = {}
    for bits in (False, True):
        ptx = compile_ptx(key_for(dataclasses.replace(cfg, mask_bits=bits), g, True, False), g)
        rep = report_from_ptx(ptx)
        if rep.missing:
            pytest.skip(f"needs {rep.missing}")
        assert rep.spill_store_bytes == 0 and rep.spill_load_bytes == 0, (bits, rep.spill_store_bytes)
        loops[bits] = rep.gemm_loops[0]
    assert loops[False].get("LDG.E", 0) >= 18 and loops[True].get("LDG.E", 0) <= 4, (loops[False].get("LDG.E"),
                                                                                      loops[True].get("LDG.E"))
    assert sum(loops[True].values()) < sum(loops[False].values()) - 60
