# Two entry points (README): `make run` and `make test`. Each creates .venv and installs from the registries.
# torch==2.13.0 is installed first on its own: pip then takes the CPU wheel on this machine's disk, and the
# project's `torch>=2.11,<2.14` range is already satisfied (an open range downloads a multi-GB CUDA build).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pagedweight-installed
MODEL ?= models/pw-tiny-moe
BUDGET ?= 0.6

.PHONY: setup run test
setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

run: setup
	$(PY) -m pagedweight.cli run --model $(MODEL) --weight-budget-frac $(BUDGET)

test: setup
	$(PY) -m pytest -q
