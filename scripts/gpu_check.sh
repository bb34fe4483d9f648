#!/usr/bin/env bash
# The GPU check: preflight, the gpu-marked tests, fla's warm-up, then the engines at the h200 preset
# (the reference baseline, the Triton and torch genomes, the other baselines), then the kimi_linear
# model at its h200 preset (hf_static, the reference; our default genome; one_at_a_time) on a small trace
# (configs/kimi_linear_h200.yaml with 16 requests, 16 in flight, prompts 128-512, outputs 16-64, one timed
# replay; its share, 20%, kept from the end of the budget), one row each as it finishes, in one table.
# The dry run's model is configs/kimi_linear_smoke.yaml at cpu_small (4 requests, outputs 1-8). Under 8
# minutes on one H200 by construction: scripts/gpu_check.py divides a time budget (BUDGET_S, default
# 420 s) among the parts, stops a part at its share, lists what the budget did not reach as "not
# reached", and always writes the table (test failures go into its header; there is no early exit).
# Runs from the source tree (no `pip install -e .`), needs neither Ray nor MLflow, and installs nothing
# from an index: wheels in .whl/ (scripts/fetch_wheels.sh: fla-core and einops; .whl/ is gitignored, so
# carry it to the device) are installed with --no-index --no-deps first, on the GPU run only.
#
#   scripts/gpu_check.sh             # on a GPU box
#   scripts/gpu_check.sh --dry-run   # the same on CPU: cpu_small presets, Triton's interpreter
#
# Environment: PYTHON (default .venv/bin/python if present, else python3), OUT (output folder),
# BUDGET_S, BASELINES (comma-separated; default fla_chunk_kda, fla_fused_recurrent_kda and
# chunk_pairwise_c64: a named baseline that cannot load fails the check loudly), GENOMES (genome file),
# TESTS (pytest arguments, or "none"). Exit code 1 when a test failed, a named baseline did not load or
# a part crashed; 0 otherwise ("not reached" rows included: that is the budget at work).
set -uo pipefail  # no -e: every part reports, and the table is always written
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
case "${1:-}" in
  --dry-run|"") ;;
  *) echo "usage: scripts/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac
if [ "${1:-}" != "--dry-run" ] && compgen -G ".whl/*.whl" >/dev/null; then
  timeout 60 "$PYTHON" -m pip install -q --no-index --no-deps .whl/*.whl \
    || echo "warning: the wheels in .whl/ did not install (the fla baselines will say why they fail)" >&2
fi
exec "$PYTHON" scripts/gpu_check.py "$@"
