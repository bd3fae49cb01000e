#!/usr/bin/env bash
# GPU-only checks of the colocated hand-off, on one CUDA device, in under 5 minutes:
#   bash tests/gpu/run_gpu_checks.sh            (PYTHON=... to pick the interpreter; default: .venv's, else python3)
# Not part of `make test` (CPU CI): pytest collects nothing here (no test_*.py files).
# Needs torch with CUDA, lightning and transformers; torch_memory_saver and the GPU vllm package are optional
# (their checks SKIP without them, and say so).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
export PYTHONUNBUFFERED=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
# 1. The CPU offload tests again, now with the cuda device parameter (pinned host copies, a real round trip).
timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_offload.py
# 2. Offload, torch_memory_saver, the Callback in a CUDA fit, vLLM sleep levels.
timeout 240 "$PY" tests/gpu/check_handoff.py
