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

# The main job: train k2-mini with MuonClip on the embedded standard-library corpus (< 10 min on 2 cores),
# then report validation loss against the unigram baseline. Everything lands in $(DEMO_DIR).
demo: $(STAMP)
	rm -rf $(DEMO_DIR)
	$(BIN)/k2lab train --recipe recipes/k2-mini-demo.toml --out $(DEMO_DIR)
	@echo "run directory: $(DEMO_DIR) (metrics.jsonl, tensorboard/, dashboard.png, sample.txt, checkpoints/, model/)"

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
