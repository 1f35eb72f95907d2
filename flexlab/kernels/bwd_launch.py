"""torch tensors in, the three backward kernels launched, (dq, dk, dv, captured-tensor grads) back.

preprocess (D, LSE in base 2, dQ sums zeroed) -> main kernel (dK, dV, fp32 dQ partial sums, captured-tensor grads)
-> postprocess (dQ = scale * sum); where a dense grid's last wave is cut, the parts' kernel (`BwdConfig.split_tail`)
runs between the main kernel and the postprocess. Each kernel is compiled once per configuration against symbolic
shapes; the key names everything that is baked into the machine code (generated mods by hash and by source, tiles,
dtype, which optional inputs exist, arch, cutlass version, DSL settings, a fingerprint of the backward's kernel
sources), never a runtime value. The compiled kernels live in the same memory + disk cache as the forward's
(`runtime.disk_cache.KernelCache`, the directory of `runtime.disk_cache.cache_dir()`), so a new process loads them
instead of compiling again.

The kernels are compiled with TVM-FFI (`--enable-tvm-ffi`, torch's current stream as the environment stream), so a
call hands torch tensors straight to the compiled function, which reads their DLPack headers in C and checks them
against the compiled signature (dtype, rank, static sizes and strides, alignment, device). A warm call does no more
Python than allocating the outputs and a few dict lookups, and never reads GPU memory back: what depends on the mods
or the block mask is cached.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

import torch

from ..errors import BackendUnavailableError
from ..runtime import poison
from ..runtime.disk_cache import KernelCache, StampedKey, source_fingerprint
from ..runtime.launch import _sm_count, clear_memos, split_tail_buffers, tile_counter, tma_ready
from . import bwd_config
from .bwd_config import BwdConfig, default_bwd_config

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


#: The kernel modules whose import closure makes up the backward's fingerprint: the three kernels, this module (it
#: constructs them and chooses the compile options) and `bwd_aux_grad` (imported by generated code).
_FINGERPRINT_ROOTS = ("bwd_launch", "bwd_sm90", "bwd_preprocess", "bwd_postprocess", "bwd_aux_grad")


def fingerprint_extra_files() -> tuple:
    """Files outside `flexlab.kernels` that decide the backward's machine code: `runtime/compile.py` (the captured
    tensors' compiled layout, `fake_captured_tensor`)."""
    from pathlib import Path

    from ..runtime import compile as forward_compile
    return (Path(forward_compile.__file__).resolve(),)


@lru_cache(maxsize=None)
def bwd_fingerprint() -> str:
    """sha256 of the backward kernels' source files, every kernel module they import and `fingerprint_extra_files`:
    editing any of them invalidates the backward's disk entries (all three kernels; pre/postprocess are quick to
    rebuild)."""
    return source_fingerprint(_FINGERPRINT_ROOTS, extra_files=fingerprint_extra_files())


@dataclass(frozen=True, kw_only=True)
class _BwdStamp(StampedKey):
    """The backward kernels' keys: the toolchain stamp and the backward's source fingerprint (always stored on disk:
    the backward is only ever built with TVM-FFI)."""

    kernel_source: str = field(default_factory=lambda: bwd_fingerprint())


@dataclass(frozen=True)
class BwdKey(_BwdStamp):
    """Everything the main backward kernel is specialised on."""

    source_hash: str
    has_score_mod: bool
    has_mask_mod: bool
    has_aux_grad: bool
    aux_tensor_specs: tuple  # ((dtype name, ndim), ...) of the captured tensors as the kernel reads them
    aux_scalar_kinds: tuple  # ("int" | "float", ...)
    aux_grad_ranks: tuple
    dtype: str
    config: BwdConfig
    block_sparse: bool
    deterministic: bool = False
    arch: str = "sm_90a"
    fixed_point_aux_grads: bool = False  # int64 fixed-point captured-tensor grads (deterministic mode)
    generated_source: str = ""  # `GeneratedMods.source_hash`: the disk cache must not outlive a code-generator edit
    score_grad_identity: bool = False  # d(score_mod)/d(score) == 1: the kernel skips score_mod_bwd
    aux_grad_reads_score: bool = True  # False: the captured-tensor gradients never read the pre-mod score


@dataclass(frozen=True)
class BwdPreKey(_BwdStamp):
    """The preprocess kernel (D = rowsum(O * dO), LSE in base 2, the fp32 dQ sums zeroed)."""

    dtype: str
    head_dim: int
    has_dlse: bool
    arch: str = "sm_90a"
    chained: bool = True  # `BwdConfig.chained_launch`


@dataclass(frozen=True)
class BwdPostKey(_BwdStamp):
    """The postprocess kernel (dQ = scale * fp32 sum, in the input dtype), for one dQ layout of the main kernel."""

    dtype: str
    head_dim: int
    arch: str = "sm_90a"
    dq_layout: tuple = ()  # `BwdConfig.dq_layout`; () = that of the default configuration at this head dim
    chained: bool = True  # `BwdConfig.chained_launch`

    def __post_init__(self):  # one key per kernel: () is stored as the layout it stands for
        object.__setattr__(self, "dq_layout", _dq_layout(self.head_dim, self.dq_layout))


def _dq_layout(head_dim: int, dq_layout: tuple) -> tuple:
    """`dq_layout`, or the default configuration's at this head dim when it is ()."""
    return tuple(dq_layout) or default_bwd_config(head_dim).dq_layout


_CACHE = KernelCache()


def bwd_kernel_cache() -> KernelCache:
    """The backward kernels' cache: its own stats, the forward's directory (`runtime.disk_cache.cache_dir()`)."""
    return _CACHE


def _cutlass_dtype(name: str):
    from ..runtime.compile import _cutlass_dtype as convert
    return convert(name)


def _compiled(key, build):
    """The compiled kernel for `key`: from memory, else from disk, else `build()` (then stored on disk).

    TVM-FFI is checked first: without it an entry could not be loaded, and a failed load deletes the entry."""
    require_tvm_ffi()
    return bwd_kernel_cache().get(key, build)


def preprocess_kernel(dtype: str, head_dim: int, has_dlse: bool, arch: str = "sm_90a", chained: bool = True):
    return _compiled(BwdPreKey(dtype, head_dim, has_dlse, arch, chained),
                     lambda: compile_preprocess(dtype, head_dim, has_dlse, arch, chained=chained))


def postprocess_kernel(dtype: str, head_dim: int, arch: str = "sm_90a", dq_layout: tuple = (), chained: bool = True):
    key = BwdPostKey(dtype, head_dim, arch, tuple(dq_layout), chained)
    return _compiled(key, lambda: compile_postprocess(dtype, head_dim, arch, dq_layout=key.dq_layout,
                                                      chained=chained))


def main_kernel(key: BwdKey, generated=None):
    """`generated` is the `GeneratedMods` whose hash and source are in `key` (None without mods); its module is
    executed only if the kernel has to be compiled."""
    return _compiled(key, lambda: compile_main(key, generated.module() if generated is not None else None))


def require_tvm_ffi() -> None:
    """The backward kernels are only ever called through TVM-FFI: name the missing package up front instead of
    failing deep inside the DSL's compiler."""
    from ..runtime.compile import tvm_ffi_available
    if not tvm_ffi_available():
        raise BackendUnavailableError(
            "flexlab's backward kernels are called through TVM-FFI, but the 'apache-tvm-ffi' package is not "
            "installed; it is a dependency of flexlab: pip install apache-tvm-ffi==0.1.15.post2")


def _options(arch: str, extra: str) -> str:
    return f"--gpu-arch {arch} --enable-tvm-ffi{extra}"


def compile_preprocess(dtype: str, head_dim: int, has_dlse: bool, arch: str = "sm_90a", options: str = "",
                       chained: bool = True):
    from ..runtime.compile import dsl_compile
    from .bwd_preprocess import BwdPreprocess, fake_arguments
    require_tvm_ffi()
    dt = _cutlass_dtype(dtype)
    return dsl_compile(BwdPreprocess(dt, head_dim, has_dlse, chained), *fake_arguments(dt, head_dim, has_dlse),
                       options=_options(arch, options))


def compile_postprocess(dtype: str, head_dim: int, arch: str = "sm_90a", options: str = "", dq_layout: tuple = (),
                        chained: bool = True):
    from ..runtime.compile import dsl_compile
    from .bwd_postprocess import BwdPostprocess, fake_arguments
    require_tvm_ffi()
    dt = _cutlass_dtype(dtype)
    return dsl_compile(BwdPostprocess(dt, head_dim, _dq_layout(head_dim, dq_layout), chained),
                       *fake_arguments(dt, head_dim), options=_options(arch, options))


def compile_main(key: BwdKey, module=None, options: str = ""):
    """`module` is the generated CuTeDSL module (score_mod, mask_mod, score_mod_bwd, score_mod_aux_grad)."""
    from ..runtime.compile import dsl_compile
    from .bwd_aux_grad import accumulates_through_add_aux_grad
    from .bwd_sm90 import FlexBwdSm90, fake_arguments
    require_tvm_ffi()
    dt = _cutlass_dtype(key.dtype)
    score_mod = module.score_mod if key.has_score_mod else None
    score_mod_bwd = module.score_mod_bwd if key.has_score_mod and not key.score_grad_identity else None
    kernel = FlexBwdSm90(key.config, dt, score_mod, score_mod_bwd,
                         module.score_mod_aux_grad if key.has_aux_grad else None,
                         module.mask_mod if key.has_mask_mod else None, has_aux_tensors=bool(key.aux_tensor_specs),
                         deterministic=key.deterministic, grad_runs=accumulates_through_add_aux_grad(module),
                         aux_grad_reads_score=key.aux_grad_reads_score)
    args = fake_arguments(key.config, dt, key.block_sparse, key.aux_tensor_specs, key.aux_scalar_kinds,
                          key.aux_grad_ranks, key.deterministic, key.fixed_point_aux_grads)
    return dsl_compile(kernel, *args, options=_options(key.arch, options))


def q_direction_tensors(block_mask: list, block_size: list, cfg: BwdConfig, seqlen_k: int) -> tuple:
    """The BlockMask's Q-direction lists (per KV block: which Q blocks, partial then full) at the kernel tiles."""
    from ..runtime.sparsity import _split
    q_bs, kv_bs = block_size
    err = cfg.block_mask_error(q_bs, kv_bs)
    if err:
        raise BackendUnavailableError(f"backend='cute' backward: {err}; build the mask with BLOCK_SIZE=128")
    q_num, q_idx, full_num, full_idx = block_mask[4:8]
    if q_num is None:
        raise BackendUnavailableError("the BlockMask has no Q-direction block lists (q_num_blocks); build it with "
                                      "create_block_mask so the backward can skip empty blocks")
    n_kv_tiles = -(-seqlen_k // cfg.tile_n)
    rows, listed = kv_bs // cfg.tile_n, q_bs // cfg.tile_m
    num, idx = _split(q_num, q_idx, rows, listed, n_kv_tiles)
    if full_num is not None:
        fnum, fidx = _split(full_num, full_idx, rows, listed, n_kv_tiles)
    else:
        fnum, fidx = torch.zeros_like(num), torch.zeros_like(idx[..., :1])
    return num, idx, fnum, fidx


class QLists:
    """One BlockMask's Q-direction lists at the kernel tiles, and (deterministic mode) its rank tables, built once.

    Holds the mask tensors it came from, so their addresses in the cache key cannot be reused by another mask."""

    def __init__(self, tensors: tuple, owners: tuple):
        self.tensors, self._owners = tensors, owners
        self._ranks: dict[tuple, torch.Tensor] = {}
        self._orders: dict[tuple, torch.Tensor] = {}
        self._in_q_order: dict[int, QLists] = {}
        self._mean_visits: float | None = None

    def tile_order(self, batch: int, kv_heads: int, qhead_per_kvhead: int, seqlen_q: int, head_dim: int):
        """`BwdConfig.lpt_order`'s CTA order for these lists, built once per shape and L2 group budget
        (`lpt_tile_order`)."""
        key = (batch, kv_heads, qhead_per_kvhead, seqlen_q, head_dim, bwd_config.LPT_GROUP_L2_BYTES)
        hit = self._orders.get(key)
        if hit is None:
            hit = self._orders[key] = lpt_tile_order(self.tensors, batch, kv_heads, qhead_per_kvhead, seqlen_q,
                                                     head_dim)
        return hit

    def mean_visits(self) -> float:
        """Query tiles a KV tile walks, on average over the lists (one device sync, once)."""
        if self._mean_visits is None:
            num, _, fnum, _ = self.tensors[:4]
            self._mean_visits = float((num + fnum).sum()) / max(1, num.numel())
        return self._mean_visits

    def in_q_order(self, num_m_tiles: int) -> "QLists":
        """These lists walked in ascending Q order where a tile lists a partial Q tile after a full one
        (`walk_in_q_order`), built once."""
        hit = self._in_q_order.get(num_m_tiles)
        if hit is None:
            hit = self._in_q_order[num_m_tiles] = QLists(walk_in_q_order(self.tensors, num_m_tiles), self._owners)
        return hit

    def ranks(self, num_m_tiles: int, higher_first: bool = False) -> torch.Tensor:
        hit = self._ranks.get((num_m_tiles, higher_first))
        if hit is None:
            hit = self._ranks[num_m_tiles, higher_first] = visit_ranks(self.tensors, num_m_tiles, higher_first)
        return hit


_Q_LISTS: "OrderedDict[tuple, QLists]" = OrderedDict()


def walk_in_q_order(sparse: tuple, num_m_tiles: int) -> tuple:
    """The lists with every KV tile that lists a partial Q tile after a full one walking all its Q tiles in
    ascending order, as partial ones (mask_mod, or stored bits, on each); the other tiles keep their lists.

    Deterministic mode under a block mask takes dQ turns highest KV tile first, which matches the order in which
    tiles reach a Q tile only if every tile walks its Q tiles in ascending order. A sliding window's tile lists its
    far edge (partial) before its inside (full): it then waited at that edge for the next tile to cross the whole
    window, a chain through the head (4.4x slower). Built without a device sync."""
    num, idx, fnum, fidx = sparse
    dev = num.device
    col = torch.arange(max(idx.shape[-1], fidx.shape[-1], num_m_tiles), device=dev)
    partial = col[: idx.shape[-1]] < num.unsqueeze(-1)
    full = col[: fidx.shape[-1]] < fnum.unsqueeze(-1)
    last_partial = torch.where(partial, idx, -1).amax(-1)
    first_full = torch.where(full, fidx, num_m_tiles).amin(-1)
    mixed = last_partial > first_full  # (Bm, Hm, KV tiles)
    visits = visited_q_tiles(sparse, num_m_tiles)
    ascending = torch.where(visits, col[:num_m_tiles], num_m_tiles).sort(-1).values
    width = max(idx.shape[-1], num_m_tiles)
    own = torch.nn.functional.pad(idx, (0, width - idx.shape[-1]))
    merged = torch.nn.functional.pad(ascending.clamp(max=num_m_tiles - 1), (0, width - num_m_tiles))
    idx = torch.where(mixed.unsqueeze(-1), merged.to(idx.dtype), own).contiguous()
    num_out = torch.where(mixed, num + fnum, num).contiguous()
    return num_out, idx, torch.where(mixed, 0, fnum).contiguous(), fidx


def _cached_q_direction(block_mask: list, block_size: list, cfg: BwdConfig, seqlen_k: int) -> QLists:
    """`q_direction_tensors`, computed once per mask (the version counters catch in-place edits)."""
    key = (tuple((t.data_ptr(), t._version, tuple(t.shape)) if t is not None else None for t in block_mask[4:8]),
           tuple(block_size), cfg.tile_m, cfg.tile_n, seqlen_k)
    hit = _Q_LISTS.get(key)
    if hit is None:
        hit = QLists(q_direction_tensors(block_mask, block_size, cfg, seqlen_k), tuple(block_mask[4:8]))
        _Q_LISTS[key] = hit
        while len(_Q_LISTS) > 16:
            _Q_LISTS.popitem(last=False)
    _Q_LISTS.move_to_end(key)
    return hit


def l2_head_groups(batch: int, kv_heads: int, qhead_per_kvhead: int, seqlen_q: int, head_dim: int) -> list[int]:
    """Bounds of the fewest even groups of (batch, KV head) pairs, batch-major, whose Q, dO (16 bit) and fp32 dQ
    sums fit in `LPT_GROUP_L2_BYTES` together (group g is pairs bounds[g]:bounds[g + 1])."""
    pairs = batch * kv_heads
    per_pair = qhead_per_kvhead * seqlen_q * head_dim * (2 + 2 + 4)
    groups = -(-pairs // max(1, bwd_config.LPT_GROUP_L2_BYTES // per_pair))
    return [round(i * pairs / groups) for i in range(groups + 1)]  # even groups (sizes differ by one at most)


def turn_tile_order(n_kv: int, batch: int, kv_heads: int, qhead_per_kvhead: int, seqlen_q: int, head_dim: int,
                    higher_first: bool, device) -> torch.Tensor:
    """Deterministic mode's CTA order (`lpt_order` there): (batch * kv_heads * n_kv, 3) int32 rows (KV tile, KV head,
    batch). Inside each L2 head group (`l2_head_groups`) the KV tiles go in turn order, lowest first or with
    `higher_first` highest first, and the group's heads take turns at each tile.

    Every CTA then waits only for CTAs launched before it (the lower, or higher, KV tiles of its head), as the
    ordered dQ sums need. With a causal-like block mask, KV tile n reaches Q tile m one step after tile n + 1 did,
    so the highest-first turns arrive in the order the tiles get there; a head's tiles side by side made a chain in
    which every tile waited for the one before it at every Q tile. Heads taking turns inside L2-sized groups keep
    that chain short where it cannot be avoided (dense: every tile visits every Q tile in the same order) while
    Q, dO and the dQ sums of the group stay in L2 (all heads taking turns sent the dQ sums to DRAM)."""
    bounds = l2_head_groups(batch, kv_heads, qhead_per_kvhead, seqlen_q, head_dim)
    tiles = torch.arange(n_kv, device=device)
    if higher_first:
        tiles = tiles.flip(0)
    rows = []
    for lo, hi in zip(bounds, bounds[1:]):
        pair = torch.arange(lo, hi, device=device)
        tile = tiles[:, None].expand(n_kv, hi - lo).reshape(-1)
        pair = pair[None, :].expand(n_kv, hi - lo).reshape(-1)
        rows.append(torch.stack((tile, pair % kv_heads, pair // kv_heads), dim=1))
    return torch.cat(rows).to(torch.int32).contiguous()


def lpt_tile_order(sparse: tuple, batch: int, kv_heads: int, qhead_per_kvhead: int, seqlen_q: int,
                   head_dim: int) -> torch.Tensor:
    """(batch * kv_heads * KV tiles, 3) int32 rows (KV tile, KV head, batch): the CTA order of `lpt_order`.

    A CTA's work is the number of Q tiles its KV tile visits, summed over the query heads of its KV head. The
    (batch, KV head) pairs, batch-major, are cut into the fewest even groups whose Q, dO (16 bit) and fp32 dQ sums
    fit in `LPT_GROUP_L2_BYTES` together; inside a group the KV tiles go longest first, ties in (head, tile) order."""
    num, _, fnum, _ = sparse
    Bm, Hm, n_kv = num.shape
    device = num.device
    visits = (num + fnum).long()  # (Bm, Hm, KV tiles): Q tiles each KV tile walks
    q_heads = kv_heads * qhead_per_kvhead
    b_of, h_of = torch.arange(batch, device=device) % Bm, torch.arange(q_heads, device=device) % Hm
    work = visits[b_of][:, h_of].view(batch, kv_heads, qhead_per_kvhead, n_kv).sum(2)  # (B, Hkv, KV tiles)
    pairs = batch * kv_heads
    bounds = l2_head_groups(batch, kv_heads, qhead_per_kvhead, seqlen_q, head_dim)
    groups = len(bounds) - 1
    group = torch.tensor([g for g in range(groups) for _ in range(bounds[g + 1] - bounds[g])], device=device)
    work = work.reshape(pairs, n_kv)
    # one stable sort: by group, then most work first, then (pair, tile) order
    top = qhead_per_kvhead * seqlen_q + 1  # above any count of Q tiles (read without a device sync)
    key = group[:, None] * top + (top - 1 - work)
    flat = torch.sort(key.reshape(-1), stable=True).indices
    pair, tile = flat // n_kv, flat % n_kv
    return torch.stack((tile, pair % kv_heads, pair // kv_heads), dim=1).to(torch.int32).contiguous()


def visit_ranks(sparse: tuple, num_m_tiles: int, higher_first: bool = False) -> torch.Tensor:
    """(Bm, Hm, KV tiles, Q tiles) int32: for each KV tile visiting a Q tile, how many lower KV tiles (with
    `higher_first`, higher ones) visit it too.

    Deterministic mode reduces dQ partials in this order; KV tiles that skip a Q tile are not waited for."""
    visits = visited_q_tiles(sparse, num_m_tiles).to(torch.int32)
    before = visits.flip(2).cumsum(dim=2).flip(2) if higher_first else visits.cumsum(dim=2)
    return (before - visits).to(torch.int32).contiguous()


def visited_q_tiles(sparse: tuple, num_m_tiles: int) -> torch.Tensor:
    """(Bm, Hm, KV tiles, Q tiles) bool: which Q tiles each KV tile's lists (partial or full) visit."""
    num, idx, fnum, fidx = sparse
    visits = torch.zeros(num.shape + (num_m_tiles + 1,), dtype=torch.bool, device=num.device)
    for count, lists in ((num, idx), (fnum, fidx)):
        listed = torch.arange(lists.shape[-1], device=num.device) < count.unsqueeze(-1)
        visits.scatter_(-1, torch.where(listed, lists.long(), num_m_tiles), True)
    return visits[..., :num_m_tiles]


@lru_cache(maxsize=None)
def with_mask_bits(cfg: BwdConfig) -> BwdConfig:
    """`cfg` reading stored partial-block bits (`BwdConfig.mask_bits`) where its tiles allow, else `cfg` as it is."""
    reading = replace(cfg, mask_bits=True)
    return reading if reading.feasibility_error() is None else cfg


def stored_bits(entry, masks: QLists, cfg: BwdConfig, batch: int, heads: int, seqlen_q: int, seqlen_k: int):
    """The partial-block bits of `masks` for this kernel's tiles (rows = keys, `runtime.mask_bits.StoredBits`: the
    words and the partial lists less their empty blocks), or None where the mods store none
    (`ModEntry.stored_masks`), the tiles are not ones the layout covers, or they are too large."""
    store = getattr(entry, "stored_masks", None)
    if store is None or not with_mask_bits(cfg).mask_bits:
        return None
    num, idx = masks.tensors[0], masks.tensors[1]
    return store.bits(masks, num, idx, batch, heads, False, cfg.tile_n, seqlen_k, seqlen_q, tile_cols=cfg.tile_m)


def config_for(head_dim: int, deterministic: bool, g, aux_grads: bool, q_block: int | None = None) -> BwdConfig:
    """The configuration this call runs: `g` the generated mods (or None), `aux_grads` whether captured tensors get
    gradients, `q_block` the block mask's Q block size (None without a mask)."""
    mod_grads = bool(g is not None and g.has_score_mod and (aux_grads or not g.score_grad_is_identity))
    mask_ops = g.mask_op_count if g is not None and q_block is not None else 0  # no block mask: no mask_mod runs
    return _config(head_dim, deterministic, mod_grads, q_block, mask_ops)


def mask_gathers(g) -> bool:
    """Whether the generated mods' mask_mod reads captured tensors (`bwd_config.drop_gathering_kind_loops`)."""
    return bool(g is not None and g.has_mask_mod and g.aux_tensor_names)


@lru_cache(maxsize=None)
def _config(head_dim: int, deterministic: bool, mod_grads: bool, q_block: int | None, mask_ops: int = 0) -> BwdConfig:
    try:
        return default_bwd_config(head_dim, deterministic, mod_grads, q_block, mask_ops).validate()
    except ValueError as e:
        raise BackendUnavailableError(f"backend='cute' backward: {e}") from None


@dataclass(frozen=True)
class Kernels:
    """The three compiled kernels of one configuration and what the launch needs to know about them."""

    pre: Any
    main: Any
    post: Any
    grad_dtype: torch.dtype  # captured-tensor gradient buffers: fp32, or int64 fixed point (deterministic)


_KERNELS: dict[tuple, Kernels] = {}


def has_captured_grads(g, grad_slots) -> bool:
    """Whether the kernel computes gradients of captured tensors: some require grad and a score_mod reads them (a
    mask has no gradient)."""
    return bool(grad_slots) and g is not None and g.has_score_mod


def main_key(g, kernel_aux, grad_slots, dtype_name: str, cfg: BwdConfig, sparse: bool, deterministic: bool,
             arch: str = "sm_90a") -> BwdKey:
    """The main kernel's key for generated mods `g` (or None), the captured tensors as the kernel reads them
    (`kernel_aux`) and the slots among them that get gradients."""
    has_aux_grad = has_captured_grads(g, grad_slots)
    return BwdKey(g.hash if g is not None else "", bool(g is not None and g.has_score_mod),
                  bool(g is not None and g.has_mask_mod and sparse), has_aux_grad,
                  tuple((str(t.dtype).removeprefix("torch."), t.dim()) for t in kernel_aux),
                  tuple("float" if kind == "float" else "int" for kind in (g.aux_scalar_kinds if g else ())),
                  tuple(kernel_aux[i].dim() for i in grad_slots), dtype_name, cfg, sparse, deterministic, arch,
                  bool(deterministic and has_aux_grad), g.source_hash if g is not None else "",
                  bool(g is not None and g.score_grad_is_identity),
                  bool(g is None or not has_aux_grad or g.aux_grad_reads_score))


def _kernels(g, grad_slots, kernel_aux, dtype: torch.dtype, cfg: BwdConfig, sparse: bool, has_dlse: bool,
             deterministic: bool, arch: str) -> Kernels:
    """Compiled kernels for this call; one dict lookup once warm. Everything in the fast key's place is fixed by
    the generated code's hash (mod structure, captured-tensor dtypes/ranks, which of them require grad)."""
    fast = (g.hash if g is not None else "", dtype, cfg, sparse, has_dlse, deterministic, arch)
    hit = _KERNELS.get(fast)
    if hit is not None:
        return hit
    name, D = _DTYPES[dtype], cfg.head_dim
    key = main_key(g, kernel_aux, grad_slots, name, cfg, sparse, deterministic, arch)
    fixed_point = key.fixed_point_aux_grads
    from .bwd_aux_grad import accumulates_through_add_aux_grad  # (cutlass: loaded only once kernels are needed)
    if fixed_point and not accumulates_through_add_aux_grad(g.module()):
        raise BackendUnavailableError(
            "deterministic=True with captured tensors that require grad needs generated code that accumulates through "
            "flexlab.kernels.bwd_aux_grad.add_aux_grad (this code generator emits plain fp32 atomics); use "
            "backend='reference' or turn determinism off")
    hit = Kernels(preprocess_kernel(name, D, has_dlse, arch, cfg.chained_launch), main_kernel(key, g),
                  postprocess_kernel(name, D, arch, cfg.dq_layout, cfg.chained_launch),
                  torch.int64 if fixed_point else torch.float32)
    _KERNELS[fast] = hit
    return hit


def backward_kernels(g, grad_slots, dtype: torch.dtype, head_dim: int, q_block: int | None = None,
                     has_dlse: bool = False, deterministic: bool = False, arch: str = "sm_90a",
                     mask_bits: bool = False, persistent_ctas: int = 0, cut_last_wave: bool = False) -> Kernels:
    """The compiled kernels a backward call with the generated mods `g` (None: none) would run, without running them
    (precompilation): `grad_slots` the captured tensors that require grad, `q_block` the block mask's Q block size
    (None without a mask), `mask_bits` whether the mods store partial-block bits (`ModEntry.stored_masks`; used where
    the tiles allow, as `stored_bits` decides), `persistent_ctas` the SM count where the call's KV tiles are short
    (`bwd_config.runs_persistent`), else 0; `cut_last_wave` for a dense grid whose last wave is cut
    (`bwd_config.split_parts`): the whole tiles' kernels are returned and the parts' kernel built beside them."""
    cfg = config_for(head_dim, deterministic, g, bool(grad_slots), q_block)
    if mask_bits and q_block is not None:
        cfg = with_mask_bits(cfg)
    cfg = bwd_config.drop_gathering_kind_loops(cfg, mask_gathers(g))
    if persistent_ctas:
        cfg = replace(cfg, persistent_ctas=persistent_ctas)
    kernel_aux = tuple(g.kernel_aux_tensors()) if g is not None else ()
    if cut_last_wave:
        cfg, parts_cfg = cut_configs(cfg)
        _kernels(g, grad_slots, kernel_aux, dtype, parts_cfg, False, has_dlse, deterministic, arch)
    return _kernels(g, grad_slots, kernel_aux, dtype, cfg, q_block is not None, has_dlse, deterministic, arch)


@dataclass(frozen=True, eq=False)
class _Plan:
    """Everything a backward call of one signature works out before its launches: the configuration, the kernels,
    the padded length, the block lists the kernel walks (with stored bits, the CTA order and deterministic ranks)."""

    kernels: Kernels
    cfg: BwdConfig
    sq_pad: int
    sparse: tuple | None
    rank: torch.Tensor | None
    tile_order: torch.Tensor | None
    # a cut last wave: (whole tiles, parts per cut tile, arrival counters, partial floats, the parts' kernel)
    tail: tuple | None
    holds: tuple  # the objects whose ids key this plan, kept alive with it


_PLANS: "OrderedDict[tuple, _Plan]" = OrderedDict()
_PLANS_KEPT = 32


def forget_plans() -> None:
    """Drop every memoised backward configuration and plan (compiled kernels stay cached; the source fingerprint
    stays): what a policy knob of `kernels.bwd_config` changed at run time needs before the next call sees it. The
    Q-direction lists go too (their CTA orders are keyed by `LPT_GROUP_L2_BYTES` as well)."""
    clear_memos(globals(), __name__, frozenset({"bwd_fingerprint"}))
    _PLANS.clear()
    _Q_LISTS.clear()


def _plan(q, k, entry, block_mask, block_size, deterministic: bool, has_dlse: bool, arch: str) -> _Plan:
    """The cached `_Plan` of a call: keyed by the generated mods, shapes, dtype, mode and the block-mask tensors (by
    identity and in-place version), and, where partial blocks are read as stored bits, the versions of the captured
    tensors the mask reads (the bits follow their values). A learnable bias edited in place every step keeps its
    plan: the kernel reads it in place (`GeneratedMods.kernel_aux_tensors`, refreshed per call)."""
    g = entry.generated
    store = getattr(entry, "stored_masks", None)
    # the configuration by identity (`_config` memoises it; a sweep that swaps it gets a new plan)
    cfg = config_for(q.shape[3], deterministic, g, bool(entry.grad_slots), int(block_size[0]) if block_mask else None)
    key = (id(cfg), g, q.dtype, q.shape, k.shape, deterministic, has_dlse, arch,
           tuple(None if t is None else (id(t), t._version) for t in block_mask or ()), tuple(block_size or ()),
           tuple(t._version for t in store.watch) if store is not None and block_mask else ())
    hit = _PLANS.get(key)
    if hit is not None:
        _PLANS.move_to_end(key)
        return hit
    hit = _build_plan(q, k, entry, cfg, block_mask, block_size, deterministic, has_dlse, arch)
    _PLANS[key] = hit
    while len(_PLANS) > _PLANS_KEPT:
        _PLANS.popitem(last=False)
    return hit


def _build_plan(q, k, entry, cfg: BwdConfig, block_mask, block_size, deterministic: bool, has_dlse: bool,
                arch: str) -> _Plan:
    B, Hq, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    g = entry.generated
    keyed_cfg = cfg  # the object whose id keys this plan (`cfg` is replaced below): held with the plan
    dev = q.device
    kernel_aux = tuple(g.kernel_aux_tensors()) if g is not None else ()  # row-major, as bwd_sm90 compiled them
    for i, t in enumerate(kernel_aux):
        if t.device != dev:
            raise BackendUnavailableError(f"captured tensor '{g.aux_tensor_names[i]}' is on {t.device} but the inputs "
                                          f"are on {dev}; move it with .to({str(dev)!r}) before building the mods")
    masks = walk = bits = tile_order = None
    if not block_mask and cfg.lpt_order and not deterministic:  # (without block lists all tiles are alike)
        cfg = replace(cfg, lpt_order=False)
    if cfg.kind_loops and not (block_mask and g is not None and g.has_mask_mod):  # (one kind of step: one loop)
        cfg = replace(cfg, kind_loops=False)
    turns = deterministic and cfg.lpt_order  # the launcher's turn order (`turn_tile_order`)
    # listed Q tiles may run past Sq up to a mask block
    pad = math.lcm(cfg.tile_m, int(block_size[0])) if block_mask else cfg.tile_m
    sq_pad = -(-Sq // pad) * pad
    if block_mask:
        masks = walk = _cached_q_direction(block_mask, block_size, cfg, Skv)
        if turns:  # higher KV tiles take their dQ turns first: every tile walks its Q tiles in ascending order
            masks = walk = masks.in_q_order(sq_pad // cfg.tile_m)
        bits = stored_bits(entry, masks, cfg, B, Hq, Sq, Skv)
        if bits is not None:
            cfg = with_mask_bits(cfg)
            if bits.pruned:  # the kernel walks the lists less their empty blocks (deterministic ranks from those)
                walk = bits.derived(lambda: QLists((bits.num, bits.idx) + masks.tensors[2:], masks._owners))
        cfg = bwd_config.drop_gathering_kind_loops(cfg, mask_gathers(g))
        if cfg.lpt_order and not deterministic:  # (work estimated from the mask's own lists, as measured)
            tile_order = masks.tile_order(B, Hkv, Hq // Hkv, Sq, D)
    if turns:  # under a block mask the higher KV tiles first
        tile_order = turn_tile_order(-(-Skv // cfg.tile_n), B, Hkv, Hq // Hkv, Sq, D, walk is not None, dev)
    def mean_steps():  # query tiles a KV tile walks, summed over its GQA group (a mask's lists: read once)
        return (walk.mean_visits() if walk is not None else -(-Sq // cfg.tile_m)) * (Hq // Hkv)
    if dev.type == "cuda" and bwd_config.runs_persistent(cfg, mean_steps, deterministic,
                                                         has_captured_grads(g, entry.grad_slots)):
        cfg = replace(cfg, persistent_ctas=_sm_count(dev))
    tail = None
    workers = _cut_workers(dev)
    if workers and cfg.split_last_wave and walk is None and not cfg.persistent and not deterministic:
        # dense tiles all walk the same steps: cut the last wave where that pays (`bwd_config.split_parts`)
        num_tiles = B * Hkv * -(-Skv // cfg.tile_n)
        parts = bwd_config.split_parts(num_tiles, workers, int(mean_steps()))
        if parts > 1:
            cut = num_tiles % workers
            cfg, parts_cfg = cut_configs(cfg)
            parts_kernel = _kernels(g, entry.grad_slots, kernel_aux, q.dtype, parts_cfg, False, has_dlse,
                                    deterministic, arch).main
            tail = (num_tiles - cut, parts, cut, cut * parts * 2 * cfg.tile_n * cfg.head_dim, parts_kernel)
    kernels = _kernels(g, entry.grad_slots, kernel_aux, q.dtype, cfg, masks is not None, has_dlse, deterministic,
                       arch)
    rank = walk.ranks(sq_pad // cfg.tile_m, turns) if deterministic and walk is not None else None
    sparse = None if walk is None else walk.tensors if bits is None else walk.tensors + (bits.words,)
    return _Plan(kernels, cfg, sq_pad, sparse, rank, tile_order, tail,
                 (keyed_cfg, g, entry, *(block_mask or ()), walk, bits))


def cut_configs(cfg: BwdConfig) -> tuple[BwdConfig, BwdConfig]:
    """A cut last wave's two kernels: (the whole tiles', the parts')."""
    return replace(cfg, whole_tiles_only=True), replace(cfg, split_tail=True)


def _cut_workers(dev: torch.device) -> int:
    """CTAs of one-tile-per-CTA backward kernels that run at once on `dev` (one per SM), or 0 where no wave is cut."""
    return _sm_count(dev) if dev.type == "cuda" else 0


def backward(dout, q, k, v, out, lse, dlse, entry, aux_tensors, block_mask, block_size, scale: float,
             aux_scalars, deterministic: bool, arch: str = "sm_90a"):
    """(dq, dk, dv, grads of `entry.grad_slots` in fp32). Inputs come from the autograd formula (validated).

    Every tensor below is built in exactly the layout its kernel was compiled for (`fake_arguments` of each kernel
    module): unit stride on the last mode, TMA-legal strides and 16-byte base for the (B, H, S, D) tensors. What
    depends only on the call's signature is planned once (`_plan`); a repeated call allocates and launches."""
    if q.dtype not in _DTYPES:
        raise BackendUnavailableError(f"backend='cute' backward supports bfloat16/float16, got {q.dtype}")
    deterministic = bool(deterministic)
    plan = _plan(q, k, entry, block_mask, block_size, deterministic, dlse is not None, arch)
    kernels, cfg, sq_pad = plan.kernels, plan.cfg, plan.sq_pad
    B, Hq, _, D = q.shape
    dev = q.device
    g = entry.generated
    kernel_aux = g.kernel_aux_tensors() if g is not None else ()  # (re-read: captured values may have changed)

    q, k, v, dout, out = (tma_ready(t) for t in (q, k, v, dout, out))
    lse2 = torch.empty((B, Hq, sq_pad), dtype=torch.float32, device=dev)
    dpsum = torch.empty((B, Hq, sq_pad), dtype=torch.float32, device=dev)
    dq_accum = torch.empty((B, Hq, sq_pad, D), dtype=torch.float32, device=dev)  # zeroed by the preprocess
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if poison.ENABLED:
        poison.fill(lse2, dpsum, dq_accum, dq, dk, dv)
    grads = tuple(torch.zeros(kernel_aux[i].shape, dtype=kernels.grad_dtype, device=dev) for i in entry.grad_slots)
    sem = None
    if deterministic:
        sem = torch.zeros((B, Hq, sq_pad // cfg.tile_m, cfg.num_consumer_wgs), dtype=torch.int32, device=dev)
    scalars = g.kernel_aux_scalar_values(aux_scalars) if g is not None else ()
    whole = tail_space = None
    if plan.tail is not None:  # the whole tiles' kernel stops at the cut ones
        whole_tiles, parts, cut, floats, parts_kernel = plan.tail
        whole = (whole_tiles,)
        tail_space = (whole_tiles, parts) + split_tail_buffers(dev, cut, floats)
    # (scheduling buffers before the first launch: under CUDA-graph capture their zeroing is a node of the graph, which
    # must not sit between two chained kernels)
    counter = tile_counter(dev) if cfg.persistent else None

    # Argument order = the kernels' __call__ signatures; None for an input compiled as absent.
    kernels.pre(out, dout, lse.contiguous(), dlse.contiguous() if dlse is not None else None, dpsum, lse2, dq_accum)
    kernels.main(q, k, v, dout, lse2, dpsum, dq_accum, dk, dv, scale, Hq // k.shape[1], plan.sparse, kernel_aux,
                 scalars, grads, sem, plan.rank, plan.tile_order, counter, whole)
    if plan.tail is not None:  # then the cut tiles' parts (one fp32 dK and dV tile of workspace per part)
        parts_kernel(q, k, v, dout, lse2, dpsum, dq_accum, dk, dv, scale, Hq // k.shape[1], None, kernel_aux, scalars,
                     grads, None, None, None, None, tail_space)
    kernels.post(dq_accum, dq, scale)
    if kernels.grad_dtype == torch.int64:
        from .bwd_aux_grad import from_fixed_point
        grads = [from_fixed_point(b) for b in grads]
    # The kernel sees a 0-d captured tensor as (1,); hand the gradient back in the captured tensor's own shape.
    return dq, dk, dv, [grad.view(aux_tensors[slot].shape) for grad, slot in zip(grads, entry.grad_slots)]
