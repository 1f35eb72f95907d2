"""torch tensors in, kernel launched, (out, lse) back, with as little Python per call as possible.

`forward` checks strides, looks the compiled kernel up in a dict, allocates O (and the LSE, unless the caller runs
the kernel that writes none) and calls it through TVM-FFI, which reads torch's current stream and takes torch tensors
directly. Anything slower (compiling, splitting a BlockMask) is cached. `bind` goes one step further for
`flexlab.flex_attention`'s warm path: everything that depends only on a call's signature is worked out once, so a
repeated call only checks base alignment, allocates and launches (`BoundForward`).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from functools import lru_cache

import torch

from ..errors import FlexlabValueError
from ..kernels import config as _policy
from ..kernels.config import FwdConfig, d128_stages, default_config
from . import poison
from .compile import CompileKey, KernelMods, cutlass_version, forward_kernel, tvm_ffi_available
from .schedule import heads_per_group
from .sparsity import MERGED_TILE_M, kernel_block_mask, ragged_first_offset

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """TMA needs a unit stride on D, 16-byte aligned other strides and base address; copy only when that fails."""
    if _strides_ready(t) and not t.data_ptr() % 16:
        return t
    # not contiguous(): it returns a contiguous tensor as it is, misaligned base or odd size-1 strides included
    return t.clone(memory_format=torch.contiguous_format)


def _strides_ready(t: torch.Tensor) -> bool:
    s0, s1, s2, s3 = t.stride()
    return s3 == 1 and not (s0 % 8 or s1 % 8 or s2 % 8) and bool(s0 and s1 and s2)


@lru_cache(maxsize=None)
def _static_key_parts() -> tuple[str, bool]:
    return cutlass_version(), tvm_ffi_available()


_FAST: dict[tuple, tuple] = {}
# per call signature: (its one-CTA-per-tile configuration, {scheduling plan: compiled kernel}, whether it runs
# dynamic tiles at every length: `dynamic_at_any_length`)
_PLANS: dict[tuple, tuple] = {}


# Memos of facts no policy knob changes (the toolchain's versions, a device's SM count): `forget_plans` keeps them.
_STATIC_MEMOS = frozenset({"_static_key_parts", "_sm_count"})


def clear_memos(namespace: dict, module: str, keep: frozenset = frozenset()) -> None:
    """Clear every `lru_cache` defined in `module` (found in its `namespace`, its globals) but those named in `keep`:
    a memo added later is covered without being listed here."""
    for name, value in list(namespace.items()):
        if name not in keep and getattr(value, "__module__", None) == module and hasattr(value, "cache_clear"):
            value.cache_clear()


def forget_plans() -> None:
    """Drop every memoised forward configuration and scheduling plan (compiled kernels stay cached): what a policy
    knob of `kernels.config` or `runtime.schedule` changed at run time needs before the next call sees it."""
    from . import schedule
    clear_memos(globals(), __name__, _STATIC_MEMOS)
    clear_memos(vars(schedule), schedule.__name__)
    _PLANS.clear()


def compile_key(mods: KernelMods, dtype: torch.dtype, cfg: FwdConfig, arch: str, sparse: bool,
                writes_lse: bool = True) -> CompileKey:
    version, ffi = _static_key_parts()
    return CompileKey(mods.source_hash, mods.score_mod is not None, mods.mask_mod is not None, mods.aux_tensor_specs,
                      mods.aux_scalar_kinds, _DTYPE_NAMES[dtype], cfg, arch, sparse, sparse, writes_lse,
                      cutlass_version=version, tvm_ffi=ffi)


def dense_mean_kv_blocks(cfg: FwdConfig, seqlen_k: int) -> int:
    """KV blocks every Q tile visits without a block mask."""
    return -(-seqlen_k // cfg.tile_n)


def runs_dynamic(cfg: FwdConfig, mean_kv_blocks: float | None, any_length: bool = False) -> bool:
    """Whether the default forward runs persistent CTAs with dynamic tiles (`DYNAMIC_MAX_MEAN_KV_BLOCKS`): when a Q
    tile visits few KV blocks on average, so each tile's prologue and epilogue weigh, or at every length for the
    kernels `dynamic_at_any_length` picks (`any_length`). Dense D=64 kernels keep their K/V multicast clusters at every
    length; dense D=128 ones drop them for short keys (one persistent CTA per SM has no partner), where dynamic tiles
    measured 1.10x at B8 S1k."""
    if any_length:
        return True
    return ((cfg.cluster_m == 1 or cfg.head_dim > 64) and mean_kv_blocks is not None
            and mean_kv_blocks <= _policy.DYNAMIC_MAX_MEAN_KV_BLOCKS)


def dynamic_at_any_length(head_dim: int, sparse: bool, has_score_mod: bool) -> bool:
    """Whether a kernel runs dynamic tiles whatever its tiles' length (`DYNAMIC_ANY_LENGTH_MAX_HEAD_DIM`): block-sparse
    without a score_mod."""
    bound = _policy.DYNAMIC_ANY_LENGTH_MAX_HEAD_DIM
    return sparse and not has_score_mod and bool(bound) and head_dim <= bound


def config_for(head_dim: int, sparse: bool, mods: KernelMods, seqlen_k: int | None = None,
               num_sms: int = 0, mean_kv_blocks: float | None = None, mask_bits: bool = False) -> FwdConfig:
    """The kernel configuration flexlab runs for these inputs (`kernels.config.default_config` and its policy knobs,
    which are read when a configuration is first chosen: set them before the first call). With `num_sms` > 0 (the
    device's SM count) it is persistent with dynamic tiles where `runs_dynamic` says so; the mean number of KV blocks
    a Q tile visits is `mean_kv_blocks` under a block mask (`KernelBlockMask.mean_kv_blocks`; None: unknown, one CTA
    per tile) and follows from `seqlen_k` without one. `mask_bits`: the mods store partial-block bits
    (`runtime.mask_bits`), which the kernel reads where its tiles allow (`with_mask_bits`)."""
    base = _config(head_dim, sparse, mods.score_mod is not None, d128_stages(seqlen_k) if head_dim == 128 else 0,
                   bool(mods.aux_tensor_specs), bool(getattr(mods.mask_mod, "band_is_window", False)))
    if not sparse and seqlen_k is not None:
        mean_kv_blocks = dense_mean_kv_blocks(base, seqlen_k)
    any_length = dynamic_at_any_length(head_dim, sparse, mods.score_mod is not None)
    cfg = scheduled(base, scheduling(base, mean_kv_blocks, any_length), num_sms) if num_sms else base
    return with_mask_bits(cfg) if mask_bits and sparse else cfg


def scheduling(cfg: FwdConfig, mean_kv_blocks: float | None, any_length: bool = False) -> str:
    """How the default forward schedules CTAs for tiles visiting `mean_kv_blocks` KV blocks on average: "dynamic"
    (`runs_dynamic`; `any_length` from `dynamic_at_any_length`), "clusters" (`runs_persistent_clusters`), "split"
    (`runs_split_tail`), or "" (one CTA, or cluster, per tile)."""
    if runs_dynamic(cfg, mean_kv_blocks, any_length):
        return "dynamic"
    if runs_split_tail(cfg, mean_kv_blocks):
        return "split"
    return "clusters" if runs_persistent_clusters(cfg, mean_kv_blocks) else ""


def scheduled(cfg: FwdConfig, how: str, num_sms: int) -> FwdConfig:
    """`cfg` with the CTA scheduling `how` (a `scheduling` answer) on a GPU of `num_sms` SMs."""
    if how == "dynamic":
        return _dynamic(cfg, num_sms)
    if how == "split":
        return _split_tail(cfg, num_sms)
    return _persistent_clusters(cfg, num_sms) if how == "clusters" else cfg


def runs_split_tail(cfg: FwdConfig, mean_kv_blocks: float | None) -> bool:
    """Whether a K/V multicast kernel (dense) runs static persistent clusters with the split tail
    (`FwdConfig.split_tail`): tiles of at least `SPLIT_TAIL_MIN_MEAN_KV_BLOCKS` KV blocks, where a round of pairs is
    long enough that the last one's idle SMs cost more than cutting it."""
    bound = _policy.SPLIT_TAIL_MIN_MEAN_KV_BLOCKS
    return cfg.cluster_m > 1 and mean_kv_blocks is not None and bool(bound) and mean_kv_blocks >= bound


@lru_cache(maxsize=None)
def _split_tail(cfg: FwdConfig, num_sms: int) -> FwdConfig:
    """`cfg` as static persistent clusters (`_persistent_clusters`) with the split tail."""
    return dataclasses.replace(_persistent_clusters(cfg, num_sms), split_tail=True)


def runs_persistent_clusters(cfg: FwdConfig, mean_kv_blocks: float | None) -> bool:
    """Whether a K/V multicast kernel (dense) runs static persistent clusters: tiles of more than
    `DYNAMIC_MAX_MEAN_KV_BLOCKS` and up to `PERSISTENT_CLUSTER_MAX_MEAN_KV_BLOCKS` KV blocks (measured at 32), where
    overlapping a pair's epilogue with the next pair's first loads pays; tiles of at least
    `SPLIT_TAIL_MIN_MEAN_KV_BLOCKS` run them with the split tail (`runs_split_tail`), tiles between the two bounds one
    cluster per pair of Q tiles, and shorter ones what they had (dynamic tiles at D=128, a cluster per pair at D=64)."""
    return (cfg.cluster_m > 1 and mean_kv_blocks is not None
            and _policy.DYNAMIC_MAX_MEAN_KV_BLOCKS < mean_kv_blocks <= _policy.PERSISTENT_CLUSTER_MAX_MEAN_KV_BLOCKS)


@lru_cache(maxsize=None)
def _persistent_clusters(cfg: FwdConfig, num_sms: int) -> FwdConfig:
    """`cfg` as static persistent clusters, one CTA per SM (an even count), with the persistent kernels' anchored K
    release."""
    return dataclasses.replace(cfg, persistent_ctas=num_sms // cfg.cluster_m * cfg.cluster_m,
                               **_policy.anchored_options(cfg.head_dim, True))


@lru_cache(maxsize=None)
def with_mask_bits(cfg: FwdConfig) -> FwdConfig:
    """`cfg` reading stored partial-block bits (`FwdConfig.mask_bits`) where its tiles allow, else `cfg` as it is."""
    reading = dataclasses.replace(cfg, mask_bits=True, band_mask=False)  # (stored bits replace the band)
    return reading if reading.feasibility_error() is None else cfg


@lru_cache(maxsize=None)
def _config(head_dim: int, sparse: bool, has_score_mod: bool, d128_stage_count: int, captured_tensors: bool = False,
            band_is_window: bool = False):
    cfg = default_config(head_dim, sparse, has_score_mod, captured_tensors=captured_tensors)
    if head_dim == 128 and d128_stage_count != cfg.num_stages:
        cfg = dataclasses.replace(cfg, num_stages=d128_stage_count)
    band = _policy.band_options(head_dim, band_is_window)
    return dataclasses.replace(cfg, **band) if band else cfg


@lru_cache(maxsize=None)
def _dynamic(cfg: FwdConfig, num_sms: int) -> FwdConfig:
    """`cfg` as persistent CTAs, one per SM, taking tiles from a counter (no cluster partner to share K/V with)."""
    return dataclasses.replace(cfg, persistent_ctas=num_sms, cluster_m=1, dynamic_tiles=True,
                               **_policy.anchored_options(cfg.head_dim, True))


@lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _compiled(mods: KernelMods, dtype: torch.dtype, cfg: FwdConfig, arch: str, sparse: bool, writes_lse: bool):
    """(compiled function, key); one small-tuple dict lookup once warm."""
    fast = (mods, dtype, cfg, arch, sparse, writes_lse)
    hit = _FAST.get(fast)
    if hit is None:
        key = compile_key(mods, dtype, cfg, arch, sparse, writes_lse)
        hit = (forward_kernel(key, mods), key)
        _FAST[fast] = hit
    return hit


# Scheduling buffers kernels leave as they found them (counters back at 0), so launches that run one after another
# share them: one per stream (and kind). Kernels on two streams may overlap, so they never share one. A captured CUDA
# graph is replayed later, maybe beside eager launches or other graphs, so each of its launches gets buffers of its
# own, allocated during the capture: they come from the graph's memory pool, their zeroing is a node of the graph
# (replayed before the launch that uses them) and they are freed with the graph, not kept by the process.
_STREAM_BUFFERS: dict[tuple, object] = {}


def _per_stream(device: torch.device, what: tuple, make, stream: torch.cuda.Stream | None = None):
    """The buffer `make()` builds for `what` on this stream (`stream`; default the current one); under capture a
    new one, the launch's own."""
    if torch.cuda.is_current_stream_capturing():
        return make()
    # the raw handle: building a torch Stream object costs microseconds per call
    handle = _current_raw_stream(device.index) if stream is None else stream.cuda_stream
    key = (device.index, handle, what)
    hit = _STREAM_BUFFERS.get(key)
    if hit is None:
        hit = _STREAM_BUFFERS[key] = make()
    return hit


def tile_counter(device: torch.device, stream: torch.cuda.Stream | None = None) -> torch.Tensor:
    """The zeroed int32 counter a `dynamic_tiles` kernel (and a persistent backward) hands tiles out with, one per
    stream: each launch leaves it at 0 (`kernels.tile_scheduler.claim_tile`)."""
    return _per_stream(device, ("tiles",), lambda: torch.zeros(1, dtype=torch.int32, device=device), stream)


def scheduler_workspace(cfg: FwdConfig, device: torch.device):
    """What a kernel of `cfg` schedules its tiles with: the tile counter (`dynamic_tiles`), the split tail's
    (zeroed arrival counters, partial results) (`split_tail`, `kernels.split_tail`), else None. One per stream and
    kind; the kernel leaves the counters at 0 and overwrites every partial before reading it."""
    if cfg.dynamic_tiles:
        return tile_counter(device)
    if not cfg.split_tail:
        return None
    return split_tail_buffers(device, *cfg.split_tail_workspace())


def split_tail_buffers(device: torch.device, counters: int, floats: int) -> tuple:
    """(zeroed int32 arrival counters, fp32 partial results) of a split tail (`kernels.split_tail`), the forward's or
    the backward's: views of the size asked for into one pair per stream, grown to the largest size asked for, so
    calls of many shapes (the backward's cut depends on the batch, the heads and the lengths) hold one workspace, not
    one each. The kernels leave the counters at 0 and write every partial before reading it; a grown pair replaces
    the old one, whose memory the caching allocator hands out again only behind the stream's earlier kernels."""
    held = _per_stream(device, ("split",), lambda: _SplitWorkspace(device))
    views = held.views.get((counters, floats))
    if views is None:
        if held.counters.numel() < counters or held.partials.numel() < floats:
            held.counters = torch.zeros(max(counters, held.counters.numel()), dtype=torch.int32, device=device)
            held.partials = torch.empty(max(floats, held.partials.numel()), dtype=torch.float32, device=device)
            held.views.clear()
        views = held.views[counters, floats] = (held.counters[:counters], held.partials[:floats])
    return views


class _SplitWorkspace:
    """One stream's split-tail workspace (`split_tail_buffers`) and the views of it handed out so far, by size."""

    def __init__(self, device: torch.device):
        self.counters = torch.zeros(0, dtype=torch.int32, device=device)
        self.partials = torch.empty(0, dtype=torch.float32, device=device)
        self.views: dict[tuple, tuple] = {}


# torch's own cheap accessor for the current stream's handle (what its compiled kernels use), where the build has it
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda device_index: torch.cuda.current_stream(device_index).cuda_stream)


def _workspace_to_cute(space):
    if space is None:
        return None
    return tuple(_to_cute(t, 16) for t in space) if isinstance(space, tuple) else _to_cute(space)


def _to_cute(t, align: int | None = None):
    from cutlass.cute.runtime import from_dlpack
    align = align or (16 if t.dim() == 4 else 4)
    return from_dlpack(t, assumed_align=align).mark_layout_dynamic(leading_dim=t.dim() - 1)


_NO_MODS = KernelMods()


def _stored_bits(q: torch.Tensor, kbm, cfg: FwdConfig, seqlen_k: int, stored_masks, ragged_first: bool = False):
    """The partial-block bits of `kbm` for a kernel with `cfg`'s tiles (`runtime.mask_bits.StoredBits`), or None
    where none are stored (no store given, tiles the bit layout does not cover, or too large). `ragged_first`: `kbm`
    was built with the padded Q rows in the first tile (`FwdConfig.ragged_first_tile`)."""
    if stored_masks is None or kbm is None or not with_mask_bits(cfg).mask_bits:
        return None
    B, Hq, Sq, _ = q.shape
    offset = ragged_first_offset(Sq, cfg.tile_m) if ragged_first else 0
    return stored_masks.bits(kbm, kbm.kv_num, kbm.kv_idx, B, Hq, True, cfg.tile_m, Sq, seqlen_k, row_offset=offset)


def may_move_padding(tiles: FwdConfig, seqlen_q: int, mods: KernelMods, reads_bits: bool) -> bool:
    """Whether a block-sparse kernel with these tiles may put its padded Q rows in the first tile
    (`FwdConfig.ragged_first_tile`), before the mask's lists are looked at: the policy allows it, the tiles straddle
    mask rows and do not divide seqlen_q, and no mod reads a captured tensor at the first tile's rows before 0 (no
    score_mod; a mask that reads tensors only through stored bits, `reads_bits`)."""
    return (_policy.RAGGED_FIRST_MIN_SAVING < 1 and tiles.tile_m in MERGED_TILE_M and bool(seqlen_q % tiles.tile_m)
            and mods.score_mod is None and (not mods.aux_tensor_specs or reads_bits))


def _ragged_first(q: torch.Tensor, mods: KernelMods, block_mask, tiles: FwdConfig, kbm, bits, seqlen_k: int,
                  stored_masks) -> tuple | None:
    """(lists, bits) with the padded Q rows in the first tile (`FwdConfig.ragged_first_tile`) where the policy takes
    them (`may_move_padding`) and the lists then visit at least `RAGGED_FIRST_MIN_SAVING` fewer KV blocks, else
    None."""
    Sq = q.shape[2]
    if not may_move_padding(tiles, Sq, mods, bits is not None):
        return None
    moved = kernel_block_mask(block_mask, Sq, tiles.tile_m, tiles.tile_n, seqlen_k, ragged_first=True)
    if moved.mean_kv_blocks >= kbm.mean_kv_blocks * (1 - _policy.RAGGED_FIRST_MIN_SAVING):
        return None
    if bits is None:
        return moved, None
    moved_bits = _stored_bits(q, moved, tiles, seqlen_k, stored_masks, ragged_first=True)
    return None if moved_bits is None else (moved, moved_bits)


def _sparse_args(kbm, bits) -> tuple:
    """The kernel's block-list arguments: the four lists, or with stored bits their partial lists (empty blocks
    dropped) and the words after them."""
    if bits is None:
        return kbm.as_args()
    return (bits.num, bits.idx, kbm.full_num, kbm.full_idx, bits.words)


def bits_wide_tiles(cfg: FwdConfig, mean_kv_blocks: float, has_score_mod: bool) -> FwdConfig | None:
    """The 192-row D=64 configuration a kernel reading stored mask bits takes instead of `cfg`, where
    `D64_BITS_TILE192_MIN_MEAN_KV_BLOCKS` asks for it at this mean (KV blocks per 128-row tile), else None."""
    bound = _policy.D64_BITS_TILE192_MIN_MEAN_KV_BLOCKS
    if not bound or cfg.head_dim != 64 or cfg.tile_m != 128 or has_score_mod or mean_kv_blocks < bound:
        return None
    return FwdConfig(head_dim=64, tile_m=192, tile_n=128, num_stages=3, mask_bits=True)


def _plan(q: torch.Tensor, k: torch.Tensor, mods: KernelMods, block_mask, config: FwdConfig | None, arch: str,
          writes_lse: bool = True, stored_masks=None):
    """(compiled function, key, sparse arguments or None, launch order or None) for these inputs. The sparse
    arguments are the kernel's four block lists, followed by the stored partial-block bits where the kernel reads
    them (`FwdConfig.mask_bits`; an explicit `config` decides that itself)."""
    D, Skv = q.shape[3], k.shape[2]
    sparse = block_mask is not None
    if config is not None:
        fn, key = _compiled(mods, q.dtype, config, arch, sparse, writes_lse)
        kbm = kernel_block_mask(block_mask, q.shape[2], config.tile_m, config.tile_n, Skv,
                                config.ragged_first_tile) if sparse else None
        args = kbm.as_args() if sparse else None
        if config.mask_bits:
            bits = _stored_bits(q, kbm, config, Skv, stored_masks, config.ragged_first_tile)
            if bits is None:
                raise ValueError("FwdConfig.mask_bits=True needs a block mask and stored mask bits (stored_masks=)")
            args = _sparse_args(kbm, bits)
        return fn, key, args, kbm.order if sparse else None
    # Everything the default configuration depends on; the policy terms are constants unless a knob is set.
    stages = d128_stages(Skv) if D == 128 else 0
    fast = (mods, q.dtype, D, sparse, arch, stages, writes_lse)
    plans = _PLANS.get(fast)
    if plans is None:
        plans = _PLANS[fast] = (config_for(D, sparse, mods, Skv), {},
                                dynamic_at_any_length(D, sparse, mods.score_mod is not None))
    # compiled: (scheduling, SM count of a persistent kernel or 0, reads bits, tile_m, ragged first tile) -> ...
    base, compiled, any_length = plans
    kbm = kernel_block_mask(block_mask, q.shape[2], base.tile_m, base.tile_n, Skv) if sparse else None
    mean = kbm.mean_kv_blocks if sparse else dense_mean_kv_blocks(base, Skv)
    how = scheduling(base, mean, any_length)
    num_sms = _sm_count(q.device) if how else 0
    bits = _stored_bits(q, kbm, base, Skv, stored_masks)
    tiles = base
    if bits is not None:  # D=64 may take wider tiles once the mask needs no registers (`bits_wide_tiles`)
        wide = bits_wide_tiles(base, mean, mods.score_mod is not None)
        wide_kbm = kernel_block_mask(block_mask, q.shape[2], 192, 128, Skv) if wide is not None else None
        wide_bits = _stored_bits(q, wide_kbm, wide, Skv, stored_masks) if wide is not None else None
        if wide_bits is not None:
            tiles, kbm, bits = wide, wide_kbm, wide_bits
    moved = _ragged_first(q, mods, block_mask, tiles, kbm, bits, Skv, stored_masks) if sparse else None
    if moved is not None:
        kbm, bits = moved
    plan = (how, num_sms, bits is not None, tiles.tile_m, moved is not None)
    hit = compiled.get(plan)
    if hit is None:
        cfg = scheduled(tiles, how, num_sms)
        if bits is not None:
            cfg = with_mask_bits(cfg)
        if moved is not None:
            cfg = dataclasses.replace(cfg, ragged_first_tile=True)
        hit = compiled[plan] = _compiled(mods, q.dtype, cfg, arch, sparse, writes_lse)
    fn, key = hit
    args = None if kbm is None else _sparse_args(kbm, bits)
    return fn, key, args, kbm.order if sparse else None


def _launch_constants(q: torch.Tensor, k: torch.Tensor, block_mask) -> tuple[float, int, int]:
    """(default softmax scale, query heads per KV head, (batch, head) pairs per L2 group) of a launch."""
    B, Hq, _, D = q.shape
    qpk = Hq // k.shape[1]
    return D ** -0.5, qpk, heads_per_group(k.shape[2], D, 2, qpk, B * Hq, block_mask is not None)


def kernel_takes_scale(scale) -> bool:
    """Whether the kernels take this softmax scale: None (1/sqrt(D)) or a finite real > 0. A row's first rescale
    factor is exp2(-inf * scale), NaN at 0, and a negative scale inverts the running max."""
    return scale is None or (isinstance(scale, numbers.Real) and 0 < scale < math.inf)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mods: KernelMods = _NO_MODS,
            aux_tensors: tuple = (), aux_scalars: tuple = (), block_mask=None, scale: float | None = None,
            config: FwdConfig | None = None, arch: str = "sm_90a", with_lse: bool = True, stored_masks=None):
    """Run the Hopper forward kernel: (out, lse); lse is None with `with_lse=False` (a kernel that never writes it).
    q (B, Hq, Sq, D), k/v (B, Hkv, Skv, D) on one CUDA device, bf16/fp16; `aux_tensors` as
    `GeneratedMods.kernel_aux_tensors` gives them (row-major: the kernel's call refuses other strides).
    `stored_masks` (`runtime.mask_bits.StoredMasks` of the block mask's mask_mod): partial blocks then read stored
    bits instead of evaluating mask_mod."""
    B, Hq, Sq, D = q.shape
    if not kernel_takes_scale(scale):
        raise FlexlabValueError(f"scale={scale}: the forward kernel needs a finite scale > 0")
    fn, key, sparse, order = _plan(q, k, mods, block_mask, config, arch, with_lse, stored_masks)
    q, k, v = tma_ready(q), tma_ready(k), tma_ready(v)
    out = torch.empty((B, Hq, Sq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, Sq), dtype=torch.float32, device=q.device) if with_lse else None
    if poison.ENABLED:
        poison.fill(out, lse)
    default_scale, qpk, group = _launch_constants(q, k, block_mask)
    scale = default_scale if scale is None else float(scale)
    space = scheduler_workspace(key.config, q.device)
    if key.tvm_ffi:
        fn(q, k, v, out, lse, scale, qpk, group, sparse, order, space, aux_tensors, aux_scalars)
    else:
        import cuda.bindings.driver as cuda
        stream = cuda.CUstream(torch.cuda.current_stream(q.device).cuda_stream)
        conv_sparse = tuple(_to_cute(t) for t in sparse) if sparse is not None else None
        fn(_to_cute(q), _to_cute(k), _to_cute(v), _to_cute(out), _to_cute(lse) if with_lse else None, scale, qpk,
           group, conv_sparse, _to_cute(order) if order is not None else None,
           _workspace_to_cute(space),
           tuple(_to_cute(t, t.element_size()) for t in aux_tensors), tuple(aux_scalars), stream)
    return out, lse


class BoundForward:
    """A forward launch with everything that depends only on the call's shapes, strides, dtype, device, mods and
    block mask worked out once (kernel, launch grouping, sparse lists). Calling it with tensors of that signature
    allocates O (and LSE, where the kernel writes it) and launches: the warm path of `flexlab.flex_attention`
    (`backends.cute.WarmForward`)."""

    __slots__ = ("fn", "out_like_q", "out_shape", "lse_shape", "dtype", "device", "default_scale", "qpk", "group",
                 "sparse", "order", "config", "aux_tensors", "aux_scalars", "block_mask")

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale) -> tuple | None:
        """(out, lse or None), or None when a base address is not 16-byte aligned (then `forward` copies)."""
        if q.data_ptr() % 16 or k.data_ptr() % 16 or v.data_ptr() % 16:
            return None
        # (empty_like parses no arguments: the cheapest allocation, where q has O's shape and layout)
        out = torch.empty_like(q) if self.out_like_q else torch.empty(self.out_shape, dtype=self.dtype,
                                                                        device=self.device)
        lse = None if self.lse_shape is None else torch.empty(self.lse_shape, dtype=torch.float32,
                                                               device=self.device)
        if poison.ENABLED:
            poison.fill(out, lse)
        self.fn(q, k, v, out, lse, self.default_scale if scale is None else float(scale), self.qpk, self.group,
                self.sparse, self.order, scheduler_workspace(self.config, self.device), self.aux_tensors,
                self.aux_scalars)
        return out, lse


def bind(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mods: KernelMods = _NO_MODS, aux_tensors: tuple = (),
         aux_scalars: tuple = (), block_mask=None, with_lse: bool = True, arch: str = "sm_90a",
         stored_masks=None) -> BoundForward | None:
    """The default-configuration launch of `forward` for tensors shaped, strided and placed like these, or None
    where it cannot be bound (strides TMA cannot read as they are; no TVM-FFI, so arguments convert per call)."""
    if not (_strides_ready(q) and _strides_ready(k) and _strides_ready(v)):
        return None
    fn, key, sparse, order = _plan(q, k, mods, block_mask, None, arch, with_lse, stored_masks)
    if not key.tvm_ffi:
        return None
    B, Hq, Sq, D = q.shape
    bound = BoundForward()
    bound.fn, bound.dtype, bound.device = fn, q.dtype, q.device
    bound.out_shape, bound.lse_shape = (B, Hq, Sq, D), (B, Hq, Sq) if with_lse else None
    bound.out_like_q = q.is_contiguous()
    bound.default_scale, bound.qpk, bound.group = _launch_constants(q, k, block_mask)
    bound.sparse, bound.order = sparse, order
    bound.config = key.config
    bound.aux_tensors, bound.aux_scalars = aux_tensors, aux_scalars
    bound.block_mask = block_mask  # its kernel lists stay valid only while it lives
    return bound
