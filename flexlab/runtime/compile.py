"""Compile the forward kernel once per configuration; keep it in memory and on disk.

A `CompileKey` names everything that is baked into the machine code: the generated mod source (by hash), the tile
config, dtype, head dim, arch, cutlass version, the DSL's code-generation settings, a fingerprint of the kernel
sources and which optional inputs exist. Captured scalars and tensors are runtime arguments, so new values never
recompile. The memory and disk store is `disk_cache.KernelCache`, shared with the backward kernels: on disk an entry
is the exported object file plus its SHA-256; an entry whose bytes do not match, or that fails to load, is deleted
and rebuilt, never trusted.
"""
from __future__ import annotations

import importlib.util
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable, Optional

from ..kernels.config import FwdConfig
from .disk_cache import CacheStats, cache_dir, cutlass_version  # noqa: F401  (re-exported, as before the store moved)
from .disk_cache import KernelCache, StampedKey, source_fingerprint
from .ptxas import assemble


@dataclass(frozen=True)
class KernelMods:
    """The generated element-wise mods and the kinds of their runtime arguments (not their values)."""

    score_mod: Optional[Callable] = None
    mask_mod: Optional[Callable] = None
    source_hash: str = ""  # hash of the generated source; "" when there are no mods
    aux_tensor_specs: tuple = ()  # ((torch dtype name, ndim), ...)
    aux_scalar_kinds: tuple = ()  # ("int" | "float", ...)


@dataclass(frozen=True)
class CompileKey(StampedKey):
    source_hash: str
    has_score_mod: bool
    has_mask_mod: bool
    aux_tensor_specs: tuple
    aux_scalar_kinds: tuple
    dtype: str  # "bfloat16" | "float16"
    config: FwdConfig
    arch: str
    block_sparse: bool
    tile_order: bool
    writes_lse: bool = True  # False: an inference kernel whose caller does not want the LSE
    tvm_ffi: bool = field(default_factory=lambda: tvm_ffi_available())
    kernel_source: str = field(default_factory=lambda: kernel_fingerprint())  # a kernel edit invalidates disk entries

    @property
    def on_disk(self) -> bool:
        return self.tvm_ffi  # only TVM-FFI builds can be exported and loaded back


@lru_cache(maxsize=None)
def kernel_fingerprint() -> str:
    """Fingerprint of the forward kernel's source files (`fwd_sm90` and every kernel module it imports) and of this
    module (which builds the fake arguments)."""
    return source_fingerprint(("fwd_sm90",), extra_files=(Path(__file__).resolve(),))


@lru_cache(maxsize=None)
def tvm_ffi_available() -> bool:
    return importlib.util.find_spec("tvm_ffi") is not None


# ---------------------------------------------------------------------------------------------------- fake arguments
def _cutlass_dtype(name: str):
    import cutlass
    return {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float32": cutlass.Float32,
            "float64": cutlass.Float64, "int32": cutlass.Int32, "int64": cutlass.Int64, "int16": cutlass.Int16,
            "int8": cutlass.Int8, "uint8": cutlass.Uint8, "bool": cutlass.Boolean}[name]


def fake_arguments(key: CompileKey):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

    hd = key.config.head_dim
    dt = _cutlass_dtype(key.dtype)

    def qkv():  # (B, H, S, D): any strides that TMA accepts (16-byte multiples), unit stride on D
        shape = (cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), hd)
        stride = (cute.sym_int64(divisibility=8), cute.sym_int64(divisibility=8), cute.sym_int64(divisibility=8), 1)
        return make_fake_tensor(dt, shape, stride, assumed_align=16)

    def compact(dtype, rank, align=4):
        return make_fake_compact_tensor(dtype, tuple(cute.sym_int32() for _ in range(rank)),
                                        stride_order=tuple(range(rank - 1, -1, -1)), assumed_align=align)

    sparse = None
    if key.block_sparse:
        sparse = (compact(cutlass.Int32, 3), compact(cutlass.Int32, 4), compact(cutlass.Int32, 3),
                  compact(cutlass.Int32, 4))
        if key.config.mask_bits:  # (B, H, Q tiles, partial blocks, tile_m rows, 4 words): `runtime.mask_bits`
            shape = (*(cute.sym_int32() for _ in range(4)), key.config.tile_m, 4)
            sparse += (make_fake_compact_tensor(cutlass.Int32, shape, stride_order=(5, 4, 3, 2, 1, 0),
                                                assumed_align=16),)
    order = compact(cutlass.Int32, 1) if key.tile_order else None
    workspace = None  # `runtime.launch.scheduler_workspace`
    if key.config.dynamic_tiles:
        workspace = compact(cutlass.Int32, 1)
    elif key.config.split_tail:
        workspace = (compact(cutlass.Int32, 1), compact(cutlass.Float32, 1, align=16))
    aux_tensors = tuple(fake_captured_tensor(name, ndim, unit_stride_any_rank=False)
                        for name, ndim in key.aux_tensor_specs)
    aux_scalars = tuple(cutlass.Int32(0) if kind == "int" else cutlass.Float32(0.0) for kind in key.aux_scalar_kinds)
    lse = compact(cutlass.Float32, 3) if key.writes_lse else None
    return (qkv(), qkv(), qkv(), qkv(), lse, cutlass.Float32(1.0), cutlass.Int32(1),
            cutlass.Int32(1), sparse, order, workspace, aux_tensors, aux_scalars,
            make_fake_stream(use_tvm_ffi_env_stream=key.tvm_ffi))


def fake_captured_tensor(dtype_name: str, ndim: int, unit_stride_any_rank: bool = True):
    """A captured tensor as a kernel reads it: row-major with a static unit stride on the last mode (launches pass
    `GeneratedMods.kernel_aux_tensors`, which are contiguous), aligned to its element size (a contiguous slice of a
    larger tensor may start anywhere). The static stride makes a gather at a 1-D table (document ids, per-head
    slopes) a single multiply-add from the base address instead of a 64-bit multiply by a runtime stride: the
    forward's partial-block step of a document mask drops from 978 to 863 SASS instructions. With
    `unit_stride_any_rank=False` tensors of rank >= 2 keep every stride dynamic: in the forward their gathers
    compiled to more register moves with the static stride than without (per-head key bias +30 instructions per
    step), while the backward was measured with it."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor
    dtype = _cutlass_dtype(dtype_name)
    shape = tuple(cute.sym_int32() for _ in range(ndim))
    if ndim >= 2 and not unit_stride_any_rank:
        return make_fake_tensor(dtype, shape, tuple(cute.sym_int64() for _ in range(ndim)))
    return make_fake_tensor(dtype, shape, tuple(cute.sym_int64() for _ in range(ndim - 1)) + (1,),
                            assumed_align=dtype.width // 8)


def dsl_compile(fn, *args, options: str):
    """`cute.compile`, minus two DSL warnings that say nothing about flexlab's kernels: a tuple argument is not a
    JitArgument (captured tensors and scalars travel as tuples on purpose: traced, one runtime argument each), and a
    static loop of many iterations may compile slowly (the per-register loops over an accumulator are unrolled on
    purpose)."""
    import cutlass.cute as cute
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*cannot be converted to a JitArgument.*")
        warnings.filterwarnings("ignore", message="This static loop has .* iterations")
        return cute.compile(fn, *args, options=options)


def _build(key: CompileKey, mods: KernelMods, extra_options: str = ""):
    from ..kernels.fwd_sm90 import FlexFwdSm90

    kernel = FlexFwdSm90(key.config, _cutlass_dtype(key.dtype), mods.score_mod, mods.mask_mod,
                         has_aux_tensors=bool(key.aux_tensor_specs))
    options = f"--gpu-arch {key.arch}" + (" --enable-tvm-ffi" if key.tvm_ffi else "") + extra_options
    return dsl_compile(kernel, *fake_arguments(key), options=options)


# ---------------------------------------------------------------------------------------------------- the cache
_CACHE = KernelCache()


def kernel_cache() -> KernelCache:
    """The forward kernels' cache (the backward's is `kernels.bwd_launch.bwd_kernel_cache()`, same directory)."""
    return _CACHE


def forward_kernel(key: CompileKey, mods: KernelMods, cache: KernelCache | None = None):
    """The compiled forward kernel for `key`: from memory, else from disk, else compiled from `mods` and stored."""
    return (cache or kernel_cache()).get(key, lambda: _build(key, mods))


# ---------------------------------------------------------------------------------------------------- compile report
@dataclass(frozen=True)
class CompileReport:
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    has_wgmma: bool
    has_tma: bool
    ptx_lines: int
    compile_seconds: float


def forward_ptx(key: CompileKey, mods: KernelMods = KernelMods()) -> str:
    """PTX text of the forward kernel for `key`, compiled without a GPU (TVM-FFI off: PTX, not a shared object)."""
    import dataclasses
    key = dataclasses.replace(key, tvm_ffi=False)
    with tempfile.TemporaryDirectory(prefix="flexlab-ptx-") as dump:
        compiled = _build(key, mods, extra_options=f" --keep-ptx --dump-dir {dump}")
    ptx = getattr(compiled, "__ptx__", None)
    if not ptx:
        raise RuntimeError("the compiled kernel carries no PTX text (--keep-ptx had no effect)")
    return ptx


def compile_report(key: CompileKey, mods: KernelMods = KernelMods()) -> CompileReport:
    """Compile to PTX (no GPU needed), assemble it with the system ptxas, and report registers/spills/instructions."""
    t0 = time.perf_counter()
    ptx = forward_ptx(key, mods)
    seconds = time.perf_counter() - t0
    info, _ = assemble(ptx, key.arch)
    return CompileReport(info["registers"], info.get("spill_store_bytes", 0), info.get("spill_load_bytes", 0),
                         "wgmma.mma_async" in ptx, "cp.async.bulk.tensor" in ptx, ptx.count("\n"), seconds)
