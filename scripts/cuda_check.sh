#!/usr/bin/env bash
# The CUDA paths checked and timed on one GPU, in one run: tests/test_cuda.py (CUDA against the CPU and eager
# references), then the GPU rows of the benchmarks (k2-mini forward+backward eager and compiled against
# transformers, Muon against torch.optim.Muon, KDA against fla's kernel, compiled decode). Each step has its
# own time limit and log: OUT_DIR/<step>.log; a summary line per step goes to stdout.
#
# Run it with a python that has a CUDA torch and triton, never this project's .venv (which must stay free of
# triton): PYTHON=python3 scripts/cuda_check.sh OUT_DIR. What that python lacks (pydantic, llguidance, fla...)
# goes on PYTHONPATH beforehand: scripts/cuda_wheels.sh fetches it as wheels. SKIP="step step ..." leaves steps out. fla's kernels autotune at their first call for
# each shape (minutes on an H200), so the steps that need them come last.
set -u
out=${1:?usage: scripts/cuda_check.sh OUT_DIR}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    case " ${SKIP:-} " in *" $name "*) echo "== $name: skipped"; return ;; esac
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    echo "== $name: exit $? after $((SECONDS - start)) s (limit $limit s)"
    tail -n 4 "$out/$name.log" | cut -c1-400
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    "$py" -c "import torch, triton, fla; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, 'fla', fla.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
    lscpu | grep -E "Model name|^CPU\(s\)"
} >"$out/env.log" 2>&1
cat "$out/env.log"

tests=("$py" -m pytest -o addopts="" -p no:cacheprovider -v -rA --durations=0 --timeout 200 tests/test_cuda.py)
step tests 200 "${tests[@]}" -k "not k3 and not fla"
step bench_train 140 "$py" benchmarks/bench_k2_model.py --device cuda --only train --compile-train \
    --batch 16 --seq 1024 --repeats 5 --json
step bench_muon 40 "$py" benchmarks/bench_muon.py --device cuda --repeats 5 --json
step bench_decode 120 "$py" benchmarks/bench_k2_model.py --device cuda --only decode --compile-decode \
    --decode-batch 4 1 --repeats 5 --json
step tests_fla 240 "${tests[@]}" -k "k3 or fla"
step bench_kda 120 "$py" benchmarks/bench_kda.py --device cuda --lengths 1024 4096 16384 --loop-max-t 1024 \
    --repeats 5 --json --cache-png /tmp/kda_cache.png
