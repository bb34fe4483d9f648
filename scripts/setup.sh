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
.venv/bin/pip install -q --disable-pip-version-check -e '.[test]'
