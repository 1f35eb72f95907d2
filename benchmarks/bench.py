"""The benchmark as a script: ``python benchmarks/bench.py ...`` is ``python -m flexlab.bench ...``."""
import sys

from flexlab.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
