# Two commands do everything on a fresh machine:
#   make demo   create .venv, install, run the main job
#   make test   create .venv, install, run the whole suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.k2lab-installed
DEMO_DIR ?= runs/demo

.PHONY: demo test lint format bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# The CPU wheel first, pinned: a bare `torch` would pull a multi-GB CUDA build. Never install triton.
	$(BIN)/python -m pip install --quiet "torch==2.13.0"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	@! $(BIN)/python -m pip show triton >/dev/null 2>&1 || (echo "triton is installed in $(VENV); remove it (pip uninstall triton): it breaks CPU paths" && false)
	touch $(STAMP)

# Until the training issue lands the demo builds k2-mini, reports its parameters (and K2's, exactly, on
# the meta device), writes a random-weight checkpoint and generates tokens through the latent cache.
demo: $(STAMP)
	$(BIN)/k2lab params --preset k2
	$(BIN)/k2lab params --preset k2-mini
	$(BIN)/k2lab init --preset k2-mini --out $(DEMO_DIR)
	$(BIN)/k2lab generate --checkpoint $(DEMO_DIR) --prompt "1 2 3 4" --prompt "5 6" --max-new-tokens 24
	@echo "demo checkpoint: $(DEMO_DIR)"

test: $(STAMP)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

format: $(STAMP)
	$(BIN)/ruff format src tests benchmarks
	$(BIN)/ruff check --fix src tests benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_k2_model.py

clean:
	rm -rf $(VENV) runs .pytest_cache
