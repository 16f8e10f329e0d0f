#!/usr/bin/env bash
# The neon target end to end without ARM hardware: the module cross-compiled against torch's aarch64 wheel, then
# the kernel and decode-stack tests run under qemu-aarch64 with an aarch64 Python, the module loaded from pagoda's
# kernel cache where the engine looks for it. (tests/test_native_kernels.py checks the torch-free cores under qemu
# in every test run; this checks the module, the bindings and the engine paths on top of them.) .ci/run runs it
# after make test.
#
# Needs root (an arm64 dpkg architecture, for `apt-get download`), g++-aarch64-linux-gnu, qemu-user, and PyPI and
# Debian's archive. torch 2.8.0 is the newest aarch64 wheel on PyPI built for CPUs only (later ones are CUDA builds
# that need the CUDA libraries to import); the kernels use no API newer than it.
#
#   scripts/aarch64_check.sh [work directory]     (default /tmp/pagoda-aarch64; reused by later runs)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=${1:-/tmp/pagoda-aarch64}
PY=$ROOT/.venv/bin/python
TORCH_VERSION=2.8.0
TESTS=(tests/test_fast_paths.py tests/test_quantized_kernels.py tests/test_native_decode.py tests/test_lora_kernel.py
       tests/test_correctness.py)
DEBS=(python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libpython3.11-dev libc6 libstdc++6 libgcc-s1
      libgomp1 zlib1g libexpat1 libffi8 libssl3 libbz2-1.0 liblzma5 libsqlite3-0 libncursesw6 libtinfo6 libuuid1
      libnsl2 libtirpc3 libdb5.3 libcrypt1 libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 libcom-err2
      libkeyutils1)
mkdir -p "$WORK"

if [ ! -x "$WORK/sysroot/usr/bin/python3.11" ]; then
    echo "== an aarch64 Python from Debian's archive"
    dpkg --print-foreign-architectures | grep -qx arm64 || { dpkg --add-architecture arm64 && apt-get update -qq; }
    mkdir -p "$WORK/debs" && (cd "$WORK/debs" && apt-get download -qq "${DEBS[@]/%/:arm64}")
    for deb in "$WORK"/debs/*.deb; do dpkg -x "$deb" "$WORK/sysroot"; done
fi

if [ ! -d "$WORK/site/torch" ]; then
    echo "== torch $TORCH_VERSION and pagoda's dependencies, aarch64 wheels at this venv's versions"
    # pagoda's dependencies, torch's and the tests', at this venv's versions (llguidance's newest releases have no
    # aarch64 wheel for this glibc: the newest that has one; grammars are not exercised here)
    packages=(safetensors tokenizers transformers jinja2 numpy tqdm fastapi uvicorn pydantic prometheus-client httpx
              pyzmq msgpack openai redis sympy filelock networkx fsspec typing-extensions pytest pytest-timeout
              hypothesis)
    for package in "${packages[@]}"; do
        version=$("$ROOT/.venv/bin/pip" show "$package" 2>/dev/null | awk '/^Version:/ {print $2}')
        echo "$package${version:+==$version}"
    done > "$WORK/requirements.txt"
    echo llguidance >> "$WORK/requirements.txt"
    platforms=(--platform manylinux_2_34_aarch64 --platform manylinux_2_28_aarch64 --platform manylinux2014_aarch64)
    # pip evaluates markers for this machine, not the target: torch's (x86-only CUDA libraries) are skipped by hand
    "$ROOT/.venv/bin/pip" install -q --target "$WORK/site" --only-binary=:all: --python-version 3.11 \
        "${platforms[@]}" --no-deps "torch==$TORCH_VERSION"
    "$ROOT/.venv/bin/pip" install -q --target "$WORK/site" --only-binary=:all: --python-version 3.11 \
        "${platforms[@]}" -r "$WORK/requirements.txt"
fi

echo "== the neon module, cross-compiled into the kernel cache"
read -r MODULE SOURCES FLAGS < <(PAGODA_CACHE="$WORK/cache" "$PY" -c '
import pagoda.kernels as k
print(k.target_module_path("neon"), ",".join(k.TARGETS["neon"].sources), ",".join(k.TARGETS["neon"].flags))')
NAME=$(basename "$MODULE" .so)
KERNELS=$ROOT/src/pagoda/kernels
TORCH=$WORK/site/torch
OUT=$(dirname "$MODULE")
mkdir -p "$OUT/objects"
if [ ! -f "$OUT/$NAME.so" ]; then
    for source in ${SOURCES//,/ }; do
        aarch64-linux-gnu-g++ -c -fPIC -std=c++17 ${FLAGS//,/ } -DTORCH_EXTENSION_NAME="$NAME" \
            -DTORCH_API_INCLUDE_EXTENSION_H -D_GLIBCXX_USE_CXX11_ABI=1 -w -I"$TORCH/include" \
            -I"$TORCH/include/torch/csrc/api/include" -I"$WORK/sysroot/usr/include/python3.11" \
            -I"$WORK/sysroot/usr/include" "$KERNELS/$source" -o "$OUT/objects/${source%.cpp}.o" &
    done
    wait
    aarch64-linux-gnu-g++ -shared -fopenmp "$OUT"/objects/*.o -L"$TORCH/lib" -lc10 -ltorch -ltorch_cpu \
        -ltorch_python -o "$OUT/$NAME.tmp.so"
    mv "$OUT/$NAME.tmp.so" "$OUT/$NAME.so"
fi

echo "== ${TESTS[*]} under qemu-aarch64 (the neon target is the one the engine picks there)"
mkdir -p "$WORK/home"
qemu-aarch64 -L "$WORK/sysroot" -E PYTHONPATH="$ROOT/src:$ROOT/tests:$WORK/site" \
    -E PAGODA_CACHE="$WORK/cache" -E HOME="$WORK/home" -E OMP_NUM_THREADS=1 \
    "$WORK/sysroot/usr/bin/python3.11" -m pytest -q -p no:cacheprovider "${TESTS[@]}"
