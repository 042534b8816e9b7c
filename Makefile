# tunegate — install, check and test. `make install` makes .venv with everything (torch pinned to a CPU build).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PACKAGES := gateway trainer inference envsdk tunegate bench

.PHONY: install up quickstart lint format typecheck test test-fast clean

install:
	PYTHON=$(PYTHON) VENV=$(VENV) scripts/install

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
