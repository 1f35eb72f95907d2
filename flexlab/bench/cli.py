"""Argument parsing for ``python -m flexlab.bench`` (kept apart so tests can call `main([...])` in-process)."""
from __future__ import annotations

import argparse
import os
import sys

import torch

from .peers import PEERS, parse_backends
from .report import format_document, format_markdown, format_summary, merge_documents, read_json, write_json
from .rows import ROW_SETS, select_rows
from .runner import Settings, run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flexlab.bench",
        description="Race flexlab's attention kernels against torch FlexAttention (Triton and FLASH), FA4 and "
                    "SDPA on the same inputs; print a table and write JSON.")
    p.add_argument("--rows", default="fwd-default",
                   help=f"comma-separated row sets: {', '.join(ROW_SETS)} (default: fwd-default)")
    p.add_argument("--only", default=None, help="keep rows whose name contains this text, e.g. 'causal' or 'S16k'; "
                   "'|' separates alternatives, e.g. 'dense|causal'")
    p.add_argument("--backends", default="all",
                   help=f"all, peers, or a comma-separated list of: {', '.join(PEERS)} (default: all)")
    p.add_argument("--json", dest="json_path", default=None,
                   help="write results here (rewritten after each row; gzip-compressed if the name ends in .gz)")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes (B1 H2 S256) and short timing: checks the harness, measures nothing useful")
    p.add_argument("--warmup-ms", type=float, default=None, help="do_bench warm-up per measurement (default 25)")
    p.add_argument("--rep-ms", type=float, default=None,
                   help="do_bench repetition time per backend, split over the rounds (default 200)")
    p.add_argument("--rounds", type=int, default=None,
                   help="time a row's backends in turns over this many rounds, each in a rotated order, and keep "
                        "each one's median round (default 5; 1 = one backend after the other)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds after which no new backend/row is started (the rest is marked skipped)")
    p.add_argument("--resume", default=None, metavar="JSON",
                   help="copy the results this earlier file already holds (whole rows or single backends); "
                        "measure only what is missing")
    p.add_argument("--show", nargs="+", default=None, metavar="JSON",
                   help="print the tables of existing result files (merged, later rows win) and exit")
    p.add_argument("--markdown", action="store_true",
                   help="with --show: print Markdown tables (wall-clock, then kernel time) for BENCHMARKS.md")
    p.add_argument("--label", default=None, help="free text stored in the JSON settings, e.g. the commit measured")
    p.add_argument("--list", action="store_true", help="list the selected rows and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.show:
        docs = []
        for path in args.show:
            docs.append(read_json(path))
        doc = merge_documents(docs)
        if args.markdown:
            print("Wall-clock ms per call (TFLOP/s):\n\n" + format_markdown(doc, "wall_ms"))
            print("\nKernel-only ms per call (TFLOP/s); best peer as chosen by wall-clock:\n\n"
                  + format_markdown(doc, "kernel_ms"))
        else:
            print(format_document(doc))
        return 0
    try:
        rows = select_rows(args.rows, args.only)
        backends = parse_backends(args.backends)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.quick:
        rows = list(dict.fromkeys(r.shrunk() for r in rows))
    if args.list:
        print("\n".join(r.name for r in rows))
        return 0
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    settings = Settings(backends=backends, quick=args.quick, time_budget_s=args.time_budget, label=args.label)
    if args.quick:
        settings.warmup_ms, settings.rep_ms, settings.profile_calls, settings.rounds = 2.0, 10.0, 2, 1
    if args.warmup_ms is not None:
        settings.warmup_ms = args.warmup_ms
    if args.rep_ms is not None:
        settings.rep_ms = args.rep_ms
    if args.rounds is not None:
        if args.rounds < 1:
            print("error: --rounds must be at least 1", file=sys.stderr)
            return 2
        settings.rounds = args.rounds
    resume = None
    if args.resume and os.path.exists(args.resume):
        resume = read_json(args.resume)
    elif args.resume:  # the first of a series of resumed runs: nothing saved yet
        print(f"--resume: no results at {args.resume} yet; measuring every selected row")
    doc = run(rows, settings, device, args.json_path, resume=resume)
    print()
    print(format_summary(doc["rows"]))
    if args.json_path:
        write_json(doc, args.json_path)
        print(f"\nwrote {args.json_path}")
    return 0
