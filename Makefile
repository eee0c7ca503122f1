# Two entry points (README): `make run` and `make test`. Each creates .venv and installs from the registries.
# torch==2.13.0 is installed first on its own: pip then takes the CPU wheel on this machine's disk, and the
# project's `torch>=2.11,<2.14` range is already satisfied (an open range downloads a multi-GB CUDA build).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pagedweight-installed
MODEL ?= models/pw-tiny-moe
DEVICE ?= cpu
# CPU: 41 MiB = the bundled model's non-expert weights (9.8 MB) + its experts at 8 bits (29.4 MB, LUTs included) +
# room for a few KV blocks: 8 concurrent requests need more KV than that, so expert widths must drop while they run.
# CUDA: the weights are fp16 and the budget must also hold the activation reserve measured at start-up (the serving
# default there; 94 MiB kept on the H200 since session 25, where 152-178 MiB dropped nothing); 126 MiB is computed from
# those runs to leave the KV room with which 178 MiB dropped widths in session 24, not yet run (README); a budget too
# small for the reserve is refused, naming it
BUDGET ?= $(if $(filter cuda%,$(DEVICE)),126MiB,41MiB)

.PHONY: setup run test
setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

run: setup
	$(PY) -m pagedweight.cli run --model $(MODEL) --gpu-memory-budget $(BUDGET) --device $(DEVICE) --num-prompts 8 \
	  --max-tokens 32

test: setup
	$(PY) -m pytest -q
