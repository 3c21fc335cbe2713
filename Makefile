# make demo  - set up the virtualenv and run the main job
# make test  - set up the virtualenv and run the default test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: demo test test-slow lint venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c constraints.txt -e '.[dev]'
	$(PY) -m polysketch.data.fetch
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/polysketch demo

test: $(STAMP)
	$(PY) -m pytest -n 2 -q

test-slow: $(STAMP)
	$(PY) -m pytest -n 2 -q -m slow || test $$? -eq 5  # 5: no slow test selected

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
