# Two commands do everything on a fresh machine:
#   make demo   create .venv, install, run the main job
#   make test   create .venv, install, run the whole suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.k2lab-installed
DEV_STAMP := $(VENV)/.k2lab-dev-installed
# --no-compile: pip would byte-compile every installed module (half of the install's time, most of torch's
# files never imported); Python compiles what is imported on first use instead.
PIP := $(BIN)/python -m pip install --quiet --no-compile
# Never triton in .venv: with it, flash-linear-attention and Kimi Linear pick GPU kernels and fail on CPU.
NO_TRITON := @! $(BIN)/python -m pip show triton >/dev/null 2>&1 || (echo "triton is installed in $(VENV); remove it (pip uninstall triton): it breaks CPU paths" && false)
DEMO_DIR ?= runs/demo

.PHONY: demo test lint format bench clean

# The library and what `make demo` needs; the test and benchmark references come with $(DEV_STAMP).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	# The CPU wheel first, pinned: a bare `torch` would pull a multi-GB CUDA build. Never install triton.
	$(PIP) "torch==2.13.0"
	$(PIP) -e .
	$(NO_TRITON)
	touch $(STAMP)

# Parity references (transformers, fla, mlx-lm), pytest and ruff: what `make test`, lint and bench need.
$(DEV_STAMP): $(STAMP)
	$(PIP) -e ".[dev]"
	$(NO_TRITON)
	touch $(DEV_STAMP)

# The main job: train k2-mini with MuonClip on the embedded standard-library corpus (< 10 min on 2 cores),
# then report validation loss against the unigram baseline. Everything lands in $(DEMO_DIR).
demo: $(STAMP)
	rm -rf $(DEMO_DIR)
	$(BIN)/k2lab train --recipe recipes/k2-mini-demo.toml --out $(DEMO_DIR)
	@echo "run directory: $(DEMO_DIR) (metrics.jsonl, tensorboard/, dashboard.png, sample.txt, checkpoints/, model/)"

# The suite on every core (pytest-xdist; TEST_WORKERS=0 runs it in this process): on 2 cores the compiled-step
# tests, a third of the serial time, overlap the rest. worksteal: an idle worker takes queued tests from a busy one.
TEST_WORKERS ?= auto
test: $(DEV_STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist worksteal

lint: $(DEV_STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

format: $(DEV_STAMP)
	$(BIN)/ruff format src tests benchmarks
	$(BIN)/ruff check --fix src tests benchmarks

bench: $(DEV_STAMP)
	$(BIN)/python benchmarks/bench_k2_model.py

clean:
	rm -rf $(VENV) runs .pytest_cache
