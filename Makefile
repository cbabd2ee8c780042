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

test: install
	$(BIN)/python -m pytest -q

# the edit-test loop: everything but the tests marked slow (see pyproject.toml's markers)
test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

test-faults: install
	$(BIN)/python -m pytest -q -m faults

# the style rules and the layering contract (pyproject.toml; the test suite checks both too)
lint: install
	$(BIN)/ruff check megamlm tests benchmarks
	$(BIN)/lint-imports --no-cache

clean:
	rm -rf $(VENV) *.egg-info
