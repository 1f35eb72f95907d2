"""One compile cache for every flexlab kernel: an in-memory dict in front of a store of exported object files.

The forward (`runtime.compile`) and the three backward kernels (`kernels.bwd_launch`) each key their compiled
functions with a frozen dataclass that names everything baked into the machine code, including the cutlass version,
the DSL settings that change code generation, and a fingerprint of the kernel source files (`source_fingerprint`),
so editing a kernel file invalidates its entries. Every key derives from `StampedKey`, which adds the toolchain fields
and `digest()` (a hash of the repr, so the key class is part of it and different kinds of kernel never share an
entry); `on_disk` says whether entries may be stored (only TVM-FFI builds can be exported).

On disk an entry is `<digest>.o`, the object written by `export_to_c`, plus `<digest>.sha256`, its checksum; both are
written to a temporary name and renamed into place, checksum first, so a crash or a concurrent writer never leaves an
object that a checksum vouches for by accident. An entry whose bytes do not match its checksum, or that fails to
load, is deleted and rebuilt, never trusted. Nothing here runs on a warm call: callers keep their own dict of
compiled functions in front of `KernelCache.get`.
"""
from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import os
import re
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable

_PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # .../flexlab


def cache_dir() -> Path:
    """Where compiled kernels are stored: `$FLEXLAB_CACHE_DIR/kernels`, by default `~/.cache/flexlab/kernels`.

    Read on every disk access, so setting the variable takes effect for the next kernel that is not in memory."""
    root = os.environ.get("FLEXLAB_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "flexlab")
    return Path(root) / "kernels"


@lru_cache(maxsize=None)
def cutlass_version() -> str:
    try:
        return importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@lru_cache(maxsize=None)
def dsl_settings() -> str:
    """The CuTeDSL environment settings that change generated code (`CUTE_DSL_LINEINFO`, `..._ENABLE_ASSERTIONS`,
    `..._COMPILER_OPT`, ...), as the DSL itself renders them for its own JIT cache key. The DSL reads them once, at
    import. Left out: the detected arch (flexlab always passes `--gpu-arch`, and keys carry the arch) and the path of
    the DSL's runtime library (an install location, not a code-generation choice)."""
    try:
        from cutlass.cutlass_dsl import CuTeDSL
        rendered = CuTeDSL._get_dsl().envar.cache_key_str()
    except Exception:  # noqa: BLE001  (an unknown DSL layout only makes entries less shareable, never wrong)
        return "unknown"
    return re.sub(r"(?:^|(?<=;))(?:arch|shared_libs)=(?:'[^']*'|None);", "", rendered)


def key_digest(key: Any) -> str:
    """32 hex digits of sha256 over the key's repr: every field, and the key's class name."""
    return hashlib.sha256(repr(key).encode()).hexdigest()[:32]


@dataclass(frozen=True, kw_only=True)
class StampedKey:
    """Base of every cached kernel's key: the toolchain that built it (cutlass-dsl version and the settings that change
    its code generation), after the fields a subclass specialises on. `digest()` hashes every field and the class."""

    cutlass_version: str = field(default_factory=lambda: cutlass_version())
    dsl_settings: str = field(default_factory=lambda: dsl_settings())
    on_disk: ClassVar[bool] = True  # whether entries may be exported and loaded back (TVM-FFI builds only)

    def digest(self) -> str:
        return key_digest(self)


# ---------------------------------------------------------------------------------------------------- fingerprints
def _kernel_imports(path: Path, package: str) -> set[str]:
    """Module names under `package` that `path` imports (at any depth, function-level imports included)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = package.split(".")
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: level 1 is the file's own package
                base = here[:len(here) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # `from . import x` and `from .pkg import x` may name modules; keep those that exist as files.
            names = [stem] + [f"{stem}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(n for n in names if n.startswith(package + "."))
    return found


def source_files(roots: Iterable[str], package: str = "flexlab.kernels", package_dir: Path | None = None) -> list[Path]:
    """The files of the `roots` modules of `package` and of every module of the package they import, directly or
    through each other (function-level imports too), sorted by module name."""
    package_dir = package_dir or _PACKAGE_ROOT / package.split(".", 1)[1].replace(".", "/")

    def file_of(name: str) -> Path:
        return package_dir / (name[len(package) + 1:].replace(".", "/") + ".py")

    todo, seen = [f"{package}.{r}" for r in roots], set()
    while todo:
        name = todo.pop()
        if name in seen or not file_of(name).is_file():  # not a file: a name imported from a module
            continue
        seen.add(name)
        todo.extend(_kernel_imports(file_of(name), package))
    return [file_of(n) for n in sorted(seen)]


def source_fingerprint(roots: Iterable[str], extra_files: Iterable[Path] = (), package: str = "flexlab.kernels",
                       package_dir: Path | None = None) -> str:
    """sha256 (16 hex digits) over `source_files(roots)` and `extra_files`, names and contents. The set follows the
    imports, so a helper module that a kernel starts using is covered without a list to keep up to date."""
    h = hashlib.sha256()
    for path in source_files(roots, package, package_dir) + [Path(p) for p in extra_files]:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------- the cache
@dataclass
class CacheStats:
    memory_hits: int = 0
    disk_hits: int = 0
    compiles: int = 0
    rebuilt_corrupt: int = 0
    store_failures: int = 0
    compile_seconds: float = 0.0


def export_name(key: Any) -> str:
    """The function's name inside its object file, unique per entry (each loaded module gets its own symbols)."""
    return f"flexlab_{key.digest()}"


class KernelCache:
    """In-memory dict in front of an on-disk store of exported object files (keys with `on_disk` only)."""

    def __init__(self, directory: Path | None = None):
        self.directory = directory
        self.memory: dict[Any, Any] = {}
        self.stats = CacheStats()
        self._lock = threading.Lock()

    def _dir(self) -> Path:
        return self.directory or cache_dir()

    def get(self, key, build: Callable[[], Any]):
        """The compiled function for `key`: from memory, else from disk, else `build()` (then stored on disk)."""
        fn = self.memory.get(key)
        if fn is not None:
            self.stats.memory_hits += 1
            return fn
        with self._lock:
            fn = self.memory.get(key)
            if fn is None:
                fn = self._load(key) if key.on_disk else None
                if fn is None:
                    fn = self._compile_and_store(key, build)
                self.memory[key] = fn
        return fn

    def _paths(self, key) -> tuple[Path, Path]:
        base = self._dir() / key.digest()
        return base.with_suffix(".o"), base.with_suffix(".sha256")

    def _load(self, key):
        obj, digest = self._paths(key)
        if not obj.exists():
            return None
        try:
            data = obj.read_bytes()
            if not digest.exists() or hashlib.sha256(data).hexdigest() != digest.read_text().strip():
                raise ValueError("checksum mismatch")
            import cutlass.cute as cute
            fn = getattr(cute.runtime.load_module(str(obj), enable_tvm_ffi=True), export_name(key))
            self.stats.disk_hits += 1
            return fn
        except Exception:  # noqa: BLE001  (whatever is wrong with the entry, it is rebuilt)
            self.stats.rebuilt_corrupt += 1
            for p in (obj, digest):
                p.unlink(missing_ok=True)
            return None

    def _compile_and_store(self, key, build: Callable[[], Any]):
        t0 = time.perf_counter()
        fn = build()
        self.stats.compiles += 1
        self.stats.compile_seconds += time.perf_counter() - t0
        if key.on_disk:
            try:
                self._store(key, fn)
            except Exception as e:  # noqa: BLE001  (a read-only or full disk only costs a recompile next session)
                self.stats.store_failures += 1
                warnings.warn(f"flexlab: compiled kernel not stored in {self._dir()}: {type(e).__name__}: {e}",
                              RuntimeWarning, stacklevel=3)
        return fn

    def _store(self, key, fn) -> None:
        obj, digest = self._paths(key)
        obj.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=obj.parent) as tmp:
            tmp_obj = Path(tmp) / "k.o"
            fn.export_to_c(str(tmp_obj), function_name=export_name(key))
            data = tmp_obj.read_bytes()
            tmp_digest = Path(tmp) / "k.sha256"
            tmp_digest.write_text(hashlib.sha256(data).hexdigest())
            os.replace(tmp_digest, digest)  # checksum first: a crash between the two leaves no trusted object
            os.replace(tmp_obj, obj)
