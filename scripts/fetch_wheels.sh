#!/usr/bin/env bash
# Download (never install) the wheels the GPU check's fla baselines need on the H200 machine, which
# reaches no package registry: fla-core and einops, without dependencies (the device's own torch and
# triton must stay), built for its Python (3.12) and platform (manylinux x86_64), into .whl/.
#
#   scripts/fetch_wheels.sh            # on a machine with a registry, before the GPU check
#
# .whl/ is gitignored: send it along with the device tool's `carry: [".whl"]` (a few MB);
# scripts/gpu_check.sh installs whatever lies there with `pip install --no-index --no-deps`.
# Environment: PYTHON (default .venv/bin/python if present, else python3), WHEELS (the folder, .whl),
# FLA_VERSION (0.6.0), EINOPS_VERSION (0.8.2), PY_VERSION (3.12), PLATFORM (manylinux2014_x86_64).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
WHEELS=${WHEELS:-.whl}
mkdir -p "$WHEELS"
status=0
for req in "fla-core==${FLA_VERSION:-0.6.0}" "einops==${EINOPS_VERSION:-0.8.2}"; do
  if ! "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "${PY_VERSION:-3.12}" \
      --implementation cp --platform "${PLATFORM:-manylinux2014_x86_64}" -d "$WHEELS" "$req"; then
    echo "fetch_wheels: $req did not download (registry unreachable or no wheel for this platform)" >&2
    status=1
  fi
done
ls -l "$WHEELS"/*.whl 2>/dev/null
exit $status
