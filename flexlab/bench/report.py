"""Benchmark output: the environment record, the JSON document and the fixed-width tables printed to the terminal.

The JSON is the source of truth (committed under benchmarks/results/); the tables are a view of it, so the same
functions print a live run and re-render a committed file (``python -m flexlab.bench --show results.json``).
"""
from __future__ import annotations

import datetime as _dt
import gzip
import json
import math
import os
import platform
import statistics
import subprocess
from importlib import metadata
from pathlib import Path

import torch

from .roof import MATMUL_CEILING_TFLOPS
from .rows import ROW_SETS

SCHEMA_VERSION = 1
# Backends that are not competitors: flexlab itself, and the dense reference used in tests.
NOT_PEERS = ("flexlab", "flexlab-deterministic", "reference")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _module_version(module: str) -> str | None:
    try:
        mod = __import__(module)
    except Exception:
        return None
    return getattr(mod, "__version__", None)


def _git_commit() -> str | None:
    """HEAD's short hash, with "-dirty" when tracked source files differ from it (the numbers then come from a tree
    that no commit holds; `--label` should name it)."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=here)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10, cwd=here)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    return out.stdout.strip() + ("-dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def environment(device: torch.device) -> dict:
    """Where and with what the numbers were measured."""
    from .. import __version__
    env = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": str(device),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _module_version("triton"),
        "nvidia_cutlass_dsl": _version("nvidia-cutlass-dsl"),
        "flash_attn_4": _version("flash-attn-4"),
        "flexlab": __version__,
        "flexlab_commit": _git_commit(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, compute_capability=f"{props.major}.{props.minor}",
                   cuda=torch.version.cuda, sm_count=props.multi_processor_count)
    return env


def best_peer(results: dict) -> tuple[str | None, float | None]:
    """Fastest peer by wall-clock among those that passed the correctness check."""
    best = (None, None)
    for name, r in results.items():
        if name in NOT_PEERS or r.get("status") != "ok":
            continue
        if best[1] is None or r["wall_ms"] < best[1]:
            best = (name, r["wall_ms"])
    return best


def _round_ratios(ours: dict, peer: dict, clock: str) -> list[float] | None:
    """The peer's time over flexlab's in each round of one interleaved measurement (the same `measured_utc` and round
    count), or None where the two were not timed together."""
    mine, theirs = ours.get(f"{clock}_rounds") or [], peer.get(f"{clock}_rounds") or []
    if (ours.get("status") != "ok" or peer.get("status") != "ok" or len(mine) < 2 or len(mine) != len(theirs)
            or ours.get("measured_utc") != peer.get("measured_utc") or not all(mine)):
        return None
    return [t / m for m, t in zip(mine, theirs)]


def paired_speedup(ours: dict, peer: dict, clock: str = "wall_ms") -> float | None:
    """The peer's time over flexlab's, round by round, median over the rounds: both timed in the same rounds, so a GPU
    clock that drifts between rounds cancels in each round's ratio, where the ratio of the two medians can pick
    rounds minutes apart. None where the two were not timed together."""
    ratios = _round_ratios(ours, peer, clock)
    return statistics.median(ratios) if ratios else None


# The least coverage asked of `median_interval`: with 5 rounds it spans the lowest to the highest round's ratio
# (93.75%), with 15 the 4th to the 12th (96.5%).
INTERVAL_COVERAGE = 0.9


def median_interval(values: list[float], coverage: float = INTERVAL_COVERAGE) -> tuple[float, float, float]:
    """A distribution-free interval for the median of `values` (rounds timed apart, so about independent): the order
    statistics x_(k) and x_(n+1-k) for the largest k whose coverage 1 - 2 P[Binomial(n, 1/2) < k] reaches
    `coverage`. Fewer than 5 values cannot reach 90%: then the lowest and highest, with the coverage they have.
    Returns (low, high, coverage)."""
    xs = sorted(values)
    n = len(xs)
    if n < 2:
        raise ValueError(f"median_interval needs at least 2 values, got {n}")
    tail = 0.5 ** n  # P[Binomial(n, 1/2) <= k - 1]
    k, reach = 1, 1.0 - 2.0 * tail  # reach: the coverage of (x_(k), x_(n+1-k))
    for j in range(1, n // 2):
        tail += math.comb(n, j) * 0.5 ** n
        if 1.0 - 2.0 * tail < coverage:
            break
        k, reach = j + 1, 1.0 - 2.0 * tail
    return xs[k - 1], xs[n - k], reach


def paired_interval(ours: dict, peer: dict, clock: str = "wall_ms") -> tuple[float, float, float] | None:
    """`median_interval` of the round-by-round ratios behind `paired_speedup`: how far the GPU's noise leaves the
    paired ratio uncertain. None where the two were not timed together."""
    ratios = _round_ratios(ours, peer, clock)
    return median_interval(ratios) if ratios else None


def standing(interval: tuple[float, float, float] | None) -> str | None:
    """flexlab against the best peer from the paired interval: "ahead" (all of it above 1), "behind" (all below),
    else "level" (1 lies inside: the rounds do not tell the two apart)."""
    if interval is None:
        return None
    low, high, _ = interval
    return "ahead" if low > 1.0 else "behind" if high < 1.0 else "level"


def summarize_row(record: dict) -> None:
    """Add the best peer and flexlab's standing on that row (speedup > 1 means flexlab is faster): the ratio of the
    median wall times, and the same ratio paired round by round (`paired_speedup`) for both clocks."""
    name, wall = best_peer(record["results"])
    record["best_peer"] = name
    record["best_peer_wall_ms"] = wall
    ours = record["results"].get("flexlab", {})
    record["flexlab_speedup_vs_best_peer"] = (
        wall / ours["wall_ms"] if wall and ours.get("status") == "ok" else None)
    peer = record["results"].get(name, {}) if name else {}
    record["flexlab_paired_speedup_vs_best_peer"] = {
        clock: paired_speedup(ours, peer, clock) for clock in ("wall_ms", "kernel_ms")} if name else None
    intervals = {clock: paired_interval(ours, peer, clock) for clock in ("wall_ms", "kernel_ms")} if name else {}
    # [low, high, coverage] per clock, and the wall clock's verdict (`standing`)
    record["flexlab_paired_interval_vs_best_peer"] = (
        {clock: list(iv) if iv else None for clock, iv in intervals.items()} if name else None)
    record["flexlab_standing"] = standing(intervals.get("wall_ms"))
    det = record["results"].get("flexlab-deterministic", {})
    record["deterministic_cost"] = (  # wall-clock of deterministic mode over the default, same row
        det["wall_ms"] / ours["wall_ms"] if ours.get("status") == "ok" and det.get("status") == "ok" else None)


def document(env: dict, settings: dict, rows: list[dict], ceiling: tuple[float, str] | None = None) -> dict:
    """A result document; `ceiling`: (roof TFLOP/s, its basis) from `roof.matmul_ceiling` (default: the H200's)."""
    tflops, basis = ceiling or (MATMUL_CEILING_TFLOPS, "the H200's sustained bf16 matmul rate")
    return {"schema": SCHEMA_VERSION, "environment": env, "settings": settings,
            "matmul_ceiling_tflops": tflops, "matmul_ceiling_basis": basis, "rows": rows}


def apply_roof(record: dict, ceiling_tflops: float) -> None:
    """Each timed result of row `record` as a percentage of the roof (`roof_pct`, by wall-clock TFLOP/s)."""
    for result in record.get("results", {}).values():
        if result.get("tflops") is not None:
            result["roof_pct"] = 100.0 * result["tflops"] / ceiling_tflops


def write_json(doc: dict, path: str | os.PathLike) -> None:
    """Write atomically, so a run cut short by a time limit leaves the last complete document behind; gzip-compressed
    when the name ends in ".gz" (how results are committed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    text = json.dumps(doc, indent=1, sort_keys=False) + "\n"
    if path.suffix == ".gz":
        tmp.write_bytes(gzip.compress(text.encode(), mtime=0))
    else:
        tmp.write_text(text)
    os.replace(tmp, path)


def read_json(path: str | os.PathLike):
    """A result file as written by `write_json` (or by a probe): plain JSON, or gzip-compressed JSON (".gz")."""
    path = Path(path)
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if path.suffix == ".gz" else data)


def result_files(folder: str | os.PathLike) -> list[Path]:
    """The JSON result files in `folder` (committed ones are "*.json.gz"), sorted by name; [] if it does not exist."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted([*folder.glob("*.json"), *folder.glob("*.json.gz")])


def _num(x, fmt: str, width: int) -> str:
    return f"{x:{width}{fmt}}" if isinstance(x, (int, float)) else f"{'-':>{width}}"


_HEAD = f"{'backend':<22}{'wall ms':>10}{'kernel ms':>11}{'TFLOP/s':>9}{'% roof':>8}  {'check':<8}note"


def format_row(record: dict) -> str:
    """The block of lines for one row: a header with density and work, then one line per backend."""
    if record.get("density") is None:
        return f"{record['name']}   not run: {record.get('skipped') or record.get('error') or 'unknown'}"
    lines = [f"{record['name']}   density {record['density']:.4f}   {record['flops'] / 1e9:,.1f} GFLOP"]
    for name, r in record["results"].items():
        status = r.get("status", "?")
        note = r.get("error") or r.get("note") or ""
        if status == "ok" or status in ("wrong", "suspect"):
            err = r.get("rel_l2", {})
            note = note or ("rel-L2 " + " ".join(f"{k} {v:.1e}" for k, v in err.items()))
            slow = host_bound_rounds(r)
            if slow:
                note = f"wall > {HOST_BOUND_FACTOR}x kernel in {slow}/{len(r['wall_ms_rounds'])} rounds; " + note
            lines.append(f"  {name:<20}{_num(r.get('wall_ms'), '.3f', 10)}{_num(r.get('kernel_ms'), '.3f', 11)}"
                         f"{_num(r.get('tflops'), '.1f', 9)}{_num(r.get('roof_pct'), '.1f', 8)}  {status:<8}"
                         f"{_short(note)}")
        else:
            lines.append(f"  {name:<20}{'':>38}  {status:<8}{_short(note)}")
    if record.get("best_peer"):
        s = record.get("flexlab_speedup_vs_best_peer")
        paired = _paired(record, "wall_ms")
        interval = _interval(record, "wall_ms")
        line = (f"  best peer: {record['best_peer']} {record['best_peer_wall_ms']:.3f} ms"
                + (f"; flexlab {s:.2f}x of it" if s else "; flexlab: no result"))
        if paired:
            verdict = f", {_interval_text(interval)}: {record['flexlab_standing']}" if interval else ""
            line += f" ({paired:.2f}x paired by round{verdict})"
        lines.append(line)
    if record.get("deterministic_cost"):
        lines.append(f"  deterministic mode: {record['deterministic_cost']:.2f}x flexlab's default wall time")
    return "\n".join(lines)


# A round whose wall time exceeds its kernel time by this factor most likely waited for the host (launch overhead, or
# a host slowed by other work); an isolated one can also be the GPU clock moving between the two clocks' measurements.
HOST_BOUND_FACTOR = 1.1


def host_bound_rounds(result: dict) -> int:
    """How many of an interleaved measurement's rounds took HOST_BOUND_FACTOR x their kernel time or more of wall time
    (0 without per-round times): the rounds to distrust when wall and kernel ratios disagree."""
    walls, kernels = result.get("wall_ms_rounds") or [], result.get("kernel_ms_rounds") or []
    return sum(1 for w, k in zip(walls, kernels) if k and w > HOST_BOUND_FACTOR * k)


def _short(text: str, width: int = 90) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 3] + "..."


def format_summary(rows: list[dict]) -> str:
    """One line per row: the best peer, flexlab, and how far each is from the matmul roof."""
    w = max([len(rec["name"]) for rec in rows] + [43]) + 1
    out = [f"{'row':<{w}}{'best peer':<22}{'ms':>9}{'TFLOP/s':>9}{'flexlab ms':>12}{'TFLOP/s':>9}{'vs best':>9}"
           f"{'paired':>8}  {'interval':<19}standing"]
    for rec in rows:
        peer = rec.get("best_peer")
        p = rec["results"].get(peer, {}) if peer else {}
        f = rec["results"].get("flexlab", {})
        f_ok = f.get("status") == "ok"
        out.append(f"{rec['name']:<{w}}{(peer or '-'):<22}{_num(p.get('wall_ms'), '.3f', 9)}"
                   f"{_num(p.get('tflops'), '.1f', 9)}{_num(f.get('wall_ms') if f_ok else None, '.3f', 12)}"
                   f"{_num(f.get('tflops') if f_ok else None, '.1f', 9)}"
                   f"{_num(rec.get('flexlab_speedup_vs_best_peer'), '.2f', 9)}"
                   f"{_num(_paired(rec, 'wall_ms'), '.2f', 8)}  {_interval_text(_interval(rec, 'wall_ms')):<19}"
                   f"{rec.get('flexlab_standing') or '-'}")
    return "\n".join(out)


def _paired(record: dict, clock: str) -> float | None:
    return (record.get("flexlab_paired_speedup_vs_best_peer") or {}).get(clock)


def _interval(record: dict, clock: str) -> list[float] | None:
    return (record.get("flexlab_paired_interval_vs_best_peer") or {}).get(clock)


def _interval_text(interval) -> str:
    """'0.95-1.01 at 94%': the paired ratio's interval and its coverage (a bound that two decimals would round to 1.00
    gets three, so a row behind by its interval never reads as reaching 1)."""
    if not interval:
        return "-"
    low, high, coverage = interval

    def bound(x: float) -> str:
        return f"{x:.3f}" if f"{x:.2f}" == "1.00" and x != 1.0 else f"{x:.2f}"
    return f"{bound(low)}-{bound(high)} at {100 * coverage:.0f}%"


def format_document(doc: dict) -> str:
    env = doc["environment"]
    head = (f"{env.get('gpu', env.get('device'))}  torch {env.get('torch')}  triton {env.get('triton')}  "
            f"cutlass-dsl {env.get('nvidia_cutlass_dsl')}  flash-attn-4 {env.get('flash_attn_4')}  "
            f"{env.get('date_utc')}  (roof: {doc['matmul_ceiling_tflops']:.0f} TFLOP/s bf16 matmul)")
    blocks = [head, _HEAD] + [format_row(r) for r in doc["rows"]]
    return "\n".join(blocks) + "\n\n" + format_summary(doc["rows"])


def merge_documents(docs: list[dict]) -> dict:
    """Several runs as one document, so peers and flexlab measured in separate commands share one table.

    Default rows come in the issue's order, others after them. A row measured in several runs gets the union of its
    backends' results (a later run wins for a backend it measured again); each result keeps its `measured_utc`.
    """
    if not docs:
        raise ValueError("merge_documents needs at least one document")
    gpus = {doc.get("environment", {}).get("gpu") for doc in docs} - {None}
    if len(gpus) > 1:
        raise ValueError(f"merge_documents: these runs are from different GPUs ({', '.join(sorted(gpus))}); "
                         "one table compares backends on one GPU")
    rows: dict[str, dict] = {}
    for doc in docs:
        stamp = doc.get("environment", {}).get("date_utc")
        for rec in doc["rows"]:
            results = {name: ({"measured_utc": stamp, **r} if stamp else r)
                       for name, r in (rec.get("results") or {}).items() if r.get("status") != "skipped"}
            old = rows.get(rec["name"])
            if old is None or old.get("density") is None:
                rows[rec["name"]] = {**rec, "results": {**(old or {}).get("results", {}), **results}}
            else:
                old["results"] = {**old["results"], **results}
    for rec in rows.values():
        if rec.get("density") is not None:
            summarize_row(rec)
    # The issue's row order (forward, then forward+backward) where a row is one of the default rows.
    order = {row.name: i for i, row in enumerate(ROW_SETS["all"])}
    ordered = sorted(rows.values(), key=lambda rec: order.get(rec["name"], len(order)))
    first = docs[0]
    ceiling = ((first["matmul_ceiling_tflops"], first.get("matmul_ceiling_basis", ""))
               if "matmul_ceiling_tflops" in first else None)
    merged = document(first["environment"], first.get("settings", {}), ordered, ceiling)
    merged["runs"] = [d["environment"] for d in docs]
    return merged


_MD_BACKENDS = (("flexlab", "flexlab"), ("flexlab-deterministic", "flexlab deterministic"),
                ("flex-triton", "flex Triton"),
                ("flex-triton-autotune", "flex Triton max-autotune"),
                ("flex-flash", "flex FLASH"), ("fa4", "FA4"), ("sdpa", "SDPA"))


def _md_cell(r: dict | None, clock: str) -> str:
    if not r:
        return ""
    status = r.get("status")
    if status in ("ok", "wrong", "suspect") and isinstance(r.get(clock), (int, float)):
        tflops = r.get("tflops" if clock == "wall_ms" else "tflops_kernel")
        cell = f"{r[clock]:.3f}" + (f" ({tflops:.0f})" if isinstance(tflops, (int, float)) else "")
        return cell if status == "ok" else f"{status}: {cell}"
    return {"n/a": "n/a", "skipped": "not run", "error": "error"}.get(status, status or "")


def format_markdown(doc: dict, clock: str = "wall_ms") -> str:
    """A Markdown table of one clock ("wall_ms" or "kernel_ms"): ms per call and TFLOP/s in parentheses; the
    ratio to the best peer (chosen by wall clock) is taken on the table's own clock, as a ratio of medians and paired
    by round (`paired_speedup`, with its `paired_interval`)."""
    header = ["row", "density"] + [label for _, label in _MD_BACKENDS] + ["best peer", "flexlab vs best",
                                                                          "paired", "paired interval",
                                                                          "best % of roof"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for rec in doc["rows"]:
        results = rec.get("results", {})
        density = f"{rec['density']:.3f}" if isinstance(rec.get("density"), (int, float)) else "-"
        cells = [rec["name"], density] + [_md_cell(results.get(name), clock) for name, _ in _MD_BACKENDS]
        peer = best_peer(results)[0]
        speedup = rec.get("flexlab_speedup_vs_best_peer")
        roof = results.get(peer, {}).get("roof_pct") if peer else None
        if peer and clock == "kernel_ms":
            tk = results[peer].get("tflops_kernel")
            roof = 100.0 * tk / doc["matmul_ceiling_tflops"] if tk else None
            ours, theirs = results.get("flexlab", {}).get("kernel_ms"), results[peer].get("kernel_ms")
            speedup = theirs / ours if ours and theirs else None  # this table's clock, not the wall clock's ratio
        paired = _paired(rec, clock)
        cells += [peer or "-", f"{speedup:.2f}x" if speedup else "-", f"{paired:.2f}x" if paired else "-",
                  _interval_text(_interval(rec, clock)), f"{roof:.0f}%" if roof else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
