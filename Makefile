# Two commands on a fresh Linux machine with Python 3.11:
#   make serve   virtualenv + install + start the service (GPU when present, else CPU)
#   make test    virtualenv + install + the whole test suite
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch for tests and CI (a bare `torch` would pull a multi-GB CUDA build).
TORCH_CPU ?= torch==2.13.0

.PHONY: venv install install-test serve test lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

venv: $(BIN)/python

install: venv
	@if command -v nvidia-smi >/dev/null 2>&1; then \
	  $(BIN)/pip install -q -e .; \
	else \
	  $(BIN)/pip install -q $(TORCH_CPU) && $(BIN)/pip install -q -e .; \
	fi

install-test: venv
	$(BIN)/pip install -q $(TORCH_CPU)
	$(BIN)/pip install -q -e '.[test]'

serve: install
	$(BIN)/rev88 serve

test: install-test
	$(BIN)/python -m pytest -q

lint: install-test
	$(BIN)/ruff check learner app tests bench scripts

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
