# Two commands for a fresh machine (each creates .venv and installs what it needs first):
#   make demo   - the main job on the tiny model
#   make test   - the test suite
# torch: the CPU wheel torch==2.13.0. Where pip would pick a CUDA build for that version, point it
# at PyTorch's CPU index:  make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
BIN := $(VENV)/bin

.PHONY: demo test test-fast test-faults lint install clean

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/activate setup.py
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

install: $(VENV)/.installed

# --resume auto: a second `make demo` (or one after Ctrl-C) continues the run in runs/demo instead of
# refusing it; the first one on a fresh clone starts from update 0
demo: install
	$(BIN)/megamlm train --config configs/demo.yaml --resume auto --fill-mask "The capital of France is <mask>."

# Two pytest workers (pytest-xdist), a test file each at a time (module fixtures built once): on 2 cores
# the serial suite left ~30% of the CPU idle (one-thread tests, processes starting); two workers at one
# OpenMP thread each (tests/conftest.py) take ~20-28 minutes (BENCHMARKS.md, "The test suite's wall time",
# has every measured run). The longest files start first (tests/conftest.py: LONGEST_FIRST;
# --no-loadscope-reorder keeps that order), so the workers end together. Temp files peak at ~2 GB: a
# passing test's folders are removed as it ends (pyproject, tests/conftest.py); the checkout holds no test
# output afterwards. TEST_WORKERS=0 runs it in this process, one test at a time.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

test: install
	$(PYTEST)

# the edit-test loop: everything but the tests marked slow (see pyproject.toml's markers)
test-fast: install
	$(PYTEST) -m "not slow"

test-faults: install
	$(PYTEST) -m faults

# the style rules and the layering contract (pyproject.toml; the test suite checks both too)
lint: install
	$(BIN)/ruff check megamlm tests benchmarks
	$(BIN)/lint-imports --no-cache

clean:
	rm -rf $(VENV) *.egg-info
