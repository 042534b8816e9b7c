# tunegate — install, check and test. `make install` makes .venv with everything (torch pinned to a CPU build).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PACKAGES := gateway trainer inference envsdk tunegate bench

.PHONY: install up quickstart lint format typecheck test test-fast clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV) || { apt-get update && apt-get install -y python3-venv && $(PYTHON) -m venv $(VENV); }
	$(BIN)/pip install --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install "torch==2.13.0"
	$(BIN)/pip install -e ".[dev]"
	@command -v bwrap >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && \
		(apt-get update && apt-get install -y bubblewrap) || \
		echo "note: install bubblewrap to sandbox environment packages"; }

up: install
	$(BIN)/tunegate up

quickstart: install
	$(BIN)/tunegate quickstart

lint:
	$(BIN)/ruff check $(PACKAGES) tests
	$(BIN)/ruff format --check $(PACKAGES) tests

format:
	$(BIN)/ruff check --fix $(PACKAGES) tests
	$(BIN)/ruff format $(PACKAGES) tests

typecheck:
	$(BIN)/mypy $(PACKAGES)

test:
	$(BIN)/python -m pytest

test-fast:
	$(BIN)/python -m pytest -m "not slow"

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
