#!/usr/bin/env bash
# llama.cpp through llama-cpp-python[server], built from source in a venv of its own outside the repo,
# plus the HF -> GGUF converter shipped inside the same source package (and what it imports).
# The build is ~48 min on the 2-core machine: one compile job, so it does not starve the box.
#
#   nice -n 19 bash scripts/alternatives/setup_llamacpp.sh > /work/alt/logs/llamacpp.log 2>&1 &
#
# Converting a checkpoint folder, then serving it: see scripts/alternatives/README.md.
set -euo pipefail
ALT_DIR=${ALT_DIR:-/work/alt}
VENV=${LLAMACPP_VENV:-$ALT_DIR/llamacpp}
SRC=${LLAMACPP_SRC:-$ALT_DIR/llamacpp-src}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
JOBS=${BUILD_JOBS:-1}
PYTHON=${PYTHON:-python3.11}
PIP=("$VENV/bin/pip" install --disable-pip-version-check --progress-bar off)
log() { echo "[setup_llamacpp $(date +%H:%M:%S)] $*"; }

[ -x "$VENV/bin/python" ] || { log "creating $VENV"; "$PYTHON" -m venv "$VENV"; }

# The source package: built below, and its vendored llama.cpp holds convert_hf_to_gguf.py and gguf-py.
mkdir -p "$SRC"
SDIST=$(ls "$SRC"/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null || true)
if [ -z "$SDIST" ]; then
  log "downloading the llama-cpp-python==$VERSION source package"
  "$VENV/bin/pip" download --disable-pip-version-check --no-deps --no-binary :all: -d "$SRC" "llama-cpp-python==$VERSION"
  SDIST=$(ls "$SRC"/llama_cpp_python-"$VERSION".tar.gz)
fi
TREE="$SRC/llama_cpp_python-$VERSION"
[ -d "$TREE" ] || tar -xzf "$SDIST" -C "$SRC"
CONVERTER="$TREE/vendor/llama.cpp/convert_hf_to_gguf.py"
[ -f "$CONVERTER" ] || { echo "error: $CONVERTER is not in the source package" >&2; exit 1; }

# The converter's imports first (a minute): torch (the CPU build on disk), transformers for the
# tokenizer, sentencepiece, and the gguf-py of the same llama.cpp commit.
log "installing the converter's dependencies"
"${PIP[@]}" torch==2.13.0 transformers sentencepiece safetensors numpy "$TREE/vendor/llama.cpp/gguf-py"

# The long part. CMAKE_BUILD_PARALLEL_LEVEL bounds `cmake --build` (scikit-build-core) to JOBS jobs.
log "building llama-cpp-python[server]==$VERSION with $JOBS compile job(s) (~48 min on 2 cores)"
CMAKE_BUILD_PARALLEL_LEVEL=$JOBS MAKEFLAGS="-j$JOBS" \
CMAKE_ARGS="${CMAKE_ARGS:-} -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF" \
  "${PIP[@]}" -v "$SDIST[server]"

log "checking: import llama_cpp, the server module"
"$VENV/bin/python" -c 'import llama_cpp; print("llama_cpp", llama_cpp.__version__)'
"$VENV/bin/python" -m llama_cpp.server --help > /dev/null
echo "$CONVERTER" > "$ALT_DIR/llamacpp.converter"
log "done. Convert: $VENV/bin/python scripts/alternatives/to_gguf.py CHECKPOINT_DIR --out model.gguf"
log "serve: $VENV/bin/python -m llama_cpp.server --model model.gguf --host 127.0.0.1 --port PORT --interrupt_requests False"
