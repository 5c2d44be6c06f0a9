# tokencap: the front door. `make help` lists the targets.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONFIG ?= configs/demo.toml
WORKERS ?= 8
N ?= 4
RUNS ?= 30
LOAD ?= 2
# make test runs the test files on this many processes, each file whole on one (pytest-xdist)
TEST_PROCS ?= 2
PYTEST_PROCS = -n $(TEST_PROCS) --dist loadfile --no-loadscope-reorder
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: help install up down workers status test test-fast test-engine lint typecheck soak bench clean

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

$(BIN)/tokencap: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	@touch $@

install: $(BIN)/tokencap ## Create .venv and install tokencap with its test tools

up: install ## Start Redis, the engine (SGLANG_URL, else the simulator, asked for with --sim), writer, budget service, WORKERS consumers; run CONFIG to completion
	$(BIN)/tokencap up $(CONFIG) --workers $(WORKERS) $(if $(SGLANG_URL),,--sim)

down: ## Stop everything `make up` started (nothing running here: said, not an error)
	@if [ -x $(BIN)/tokencap ]; then $(BIN)/tokencap down || [ $$? -eq 7 ]; else echo "nothing to stop (no .venv)"; fi

workers: install ## Add N consumers to the running stack (make workers N=8)
	$(BIN)/tokencap add-workers $(N)

status: install ## Live board of the run started by make up (Ctrl-C to leave)
	$(BIN)/tokencap status --watch

test: install ## ruff, mypy, then every test on TEST_PROCS processes (each starts its own redis-server)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/pytest -q $(PYTEST_PROCS)

test-fast: install ## ruff, mypy, and the tests not marked slow (no fault injection, no 16+ workers)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/pytest -q $(PYTEST_PROCS) -m "not slow"

test-engine: install ## The real-engine tests against vLLM's CPU build, and the trainers' own code on our exports (their venvs and a tiny model made once under ~/.cache/tokencap; TOKENCAP_ENGINE_URL: your own server)
	$(BIN)/python tests/engine/run.py

soak: install ## Fault tests in a loop beside LOAD busy processes until each passes RUNS times in a row
	$(BIN)/python -m tests.soak --runs $(RUNS) --load $(LOAD)

bench: install ## Benchmarks side by side with their baselines (~13 min on 2 cores; writes bench/results.json)
	$(BIN)/python -m bench

lint: install ## ruff
	$(BIN)/ruff check .

typecheck: install ## mypy (strict on foundation/ and budget_service/)
	$(BIN)/mypy

clean: down ## Remove .run/, out/ and .soak/
	rm -rf .run out .soak
