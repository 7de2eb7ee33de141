#!/usr/bin/env bash
# Wheels for a GPU machine's own python (3.12, x86-64 manylinux) of what k2lab imports that a torch + triton
# image usually lacks: pydantic and its parts, the trainer's tool-call grammar (llguidance, jsonschema and its
# parts), gguf, and flash-linear-attention for the KDA kernels. The versions are those of this project's .venv,
# so the GPU run imports what the suite tests. Run here (it downloads), carry the folder, and there:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site WHEEL_DIR/*.whl && export PYTHONPATH=/tmp/site
# Usage: scripts/cuda_wheels.sh [WHEEL_DIR]   (default .whl; add it to .git/info/exclude)
set -euo pipefail
dir=${1:-.whl}
venv_python=${VENV_PYTHON:-.venv/bin/python}
packages=(pydantic pydantic-core annotated-types typing-inspection typing-extensions annotated-doc llguidance
    jsonschema jsonschema-specifications referencing rpds-py gguf fla-core flash-linear-attention)
pins=()
for package in "${packages[@]}"; do
    version=$("$venv_python" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$package")
    pins+=("$package==$version")
done
mkdir -p "$dir"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 $(printf -- "--platform manylinux_2_%s_x86_64 " 24 27 28 31 34 35 39) \
    -d "$dir" "${pins[@]}"
ls "$dir"
