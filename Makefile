# `make demo` and `make test` work on a fresh machine with only Python 3.11.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install demo test lint bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

demo: install
	$(BIN)/ddl-jax compare --out compare-results
	@echo "table: compare-results/results.md (all numbers: results.json); figures: compare-results/*.png"

test: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest

bench: install
	$(BIN)/python -m pip install --quiet -e '.[dev,bench]' || echo "no PyTorch: benchmarks/peers.py's PyTorch rows say 'not installed'"
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/allreduce.py
	$(BIN)/python benchmarks/averaging.py
	$(BIN)/python benchmarks/gradient_compression.py
	$(BIN)/python -P benchmarks/async.py
	$(BIN)/python benchmarks/pipeline.py
	$(BIN)/python benchmarks/ddg_stability.py
	$(BIN)/python benchmarks/fsdp.py
	$(BIN)/python benchmarks/low_communication.py
	$(BIN)/python benchmarks/peers.py
	$(BIN)/python benchmarks/buckets.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
