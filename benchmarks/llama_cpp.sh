#!/usr/bin/env bash
# Build llama.cpp's server and quantizer from the tree vendored in PyPI's llama-cpp-python sdist (pinned),
# and convert a pagoda bench model to GGUF in the types the side-by-sides compare. Nothing is committed:
# everything lands under $LLAMA_CPP_DIR (default /tmp/llama-cpp).
#
#   benchmarks/llama_cpp.sh build                      # llama-server, llama-quantize (native CPU flags)
#   benchmarks/llama_cpp.sh gguf models/bench-1b       # f32, bf16, q8_0 and Q4_K_M GGUFs of that model
#   benchmarks/llama_cpp.sh server <gguf> <port> [extra llama-server flags]
#
# The GGUF conversion runs llama.cpp's own convert_hf_to_gguf.py (through gguf_convert.py, which names the
# bench tokenizers' pre-tokenizer for it) with the vendored gguf-py, in the
# caller's Python (pagoda's .venv has most of what it imports: torch, numpy, transformers, safetensors);
# sentencepiece, which its Llama converter imports, goes to $LLAMA_CPP_DIR/pydeps, not into the venv.
set -euo pipefail

VERSION=0.3.36  # llama-cpp-python; its vendor/llama.cpp is the llama.cpp revision measured
DIR=${LLAMA_CPP_DIR:-/tmp/llama-cpp}
PYTHON=${PYTHON:-.venv/bin/python}
SRC="$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp"
BIN="$DIR/build/bin"

build() {
  mkdir -p "$DIR"
  if [ ! -d "$SRC" ]; then
    "$PYTHON" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DIR" -q
    tar -xzf "$DIR/llama_cpp_python-$VERSION.tar.gz" -C "$DIR"
  fi
  cmake -S "$SRC" -B "$DIR/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
  cmake --build "$DIR/build" -j "$(nproc)" --target llama-server llama-quantize
  "$BIN/llama-server" --version 2>&1 | head -2
}

gguf() {
  local model=$1 name
  name=$(basename "$model")
  [ -d "$DIR/pydeps/sentencepiece" ] || "$PYTHON" -m pip install -q --target "$DIR/pydeps" sentencepiece
  for type in f32 bf16 q8_0; do
    local out="$DIR/$name-$type.gguf"
    [ -f "$out" ] || PYTHONPATH="$DIR/pydeps" "$PYTHON" "$(dirname "$0")/gguf_convert.py" "$SRC" "$model" \
      --outtype "$type" --outfile "$out"
  done
  [ -f "$DIR/$name-q4_k_m.gguf" ] || "$BIN/llama-quantize" "$DIR/$name-f32.gguf" "$DIR/$name-q4_k_m.gguf" Q4_K_M
  ls -l "$DIR"/"$name"-*.gguf
}

server() {
  local model=$1 port=$2
  shift 2
  exec "$BIN/llama-server" -m "$model" --host 127.0.0.1 --port "$port" "$@"
}

"$@"
