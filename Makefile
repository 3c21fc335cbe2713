# make demo  - set up the virtualenv (polysketch[dev]: test, eval and plot extras) and run the main job
# make test  - set up the virtualenv and run the default test suite
# make test-gpu - the CUDA-only checks (tests/gpu) on a machine with a CUDA torch
# make gpu-check - the whole GPU check in one lease (<= 6 min on one H100): tests/gpu and
#                  every speed figure, into one folder (GPU_CHECK_OUT, default gpu-check/)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: demo test test-slow test-gpu gpu-check lint venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c constraints.txt -e '.[dev]'
	$(PY) -m polysketch.data.fetch
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/polysketch demo --overwrite  # the report in demo-report/ is regenerated on every run

test: $(STAMP)
	$(PY) -m pytest -n 2 -q

test-slow: $(STAMP)
	$(PY) -m pytest -n 2 -q -m slow || test $$? -eq 5  # 5: no slow test selected

# CUDA-only checks (tests/gpu, skipped elsewhere) with a Python whose torch has CUDA: the
# .venv pins the CPU wheel, so this uses $(GPU_PYTHON) on the source tree (needs pytest).
GPU_PYTHON ?= python3
test-gpu:
	PYTHONPATH=src $(GPU_PYTHON) -m pytest -q -p no:cacheprovider -o addopts="" tests/gpu

# tests/gpu, the attention training bench (default dispatch and every fast path, 1k-64k), model
# tokens/s and peak memory, decode ms/token vs softmax's KV cache; each stage under a time
# budget; summary.md, CSVs and a log in $(GPU_CHECK_OUT) (refused if not empty); exit 1 if a
# test fails (benchmarks/gpu_check.py; `--smoke` is its CPU dry run, run by make test).
GPU_CHECK_OUT ?= gpu-check
gpu-check:
	PYTHONPATH=src $(GPU_PYTHON) benchmarks/gpu_check.py --out $(GPU_CHECK_OUT)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks experiments examples

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
