# Two entry points for a fresh machine: `make lab` (the toolkit) and `make test` (the test suite).
PYTHON ?= python3
PIP := $(PYTHON) -m pip
PORT ?= 8888

.PHONY: install lab test browser-deps

# torch: keep an existing install (GPU machines ship their own CUDA build); otherwise the CPU build.
install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[lab,dev]"

# Debian's Chromium drives the real-browser tests; they are skipped where it cannot be installed.
browser-deps:
	@command -v chromium >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) || \
		echo "chromium not installed: browser tests will be skipped"; }

lab: install
	$(PYTHON) -m jupyter lab --notebook-dir=notebooks --port=$(PORT)

test: install browser-deps
	$(PYTHON) -m pytest -q
