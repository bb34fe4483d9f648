#!/usr/bin/env bash
# llama.cpp's own C++ server (`llama-server`: continuous batching over `--parallel N` slots), built from
# the llama.cpp that llama-cpp-python's source package vendors, in a folder of its own outside the repo,
# plus the HF -> GGUF converter shipped in the same tree and a venv with what the converter imports.
# ~18 min on the 2-core machine with one compile job, so it does not starve the box.
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

# The source package: its vendored llama.cpp holds the server, convert_hf_to_gguf.py and gguf-py.
mkdir -p "$SRC"
SDIST=$(ls "$SRC"/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null || true)
if [ -z "$SDIST" ]; then
  log "downloading the llama-cpp-python==$VERSION source package"
  "$VENV/bin/pip" download --disable-pip-version-check --no-deps --no-binary :all: -d "$SRC" "llama-cpp-python==$VERSION"
  SDIST=$(ls "$SRC"/llama_cpp_python-"$VERSION".tar.gz)
fi
TREE="$SRC/llama_cpp_python-$VERSION"
[ -d "$TREE" ] || tar -xzf "$SDIST" -C "$SRC"
LLAMA="$TREE/vendor/llama.cpp"
CONVERTER="$LLAMA/convert_hf_to_gguf.py"
[ -f "$CONVERTER" ] || { echo "error: $CONVERTER is not in the source package" >&2; exit 1; }

# The converter's imports first (a minute): torch (the CPU build on disk), transformers for the
# tokenizer, sentencepiece, and the gguf-py of the same llama.cpp commit.
log "installing the converter's dependencies"
"${PIP[@]}" torch==2.13.0 transformers sentencepiece safetensors numpy "$LLAMA/gguf-py"
echo "$CONVERTER" > "$ALT_DIR/llamacpp.converter"

# The long part: only the server target, native CPU flags (AVX2 here), no curl (nothing is downloaded).
log "building llama-server with $JOBS compile job(s) (~18 min on 2 cores)"
cmake -S "$LLAMA" -B "$ALT_DIR/llamacpp-build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
cmake --build "$ALT_DIR/llamacpp-build" --target llama-server -j "$JOBS"
mkdir -p "$ALT_DIR/llamacpp/bin"
cp "$ALT_DIR/llamacpp-build/bin/llama-server" "$ALT_DIR/llamacpp/bin/llama-server"

log "checking: llama-server --version"
"$ALT_DIR/llamacpp/bin/llama-server" --version
log "done. Convert: $VENV/bin/python scripts/alternatives/to_gguf.py CHECKPOINT_DIR --out model.gguf [--outtype f32|q8_0]"
log "serve: $ALT_DIR/llamacpp/bin/llama-server -m model.gguf --host 127.0.0.1 --port PORT --parallel N -c $((2048)) --threads 1"
