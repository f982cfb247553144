# spotnik-lightning — developer entry points.
#
#   make demo    set everything up, then run the main demo (Lightning workers train; one is killed,
#                one gets SIGTERM, one joins; a timeline is printed)
#   make test    set everything up, then lint and run the whole test suite
#
# `setup` is meant for a fresh Debian machine (run as root, or as a user with sudo): it creates
# .venv, installs torch $(TORCH_VERSION) FIRST (the local CPU wheel that plain pip finds here),
# then the project with its dev extras under a constraint that pins torch — so pip can never
# resolve another torch — and finally etcd-server via apt when no `etcd` binary is on PATH.
# A stamp file makes repeated `make test` skip all of that until pyproject.toml or this file change.

SHELL := /bin/bash
.DEFAULT_GOAL := test

PYTHON        ?= python3
TORCH_VERSION ?= 2.13.0
VENV          := .venv
PY            := $(VENV)/bin/python
PIP           := $(VENV)/bin/pip
STAMP         := $(VENV)/.stamp-setup
CONSTRAINTS   := $(VENV)/torch-constraint.txt

# Empty when we are root; "sudo" when we are not and sudo exists (otherwise apt-get fails loudly).
SUDO := $(shell [ "$$(id -u)" = 0 ] || command -v sudo)

# Directories that are linted, restricted to the ones present (git does not keep empty dirs).
LINT_PATHS := $(wildcard src tests benchmarks examples)

.PHONY: setup test lint demo ring-demo bench docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || { echo "creating $(VENV)"; $(PYTHON) -m venv $(VENV); }
	$(PIP) install "torch==$(TORCH_VERSION)"
	@echo "torch==$(TORCH_VERSION)" > $(CONSTRAINTS)
	$(PIP) install -c $(CONSTRAINTS) -e '.[dev]'
	@$(PY) -c 'import torch, sys; v = torch.__version__.split("+")[0]; \
	  sys.exit(0 if v == "$(TORCH_VERSION)" else f"expected torch $(TORCH_VERSION), got {torch.__version__}")'
	@if command -v etcd >/dev/null 2>&1; then \
	  echo "etcd found: $$(command -v etcd)"; \
	else \
	  echo "etcd not found: installing etcd-server with apt-get"; \
	  $(SUDO) apt-get update && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y etcd-server && \
	  command -v etcd; \
	fi
	@touch $@

test: setup
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check $(LINT_PATHS)

demo: setup
	$(PY) examples/lightning_demo.py

ring-demo: setup
	$(PY) examples/ring_demo.py

bench: setup
	$(PY) -m spotnik_lightning.cli bench allreduce --json
	$(PY) -m spotnik_lightning.cli bench recovery --json
	$(PY) benchmarks/lightning_bench.py step --repeat 3
	$(PY) benchmarks/lightning_bench.py commit --steps 160 --repeat 2 --tag _interleaved
	$(PY) benchmarks/lightning_bench.py commit --steps 160 --repeat 2 --workers 2 --tag _interleaved_2workers
	$(PY) benchmarks/lightning_bench.py commit --plot benchmarks/out/lightning_commit_interleaved.json \
		benchmarks/out/lightning_commit_interleaved_2workers.json
	$(PY) benchmarks/lightning_bench.py revocation
	$(PY) benchmarks/lightning_bench.py join

docs: setup
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache site build dist src/*.egg-info
	find . -path ./.git -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +
