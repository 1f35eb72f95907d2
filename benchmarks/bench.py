"""The benchmark as a script: ``python benchmarks/bench.py ...`` is ``python -m flexlab.bench ...``."""
import sys
from pathlib import Path

try:
    from flexlab.bench.cli import main
except ModuleNotFoundError:  # a checkout that was not pip-installed: use the package next to this folder
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from flexlab.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
