"""Command line: ``python -m flexlab.bench --rows fwd-default --backends all --json out.json``.

Examples::

    python -m flexlab.bench --rows all --json results.json            # flexlab and every peer, every row
    python -m flexlab.bench --rows fwd-default --backends peers --only causal
    python -m flexlab.bench --rows validate --quick --device cpu --backends reference,sdpa
    python -m flexlab.bench --show benchmarks/results/fwd_d256_all_h200_2026-12-03.json.gz  # re-print a result
"""
import sys

from .cli import main

sys.exit(main())
