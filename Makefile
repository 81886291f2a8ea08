# `make demo` and `make test` each create the virtual environment they need on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# lmms-eval's metadata pins av<16 and pulls a torchvision that replaces the installed torch; statekv[lmms]
# brings what it imports, and lmms-eval itself goes in without its dependencies (docs/evaluation.md)
LMMS_EVAL ?= lmms-eval==0.7.3

.PHONY: demo test env lmms clean

$(BIN)/statekv: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e ".[test]"
	touch $(BIN)/statekv

$(VENV)/.lmms-eval: $(BIN)/statekv
	$(BIN)/pip install -q -c constraints.txt -e ".[test,lmms]"
	$(BIN)/pip install -q -c constraints.txt --no-deps "$(LMMS_EVAL)"
	touch $@

env: $(BIN)/statekv

lmms: $(VENV)/.lmms-eval

demo: env
	$(BIN)/statekv demo

test: env lmms
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache
