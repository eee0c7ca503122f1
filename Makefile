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
# CUDA: the weights are fp16 and the budget also holds the activation reserve measured at start-up (94 MiB kept on the
# H200); the process peaked at 134 MiB at every budget up to 134 (the start-up profile's pool and what it measures),
# so 134 MiB is the least the budget bounds, and 32 requests of 64 tokens then need more KV than it leaves: widths 8.00 -> 7.64 -> 8.00, no preemption, peak
# within (benchmarks/results/run_budgets-nvidia-h200-20261201-s26-fix.json). A budget too small for the reserve is
# refused, naming it
BUDGET ?= $(if $(filter cuda%,$(DEVICE)),134MiB,41MiB)
PROMPTS ?= $(if $(filter cuda%,$(DEVICE)),32,8)
TOKENS ?= $(if $(filter cuda%,$(DEVICE)),64,32)

.PHONY: setup run test
setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

run: setup
	$(PY) -m pagedweight.cli run --model $(MODEL) --gpu-memory-budget $(BUDGET) --device $(DEVICE) \
	  --num-prompts $(PROMPTS) --max-tokens $(TOKENS)

test: setup
	$(PY) -m pytest -q
