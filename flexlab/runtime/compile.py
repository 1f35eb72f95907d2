"""Compile the forward kernel once per configuration; keep it in memory and on disk.

A `CompileKey` names everything that is baked into the machine code: the generated mod source (by hash), the tile
config, dtype, head dim, arch, cutlass version and which optional inputs exist. Captured scalars and tensors are
runtime arguments, so new values never recompile. On disk an entry is the exported object file plus its SHA-256;
an entry whose bytes do not match, or that fails to load, is deleted and rebuilt, never trusted.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Optional

from ..kernels.config import FwdConfig

EXPORTED_NAME = "flexlab_fwd"


@dataclass(frozen=True)
class KernelMods:
    """The generated element-wise mods and the kinds of their runtime arguments (not their values)."""

    score_mod: Optional[Callable] = None
    mask_mod: Optional[Callable] = None
    source_hash: str = ""  # hash of the generated source; "" when there are no mods
    aux_tensor_specs: tuple = ()  # ((torch dtype name, ndim), ...)
    aux_scalar_kinds: tuple = ()  # ("int" | "float", ...)


@dataclass(frozen=True)
class CompileKey:
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
    cutlass_version: str = field(default_factory=lambda: cutlass_version())
    tvm_ffi: bool = field(default_factory=lambda: tvm_ffi_available())
    kernel_source: str = field(default_factory=lambda: kernel_fingerprint())  # a kernel edit invalidates disk entries

    def digest(self) -> str:
        return hashlib.sha256(repr(self).encode()).hexdigest()[:32]


@lru_cache(maxsize=None)
def cutlass_version() -> str:
    try:
        return importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


_KERNEL_FILES = ("fwd_sm90.py", "softmax.py", "mask.py", "score_mod.py", "block_sparse.py", "layout.py",
                 "tile_scheduler.py", "carry.py", "config.py", "named_barrier.py")


@lru_cache(maxsize=None)
def kernel_fingerprint() -> str:
    """sha256 of the forward kernel's source files and of this module (which builds the fake arguments)."""
    h = hashlib.sha256()
    kernels = Path(__file__).resolve().parent.parent / "kernels"
    for path in [kernels / name for name in _KERNEL_FILES] + [Path(__file__).resolve()]:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


@lru_cache(maxsize=None)
def tvm_ffi_available() -> bool:
    return importlib.util.find_spec("tvm_ffi") is not None


def cache_dir() -> Path:
    root = os.environ.get("FLEXLAB_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "flexlab")
    return Path(root) / "kernels"


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
    order = compact(cutlass.Int32, 1) if key.tile_order else None
    aux_tensors = tuple(
        make_fake_tensor(_cutlass_dtype(name), tuple(cute.sym_int32() for _ in range(ndim)),
                         tuple(cute.sym_int64() for _ in range(ndim)))
        for name, ndim in key.aux_tensor_specs)
    aux_scalars = tuple(cutlass.Int32(0) if kind == "int" else cutlass.Float32(0.0) for kind in key.aux_scalar_kinds)
    return (qkv(), qkv(), qkv(), qkv(), compact(cutlass.Float32, 3), cutlass.Float32(1.0), cutlass.Int32(1),
            cutlass.Int32(1), sparse, order, aux_tensors, aux_scalars, make_fake_stream(use_tvm_ffi_env_stream=key.tvm_ffi))


def _build(key: CompileKey, mods: KernelMods, extra_options: str = ""):
    import cutlass.cute as cute

    from ..kernels.fwd_sm90 import FlexFwdSm90

    kernel = FlexFwdSm90(key.config, _cutlass_dtype(key.dtype), mods.score_mod, mods.mask_mod,
                         has_aux_tensors=bool(key.aux_tensor_specs))
    options = f"--gpu-arch {key.arch}" + (" --enable-tvm-ffi" if key.tvm_ffi else "") + extra_options
    return cute.compile(kernel, *fake_arguments(key), options=options)


# ---------------------------------------------------------------------------------------------------- the cache
@dataclass
class CacheStats:
    memory_hits: int = 0
    disk_hits: int = 0
    compiles: int = 0
    rebuilt_corrupt: int = 0
    compile_seconds: float = 0.0


class KernelCache:
    """In-memory dict in front of an on-disk store of exported object files (TVM-FFI builds only)."""

    def __init__(self, directory: Path | None = None):
        self.directory = directory
        self.memory: dict[CompileKey, Any] = {}
        self.stats = CacheStats()
        self._lock = threading.Lock()

    def _dir(self) -> Path:
        return self.directory or cache_dir()

    def get(self, key: CompileKey, mods: KernelMods):
        fn = self.memory.get(key)
        if fn is not None:
            self.stats.memory_hits += 1
            return fn
        with self._lock:
            fn = self.memory.get(key)
            if fn is None:
                fn = self._load(key) if key.tvm_ffi else None
                if fn is None:
                    fn = self._compile_and_store(key, mods)
                self.memory[key] = fn
        return fn

    def _paths(self, key: CompileKey) -> tuple[Path, Path]:
        base = self._dir() / key.digest()
        return base.with_suffix(".o"), base.with_suffix(".sha256")

    def _load(self, key: CompileKey):
        obj, digest = self._paths(key)
        if not obj.exists():
            return None
        try:
            data = obj.read_bytes()
            if not digest.exists() or hashlib.sha256(data).hexdigest() != digest.read_text().strip():
                raise ValueError("checksum mismatch")
            import cutlass.cute as cute
            fn = getattr(cute.runtime.load_module(str(obj), enable_tvm_ffi=True), EXPORTED_NAME)
            self.stats.disk_hits += 1
            return fn
        except Exception:
            self.stats.rebuilt_corrupt += 1
            for p in (obj, digest):
                p.unlink(missing_ok=True)
            return None

    def _compile_and_store(self, key: CompileKey, mods: KernelMods):
        t0 = time.perf_counter()
        fn = _build(key, mods)
        self.stats.compiles += 1
        self.stats.compile_seconds += time.perf_counter() - t0
        if key.tvm_ffi:
            try:
                self._store(key, fn)
            except OSError:
                pass  # a read-only or full disk only costs a recompile next session
        return fn

    def _store(self, key: CompileKey, fn) -> None:
        obj, digest = self._paths(key)
        obj.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=obj.parent) as tmp:
            tmp_obj = Path(tmp) / "k.o"
            fn.export_to_c(str(tmp_obj), function_name=EXPORTED_NAME)
            data = tmp_obj.read_bytes()
            tmp_digest = Path(tmp) / "k.sha256"
            tmp_digest.write_text(hashlib.sha256(data).hexdigest())
            os.replace(tmp_digest, digest)  # checksum first: a crash between the two leaves no trusted object
            os.replace(tmp_obj, obj)


_CACHE = KernelCache()


def kernel_cache() -> KernelCache:
    return _CACHE


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
    import warnings
    key = dataclasses.replace(key, tvm_ffi=False)
    with warnings.catch_warnings(), tempfile.TemporaryDirectory(prefix="flexlab-ptx-") as dump:
        warnings.filterwarnings("ignore", message=".*cannot be converted to a JitArgument.*")
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
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        res = subprocess.run(["ptxas", f"-arch={key.arch}", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")],
                             capture_output=True, text=True, check=True)
    info = res.stdout + res.stderr
    regs = int(re.search(r"Used (\d+) registers", info).group(1))
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    return CompileReport(regs, int(spills.group(1)), int(spills.group(2)), "wgmma.mma_async" in ptx,
                         "cp.async.bulk.tensor" in ptx, ptx.count("\n"), seconds)
