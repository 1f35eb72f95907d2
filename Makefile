# Two entry points for a fresh machine: `make lab` (the toolkit) and `make test` (the test suite).
PYTHON ?= python3
PIP := $(PYTHON) -m pip
PORT ?= 8888

.PHONY: install lab test browser-deps test-compat

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

# The GPU machines run torch 2.11 on Python 3.12: the CPU tests that reach into torch (autograd, torch.compile, masks,
# viz, the notebook toolkit) run again there, in a venv of their own. Kernel, notebook and browser tests run once.
COMPAT_TORCH ?= 2.11.0
COMPAT_VENV ?= .venv-compat
COMPAT_PYTHON ?= $(shell for p in python3.12 "$$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do \
	"$$p" -c "" 2>/dev/null && { echo "$$p"; break; }; done)

test-compat:
	@[ -x $(COMPAT_VENV)/bin/python ] || $(or $(COMPAT_PYTHON),$(PYTHON)) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install -q torch==$(COMPAT_TORCH)
	$(COMPAT_VENV)/bin/python -m pip install -q -e ".[lab,dev]"
	$(COMPAT_VENV)/bin/python -c "import sys, torch; print('compat:', sys.version.split()[0], 'torch', torch.__version__)"
	$(COMPAT_VENV)/bin/python -m pytest -q -m "not gpu and not browser" tests \
		--ignore=tests/kernels --ignore=tests/notebooks --ignore=tests/browser
