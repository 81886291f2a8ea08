# `make demo` and `make test` each create the virtual environment they need on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: demo test env clean

$(BIN)/statekv: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e ".[test]"
	touch $(BIN)/statekv

env: $(BIN)/statekv

demo: env
	$(BIN)/statekv demo

test: env
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache
