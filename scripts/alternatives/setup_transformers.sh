#!/usr/bin/env bash
# `transformers serve` in a venv of its own, outside the repo. From the project's .venv it does not start:
# transformers 5.24 loads the model with a device_map, which needs `accelerate` (not a project dependency),
# so the served model fails to load ("... requires `accelerate`"). ~2 min: torch is the CPU build on disk.
#
#   nice -n 19 bash scripts/alternatives/setup_transformers.sh > /work/alt/logs/transformers.log 2>&1
set -euo pipefail
ALT_DIR=${ALT_DIR:-/work/alt}
VENV=${TRANSFORMERS_VENV:-$ALT_DIR/transformers}
VERSION=${TRANSFORMERS_VERSION:-5.24.0}
PYTHON=${PYTHON:-python3.11}
log() { echo "[setup_transformers $(date +%H:%M:%S)] $*"; }

[ -x "$VENV/bin/python" ] || { log "creating $VENV"; "$PYTHON" -m venv "$VENV"; }
log "pip install torch==2.13.0 (CPU build) transformers[serving]==$VERSION accelerate"
"$VENV/bin/pip" install --disable-pip-version-check --progress-bar off torch==2.13.0 \
  "transformers[serving]==$VERSION" accelerate
log "checking: the CLI"
"$VENV/bin/transformers" serve --help > /dev/null
"$VENV/bin/python" -c 'import transformers, accelerate, torch; print("transformers", transformers.__version__, "accelerate", accelerate.__version__, "torch", torch.__version__)'
log "done: $VENV/bin/transformers serve CHECKPOINT_DIR --host 127.0.0.1 --port PORT --device cpu --dtype float32"
