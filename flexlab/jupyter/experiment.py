"""One run of a variant, shared by the playground and ``%%flexattn``: code -> mods -> correctness and timing.

The code a researcher types is executed as a small module registered in ``linecache`` (so tracebacks, the code
generator's line comments and ``inspect`` all see its lines). Every failure becomes a :class:`CodeError` that
carries the line to point at, so the notebook shows the error next to the code instead of a dead kernel.

Correctness is always against the float64 reference backend on fresh random inputs; timing is the median wall time
per call (CUDA: triton's ``do_bench``; CPU: repeated host timing), TFLOP/s counts only the pairs the mask keeps.
"""
from __future__ import annotations

import hashlib
import importlib.util
import linecache
import math
import sys
import time
import traceback
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ..errors import FlexlabError, FlexlabValueError, UnsupportedModError, check_positive_int

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}
#: Backends a run can compare; "flash" is torch FlexAttention with kernel_options={"BACKEND": "FLASH"}.
BACKENDS = ("reference", "torch", "sdpa", "flash", "cute")
#: SDPA needs the mask as a dense (B, H, Sq, Skv) bool tensor; beyond this many entries it is not worth building.
SDPA_DENSE_LIMIT = 1 << 26


class CodeError(FlexlabError, ValueError):
    """The cell/editor code failed; ``line`` (1-based, in that code) says where, when known."""

    def __init__(self, message: str, line: Optional[int] = None, source_line: Optional[str] = None,
                 kind: str = "error"):
        self.message, self.line, self.source_line, self.kind = message, line, source_line, kind
        where = f" (line {line}: {source_line.strip()})" if line and source_line else (f" (line {line})" if line
                                                                                       else "")
        super().__init__(f"{message}{where}")


# ------------------------------------------------------------------------------------------------ code -> mods
def code_hash(code: str) -> str:
    return hashlib.sha256(code.encode()).hexdigest()[:16]


def register_source(code: str) -> str:
    """Make ``code`` readable through linecache under a stable per-content file name; returns the name."""
    filename = f"<flexlab-cell-{code_hash(code)}>"
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    return filename


def _line_in(tb, filename: str) -> Optional[int]:
    """The deepest traceback line that lies in ``filename`` (the user's code), if any."""
    line = None
    for frame in traceback.extract_tb(tb):
        if frame.filename == filename:
            line = frame.lineno
    return line


def _code_error(err: BaseException, code: str, filename: str, during: str) -> CodeError:
    lines = code.splitlines()

    def text(n):
        return lines[n - 1] if n and 0 < n <= len(lines) else None

    if isinstance(err, CodeError):
        return err
    if isinstance(err, SyntaxError):
        return CodeError(f"SyntaxError: {err.msg}", err.lineno, text(err.lineno), "syntax")
    if isinstance(err, UnsupportedModError):
        line = err.line if (err.file in (None, filename)) else _line_in(err.__traceback__, filename)
        msg = f"unsupported operation {err.op!r}" + (f" ({err.hint})" if err.hint else "")
        return CodeError(msg, line, text(line), "unsupported")
    line = _line_in(err.__traceback__, filename)
    return CodeError(f"{type(err).__name__} while {during}: {err}", line, text(line), "runtime")


@dataclass(frozen=True)
class LoadedMods:
    score_mod: Optional[Callable]
    mask_mod: Optional[Callable]
    tensors: dict
    filename: str
    code_hash: str


def load_mods(code: str, *, params: Optional[dict] = None, variant=None, B: int = 1, H: int = 1,
              Q_LEN: int = 256, KV_LEN: Optional[int] = None, device="cpu",
              env: Optional[dict] = None) -> LoadedMods:
    """Execute editor/cell code and return the mods it defines.

    The code runs with ``torch``, the shape (``B, H, Q_LEN, KV_LEN, device``) and the parameters as plain names.
    If it defines ``score_mod`` and/or ``mask_mod`` those are used. Otherwise, for a gallery variant, its
    ``make`` is called with the (possibly edited) ``generate_*`` factories from the code, which is the form the
    playground is prefilled with. ``env`` (e.g. a notebook's namespace) is visible to the code as well.
    """
    KV_LEN = Q_LEN if KV_LEN is None else KV_LEN
    params = dict(params or {})
    filename = register_source(code)
    base: dict[str, Any] = dict(env or {})
    if variant is not None:
        base.update(variant.make.__globals__)
    base.update(torch=torch, B=B, H=H, Q_LEN=Q_LEN, KV_LEN=KV_LEN, device=device, **params)
    # A real module in sys.modules: torch.compile and pickling look functions up by their __module__.
    module = types.ModuleType(f"flexlab_cell_{code_hash(code)}")
    module.__dict__.update(base)
    module.__file__ = filename
    sys.modules[module.__name__] = module
    ns = module.__dict__
    try:
        compiled = compile(code, filename, "exec")
        exec(compiled, ns)
    except BaseException as err:                                   # noqa: BLE001 - reported at the user's line
        if isinstance(err, KeyboardInterrupt):
            raise
        raise _code_error(err, code, filename, "running the code") from None
    score_mod = ns.get("score_mod") if ns.get("score_mod") is not base.get("score_mod") else None
    mask_mod = ns.get("mask_mod") if ns.get("mask_mod") is not base.get("mask_mod") else None
    tensors: dict = {}
    if score_mod is None and mask_mod is None:
        if variant is None:
            raise CodeError("the code must define score_mod(score, b, h, q_idx, kv_idx) and/or "
                            "mask_mod(b, h, q_idx, kv_idx)", kind="missing")
        make = variant.make
        rebound = types.FunctionType(make.__code__, ns, make.__name__, make.__defaults__, make.__closure__)
        try:
            mods = rebound(B, H, Q_LEN, KV_LEN, device=device, **params)
        except BaseException as err:                               # noqa: BLE001
            if isinstance(err, KeyboardInterrupt):
                raise
            raise _code_error(err, code, filename, f"building variant {variant.name!r}") from None
        score_mod, mask_mod, tensors = mods.score_mod, mods.mask_mod, dict(mods.tensors)
    from ..mods import check_mask_mod, check_score_mod
    for fn, check in ((score_mod, check_score_mod), (mask_mod, check_mask_mod)):
        try:
            check(fn)
        except Exception as err:                                   # noqa: BLE001 - a wrong signature or type
            fn_code = getattr(fn, "__code__", None)
            line = fn_code.co_firstlineno if fn_code is not None and fn_code.co_filename == filename else None
            lines = code.splitlines()
            raise CodeError(str(err), line, lines[line - 1] if line and line <= len(lines) else None,
                            "type") from None
    return LoadedMods(score_mod, mask_mod, tensors, filename, code_hash(code))


# ------------------------------------------------------------------------------------------------ settings
@dataclass(frozen=True)
class RunSpec:
    """Shape, dtype and backends of one run."""

    B: int = 1
    H: int = 2
    S: int = 256
    D: int = 64
    dtype: str = "fp32"
    backends: tuple[str, ...] = ("reference", "torch")
    kv_len: Optional[int] = None
    device: str = "cpu"
    seed: int = 0
    warmup_ms: float = 10.0
    rep_ms: float = 60.0

    def __post_init__(self):
        for name in ("B", "H", "S", "D"):
            check_positive_int(name, getattr(self, name))
        if self.dtype not in DTYPES:
            raise FlexlabValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        unknown = [b for b in self.backends if b not in BACKENDS]
        if unknown or not self.backends:
            raise FlexlabValueError(f"backends must be a non-empty subset of {BACKENDS}, got {list(self.backends)}")

    @property
    def Skv(self) -> int:
        return self.S if self.kv_len is None else self.kv_len

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass
class BackendRow:
    """One backend's numbers: ``error`` set (and the numbers None) when it could not run."""

    backend: str
    ms: Optional[float] = None
    tflops: Optional[float] = None
    rel_l2: Optional[float] = None
    max_abs: Optional[float] = None
    has_nan: Optional[bool] = None
    passed: Optional[bool] = None
    speedup: Optional[float] = None      # this backend's time / the baseline's time (>1: the baseline is faster)
    first_call_s: Optional[float] = None  # the first call, which includes any compilation
    error: Optional[str] = None

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class RunResult:
    """Everything a panel shows; ``-o name`` in the magic and ``Playground.result`` hand this out."""

    spec: RunSpec
    rows: list[BackendRow]
    density: float
    flops: float
    tolerance: float
    baseline: Optional[str]
    code_hash: str
    recompiles: dict = field(default_factory=dict)       # what had to be (re)built during this run, by kind
    timings: dict = field(default_factory=dict)          # seconds spent per phase
    cached: bool = False
    mods: Optional[LoadedMods] = None
    block_mask: Any = None

    @property
    def passed(self) -> bool:
        ran = [r for r in self.rows if r.error is None]
        return bool(ran) and all(r.passed for r in ran)

    def row(self, backend: str) -> BackendRow:
        for r in self.rows:
            if r.backend == backend:
                return r
        raise KeyError(f"no backend {backend!r} in this result; have {[r.backend for r in self.rows]}")

    def table(self) -> list[dict]:
        return [r.as_dict() for r in self.rows]

    @property
    def total_recompiles(self) -> int:
        return int(sum(self.recompiles.values()))


# ------------------------------------------------------------------------------------------------ backends
def _flash_available(device: torch.device) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, "needs a CUDA device"
    if importlib.util.find_spec("flash_attn") is None or importlib.util.find_spec("flash_attn.cute") is None:
        return False, "flash-attn-4 (flash_attn.cute) is not installed"
    return True, ""


_COMPILED_FLASH = None


def _flash_call(q, k, v, score_mod, block_mask):
    global _COMPILED_FLASH
    from functools import partial

    from torch.nn.attention.flex_attention import flex_attention
    if _COMPILED_FLASH is None:
        _COMPILED_FLASH = torch.compile(partial(flex_attention, kernel_options={"BACKEND": "FLASH"}), dynamic=False)
    out = _COMPILED_FLASH(q, k, v, score_mod=score_mod, block_mask=block_mask)
    return out[0] if isinstance(out, tuple) else out


def _prepare(backend: str, q, k, v, mods: LoadedMods, block_mask, spec: RunSpec) -> Callable[[], torch.Tensor]:
    """A zero-argument call for ``backend``, or raise with the reason it does not apply here."""
    import flexlab
    score_mod = mods.score_mod
    if backend in ("reference", "torch", "cute"):
        if backend == "cute":
            from ..backends import cute
            ok, reason = cute.is_supported(q, k, v, score_mod, block_mask, None, False)
            if not ok:
                raise RuntimeError(reason)
        return lambda: flexlab.flex_attention(q, k, v, score_mod, block_mask, backend=backend)
    if backend == "sdpa":
        if score_mod is not None:
            raise RuntimeError("n/a: SDPA has no score_mod")
        mask = None
        if mods.mask_mod is not None:
            if spec.B * spec.H * spec.S * spec.Skv > SDPA_DENSE_LIMIT:
                raise RuntimeError("n/a: the dense mask SDPA needs would be too large")
            mask = flexlab.create_mask(mods.mask_mod, spec.B, spec.H, spec.S, spec.Skv, device=q.device)
        return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if backend == "flash":
        ok, reason = _flash_available(q.device)
        if not ok:
            raise RuntimeError(reason)
        return lambda: _flash_call(q, k, v, score_mod, block_mask)
    raise FlexlabValueError(f"unknown backend {backend!r}")


def _median_ms(fn: Callable, device: torch.device, spec: RunSpec) -> float:
    from ..bench.timing import measure
    return measure(fn, device, warmup_ms=spec.warmup_ms, rep_ms=spec.rep_ms, profile_calls=3).wall_ms


def _counters() -> dict:
    """Monotonic counts of things built so far in this process (our kernels, generated sources, torch graphs)."""
    out = {"flexlab kernels": 0, "generated sources": 0, "torch graphs": 0}
    if "flexlab.runtime.compile" in sys.modules:
        out["flexlab kernels"] = sys.modules["flexlab.runtime.compile"].kernel_cache().stats.compiles
    if "flexlab.kernels.bwd_launch" in sys.modules:  # the backward's three kernels, same cache class and directory
        out["flexlab kernels"] += sys.modules["flexlab.kernels.bwd_launch"].bwd_kernel_cache().stats.compiles
    gen = sys.modules.get("flexlab.codegen.generated")
    if gen is not None:
        out["generated sources"] = len(gen._MODULES)
    try:
        from torch._dynamo.utils import counters
        out["torch graphs"] = int(counters["stats"]["unique_graphs"])
    except Exception:                                              # noqa: BLE001 - a count, not a requirement
        pass
    return out


def run_experiment(mods: LoadedMods, spec: RunSpec, progress: Optional[Callable[[str, float], None]] = None
                   ) -> RunResult:
    """Build the block mask, run every backend of ``spec`` on fresh random inputs, check and time them."""
    import flexlab
    from ..bench.density import mask_density
    from ..testing import TOLERANCES, max_abs, random_qkv, rel_l2

    def step(text, frac):
        if progress is not None:
            progress(text, frac)

    before = _counters()
    timings: dict[str, float] = {}
    device = torch.device(spec.device)
    dtype = spec.torch_dtype
    t0 = time.perf_counter()
    block_mask = None
    if mods.mask_mod is not None:
        step("building the block mask", 0.05)
        block_mask = flexlab.create_block_mask(mods.mask_mod, spec.B, spec.H, spec.S, spec.Skv, device=device)
    timings["block mask"] = time.perf_counter() - t0
    density = mask_density(block_mask)
    flops = 4.0 * spec.B * spec.H * spec.S * spec.Skv * spec.D * density
    gen = torch.Generator().manual_seed(spec.seed)
    q, k, v = random_qkv(spec.B, spec.H, spec.S, spec.Skv, spec.D, dtype=dtype, device=device, generator=gen)

    step("float64 reference", 0.15)
    t0 = time.perf_counter()
    with torch.no_grad():
        ref = flexlab.flex_attention(q.double(), k.double(), v.double(), mods.score_mod, block_mask,
                                     backend="reference")
    timings["float64 reference"] = time.perf_counter() - t0
    tol = TOLERANCES[dtype]
    rows: list[BackendRow] = []
    n = len(spec.backends)
    for i, backend in enumerate(spec.backends):
        step(f"{backend}: first call (compiles if needed)", 0.2 + 0.8 * i / n)
        row = BackendRow(backend)
        try:
            with torch.no_grad():
                call = _prepare(backend, q, k, v, mods, block_mask, spec)
                t0 = time.perf_counter()
                out = call()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                row.first_call_s = timings[f"{backend} first call"] = time.perf_counter() - t0
                row.has_nan = bool(torch.isnan(out).any())
                row.rel_l2 = rel_l2(out, ref)
                row.max_abs = max_abs(out, ref)
                row.passed = (not row.has_nan) and math.isfinite(row.rel_l2) and row.rel_l2 <= tol
                step(f"{backend}: timing", 0.2 + 0.8 * (i + 0.5) / n)
                row.ms = _median_ms(call, device, spec)
                row.tflops = flops / (row.ms * 1e-3) / 1e12 if row.ms > 0 else None
        except Exception as err:                                   # noqa: BLE001 - one backend failing is a row
            row.error = f"{type(err).__name__}: {err}" if not isinstance(err, RuntimeError) else str(err)
            row.ms = row.tflops = None
        rows.append(row)
    ran = [r for r in rows if r.ms]
    baseline = "cute" if any(r.backend == "cute" for r in ran) else (ran[0].backend if ran else None)
    if baseline is not None:
        base_ms = next(r.ms for r in ran if r.backend == baseline)
        for r in ran:
            r.speedup = r.ms / base_ms
    after = _counters()
    recompiles = {key: after[key] - before[key] for key in after}
    step("done", 1.0)
    return RunResult(spec, rows, density, flops, tol, baseline, mods.code_hash, recompiles, timings,
                     mods=mods, block_mask=block_mask)
