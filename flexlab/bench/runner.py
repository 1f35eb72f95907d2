"""Run benchmark rows: build each case once, check every backend against the float64 reference, then time them.

All backends of a row see the same q, k, v (and the same upstream gradient), in one process, and are timed in turns
(`timing.measure_interleaved`) once all of them are compiled and checked. torch.compile caches
are reset between rows and its recompile limit is raised and made fatal, so torch's peers are always their compiled
selves; the profiler's kernel names are a second guard against a silent fall-back to an unfused path.
"""
from __future__ import annotations

import datetime
import gc
import re
import time
import traceback
from dataclasses import asdict, dataclass, field

import torch

from ..errors import BackendUnavailableError
from ..runtime import poison
from . import check, peers
from .cases import build_case
from .density import mask_density
from .report import apply_roof, document, format_row, summarize_row, write_json, environment
from .roof import matmul_ceiling
from .rows import FWD_BWD, Row
from .timing import measure, measure_interleaved


@dataclass
class Settings:
    warmup_ms: float = 25.0
    rep_ms: float = 200.0  # split over the rounds
    profile_calls: int = 10
    time_budget_s: float | None = None   # stop starting new work after this many seconds
    seed: int = 0
    quick: bool = False
    label: str | None = None              # free text saved with the results (commit, machine notes)
    backends: list[str] = field(default_factory=lambda: list(peers.DEFAULT_BACKENDS))
    # Backends of a row are timed in turns over this many rounds (`timing.measure_interleaved`); 1 = one after the
    # other, each in one go.
    rounds: int = 5


def configure_dynamo() -> None:
    """Enough recompiles for a whole benchmark, and an error (never an eager fall-back) past the limit."""
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, 256)
    if hasattr(cfg, "accumulated_recompile_limit"):
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4096)
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        cfg.fail_on_recompile_limit_hit = True


_ABS_PATH = re.compile(r"(?:/[\w.+-]+)+/([\w.+-]+)")


def _error_text(err: BaseException, limit: int = 600) -> str:
    """One-line error for the JSON: absolute paths cut to their file name (results are shared across machines)."""
    text = _ABS_PATH.sub(r"\1", f"{type(err).__name__}: {err}".strip())
    return text if len(text) <= limit else text[:limit] + " ..."


def _kernel_note(expect, kernels) -> str | None:
    """Why the profile looks like a fall-back, or None when the largest kernel is the expected kind."""
    if not expect or not kernels:
        return None
    top = kernels[0][0].lower()
    if any(s in top for s in expect):
        return None
    return f"largest kernel {kernels[0][0][:80]!r} is not a fused attention kernel (fall-back?)"


def _utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_call(prepared: peers.Prepared, grad: bool, dout_native):
    """The call as a user makes it: a forward under no_grad, or a forward+backward from fresh gradients."""
    if not grad:
        def forward():
            with torch.no_grad():
                return prepared.call()
        return forward

    def forward_backward():
        for t in prepared.inputs:
            t.grad = None
        out = prepared.call()
        out.backward(dout_native)
        return out
    return forward_backward


def prepare_backend(name: str, row: Row, case, q, k, v, dout, block_mask, ref, settings: Settings,
                    device, log=print) -> tuple[dict, object]:
    """One backend on one row: prepare, first call (compile), check. Returns (record, timed callable or None when
    it cannot be timed). Never raises."""
    prepare, _ = peers.PEERS[name]
    grad = row.mode == FWD_BWD
    try:
        prepared = prepare(case, q, k, v, block_mask, grad)
    except (peers.Unavailable, BackendUnavailableError) as err:
        return {"status": "n/a", "error": str(err)}, None
    except Exception as err:
        log(f"{name} on {row.name} failed to prepare:\n{traceback.format_exc(limit=8)}")
        return {"status": "error", "error": _error_text(err)}, None
    fn = _timed_call(prepared, grad, prepared.from_bhsd(dout) if grad else None)
    record: dict = {}
    try:
        t0 = time.perf_counter()
        with poison.poisoned():  # (the checked call: a tile flexlab's kernels leave unwritten reads NaN)
            out = fn()
        _sync(device)
        record["first_call_s"] = round(time.perf_counter() - t0, 3)  # mostly compilation
        grads = tuple(None if t.grad is None else prepared.to_bhsd(t.grad) for t in prepared.inputs) if grad \
            else None
        verdict = check.compare(ref, prepared.to_bhsd(out.detach()), grads, row.torch_dtype)
        del out, grads
        record["rel_l2"] = verdict["rel_l2"]
        if not verdict["passed"]:
            record.update(status="wrong", error=verdict["why"])
    except (peers.Unavailable, BackendUnavailableError) as err:
        return {"status": "n/a", "error": str(err)}, None
    except Exception as err:
        log(f"{name} on {row.name} failed:\n{traceback.format_exc(limit=8)}")
        return {"status": "error", "error": _error_text(err)}, None
    return record, fn


def timed_record(name: str, record: dict, timing, flops: float) -> dict:
    """A prepared backend's record with its timing, TFLOP/s and verdict (a fall-back kernel marks it suspect)."""
    record = dict(record)
    record["wall_ms"] = timing.wall_ms
    record["kernel_ms"] = timing.kernel_ms
    record["tflops"] = flops / (timing.wall_ms * 1e-3) / 1e12
    record["tflops_kernel"] = flops / (timing.kernel_ms * 1e-3) / 1e12 if timing.kernel_ms else None
    record["kernels"] = [[n, round(ms, 4)] for n, ms in timing.kernels]
    if timing.wall_rounds:
        record["wall_ms_rounds"] = [round(x, 4) for x in timing.wall_rounds]
        record["kernel_ms_rounds"] = [round(x, 4) for x in timing.kernel_rounds]
    note = _kernel_note(peers.PEERS[name][1], timing.kernels)
    if "status" not in record:
        record["status"] = "suspect" if note else "ok"
    if note:
        record["note"] = note
    return {"status": record.pop("status"), **record}


def time_backends(prepared: dict, flops: float, settings: Settings, device, log=print) -> dict:
    """Time the prepared backends of one row together (`measure_interleaved`); a backend whose timing raises is
    timed again alone, so its error is its own."""
    fns = {name: fn for name, (_, fn) in prepared.items()}
    results = {}
    try:
        timings = measure_interleaved(fns, device, settings.warmup_ms, settings.rep_ms, settings.rounds,
                                      settings.profile_calls)
    except Exception:
        timings = {}
        for name, fn in fns.items():
            try:
                timings[name] = measure(fn, device, settings.warmup_ms, settings.rep_ms,
                                        profile_calls=settings.profile_calls)
            except Exception as err:
                log(f"{name} failed while timed:\n{traceback.format_exc(limit=8)}")
                results[name] = {"status": "error", "error": _error_text(err)}
    for name, (record, _) in prepared.items():
        if name in timings:
            results[name] = timed_record(name, record, timings[name], flops)
    return results


def _inputs(row: Row, device, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (row.B, row.H, row.S, row.D)
    q, k, v = (torch.randn(shape, generator=gen, device=device, dtype=row.torch_dtype) for _ in range(3))
    dout = torch.randn(shape, generator=gen, device=device, dtype=row.torch_dtype) if row.mode == FWD_BWD else None
    return q, k, v, dout


def run_row(row: Row, settings: Settings, device: torch.device, deadline: float | None = None,
            log=print, keep: dict | None = None) -> dict:
    """Build, check and time every selected backend on one row; returns the row's JSON record.

    `keep` holds results of this row from an earlier run; backends found there are copied, not measured.
    """
    from ..mask import create_block_mask
    torch._dynamo.reset()
    record = {"name": row.name, **asdict(row), "measured_utc": _utc_now()}
    case = build_case(row.variant, row.B, row.H, row.S, device)
    block_mask = (create_block_mask(case.mask_mod, None, None, row.S, row.S, device=device)
                  if case.mask_mod is not None else None)
    density = mask_density(block_mask)
    flops = row.flops(density)
    record.update(density=density, flops=flops, mods=case.mods_source, gallery_variants=case.gallery_variants)
    q, k, v, dout = _inputs(row, device, settings.seed)
    t0 = time.perf_counter()
    ref = check.reference(q, k, v, case.score_mod, case.mask_mod, dout)
    record["reference_s"] = round(time.perf_counter() - t0, 3)
    results = {}
    prepared = {}
    keep = keep or {}
    for name in settings.backends:
        if name in keep and keep[name].get("status") != "skipped":
            results[name] = keep[name]
            continue
        if deadline is not None and time.monotonic() > deadline:
            results[name] = {"status": "skipped", "error": "time budget spent"}
            continue
        rec, fn = prepare_backend(name, row, case, q, k, v, dout, block_mask, ref, settings, device, log)
        if fn is None:
            results[name] = {**rec, "measured_utc": _utc_now()}
        else:
            prepared[name] = (rec, fn)
    measured_utc = _utc_now()
    for name, res in time_backends(prepared, flops, settings, device, log).items():
        results[name] = {**res, "measured_utc": measured_utc}
    del prepared
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    results = {name: results[name] for name in settings.backends if name in results}
    record["results"] = results
    summarize_row(record)
    return record


def finished(record: dict, backends: list[str]) -> bool:
    """Whether a saved row already holds a result for every backend asked for (so a resumed run can keep it)."""
    results = record.get("results") or {}
    return record.get("density") is not None and all(
        name in results and results[name].get("status") != "skipped" for name in backends)


def run(rows: list[Row], settings: Settings, device: torch.device, json_path=None, log=print,
        resume: dict | None = None) -> dict:
    """Run `rows` in order, printing each row's table as it finishes and rewriting `json_path` after each row.

    With `resume` (an earlier result document), results it already holds are copied instead of measured again
    (whole rows, or single backends of a row), so a long benchmark can be completed over several time-limited
    commands, or flexlab alone can be measured next to saved peer results. Every result carries its own
    `measured_utc`.
    """
    configure_dynamo()
    deadline = None if settings.time_budget_s is None else time.monotonic() + settings.time_budget_s
    env = environment(device)
    doc = document(env, {k: v for k, v in asdict(settings).items()}, [], matmul_ceiling(env, device))
    saved = {r["name"]: r for r in (resume or {}).get("rows", [])}
    for row in rows:
        prior = saved.get(row.name, {})
        if finished(prior, settings.backends):
            log(f"{row.name}: kept from the resumed results ({prior.get('measured_utc', 'earlier run')})")
            doc["rows"].append(prior)
            continue
        if deadline is not None and time.monotonic() > deadline:
            doc["rows"].append({"name": row.name, **asdict(row), "density": None, "flops": None,
                                "skipped": "time budget spent", "results": {}})
            continue
        try:
            record = run_row(row, settings, device, deadline, log, keep=prior.get("results"))
        except Exception as err:  # a broken case (bad mods, OOM building inputs) must not lose the other rows
            record = {"name": row.name, **asdict(row), "density": None, "flops": None,
                      "error": _error_text(err), "results": {}}
            log(f"{row.name}: {record['error']}")
        else:
            apply_roof(record, doc["matmul_ceiling_tflops"])
            log(format_row(record))
        doc["rows"].append(record)
        if json_path:
            write_json(doc, json_path)
    return doc
