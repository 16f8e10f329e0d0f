#!/usr/bin/env bash
# Build llama.cpp's server and quantizer from the tree vendored in PyPI's llama-cpp-python sdist (pinned),
# and convert a pagoda bench model to GGUF in the types the side-by-sides compare. Nothing is committed:
# everything lands under $LLAMA_CPP_DIR (default /tmp/llama-cpp).
#
#   benchmarks/llama_cpp.sh build                      # llama-server, llama-quantize (native CPU flags)
#   benchmarks/llama_cpp.sh build-no-amx               # the same into $LLAMA_CPP_DIR/build-no-amx, AVX-512 but no AMX
#   benchmarks/llama_cpp.sh build-avx2                 # into $LLAMA_CPP_DIR/build-avx2: AVX2 + FMA, no AVX-512
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

# build [directory] [cmake flags...]: llama-server and llama-quantize, native CPU flags unless overridden.
build() {
  local build_dir=${1:-$DIR/build}
  shift || true
  mkdir -p "$DIR"
  if [ ! -d "$SRC" ]; then
    "$PYTHON" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DIR" -q
    tar -xzf "$DIR/llama_cpp_python-$VERSION.tar.gz" -C "$DIR"
  fi
  cmake -S "$SRC" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON "$@"
  cmake --build "$build_dir" -j "$(nproc)" --target llama-server llama-quantize
  "$build_dir/bin/llama-server" --version 2>&1 | head -2
}

# On a CPU with AMX whose virtual machine does not grant the tiles, the native build's AMX path stops
# llama-server with an illegal instruction as it loads a quantized GGUF. This build names the AVX-512 features
# instead, AMX off, so that its weight repacking (its fastest CPU kernels) runs.
build-no-amx() {
  build "$DIR/build-no-amx" -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
    -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON \
    -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
}

# AVX2 + FMA + F16C and nothing newer: what llama.cpp runs on an AVX2-only CPU (and, on a bigger host, the
# build that matches pagoda's avx2 target). Its llama-server is $LLAMA_CPP_DIR/build-avx2/bin/llama-server.
build-avx2() {
  build "$DIR/build-avx2" -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
    -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
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
