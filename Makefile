# Two commands on a fresh machine: `make demo` and `make test`.
# Both create/refresh the virtual environment first (a stamp file makes the second call instant).
PYTHON ?= python3
VENV ?= .venv
# CPU wheel by default so pip never pulls a multi-GB CUDA build; GPU users: make TORCH_SPEC=torch
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.headway-installed
BIN := $(VENV)/bin
OFFLINE := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
PYTEST_ARGS ?=
# Two pytest workers, one torch thread each: most tests are Python-bound on tiny models and use one
# core, and two 2-thread workers on two cores would oversubscribe OpenMP (a ~10x slowdown measured)
PYTEST_WORKERS ?= 2
DEMO_ARGS ?=

.PHONY: demo test venv clean-venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	@$(BIN)/pip install -q --disable-pip-version-check -e ".[dev,plot]" 2>&1 | grep -v "^WARNING: Location" || true
	@$(BIN)/python -c "import headway, torch, transformers, accelerate, datasets, peft" 
	@touch $@

demo: $(STAMP)
	$(BIN)/headway demo $(DEMO_ARGS)

test: $(STAMP)
	$(OFFLINE) OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --durations=15 $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
