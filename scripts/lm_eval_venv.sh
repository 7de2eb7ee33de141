#!/usr/bin/env bash
# Build lm-evaluation-harness in a venv of its own (never k2lab's .venv), reproducibly:
#   scripts/lm_eval_venv.sh [VENV]        (default: $LM_EVAL_VENV or ~/.cache/k2lab/lm-eval-venv)
# The CPU torch wheel is pinned first (a bare `torch` would pull a multi-GB CUDA build and triton), then
# lm-eval with its API extra (local-completions). The script fails if triton ended up installed.
set -euo pipefail
VENV="${1:-${LM_EVAL_VENV:-$HOME/.cache/k2lab/lm-eval-venv}}"
PYTHON="${PYTHON:-python3}"
LM_EVAL_VERSION="${LM_EVAL_VERSION:-0.4.13}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet "torch==$TORCH_VERSION"
"$VENV/bin/python" -m pip install --quiet "lm-eval[api]==$LM_EVAL_VERSION" "torch==$TORCH_VERSION"
if "$VENV/bin/python" -m pip show triton >/dev/null 2>&1; then
    echo "triton is installed in $VENV: remove it (pip uninstall triton), it breaks CPU paths" >&2
    exit 1
fi
"$VENV/bin/python" -c "import lm_eval, torch; print('lm_eval', lm_eval.__version__, 'torch', torch.__version__)"
echo "$VENV"
