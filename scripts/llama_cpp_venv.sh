#!/usr/bin/env bash
# Build llama-cpp-python (CPU backend, compiled from source by pip) in a venv of its own, never k2lab's .venv:
#   scripts/llama_cpp_venv.sh [VENV]      (default: $LLAMA_CPP_VENV or ~/.cache/k2lab/llama-venv)
# Idempotent: a venv whose llama_cpp already imports at the pinned version is left as it is. The build is
# slow (about 20 minutes on 2 cores): run it in the background under `nice`. CMAKE_ARGS keeps the plain CPU
# backend (no CUDA/Metal/BLAS) with native SIMD; numpy is installed beside it for scripts/llama_cpp_check.py.
set -euo pipefail
VENV="${1:-${LLAMA_CPP_VENV:-$HOME/.cache/k2lab/llama-venv}}"
PYTHON="${PYTHON:-python3}"
LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"

check() {
    "$VENV/bin/python" -c "import llama_cpp, sys; v = llama_cpp.__version__; print('llama_cpp', v); \
sys.exit(v != '$LLAMA_CPP_PYTHON_VERSION')" 2>/dev/null
}
if test -x "$VENV/bin/python" && check; then
    echo "$VENV"
    exit 0
fi
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet numpy
CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_BLAS=OFF -DLLAMA_CURL=OFF}" \
CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
    "$VENV/bin/python" -m pip install --no-cache-dir --verbose "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" \
    > "$VENV/build.log" 2>&1 || { tail -40 "$VENV/build.log" >&2; exit 1; }
check
echo "$VENV"
