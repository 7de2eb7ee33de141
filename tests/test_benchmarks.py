"""Every script in benchmarks/ still runs: its smoke mode (tiny shapes, one repeat) in a fresh process.

An API change that breaks a benchmark breaks this test; the figures themselves are not checked (performance
is measured by running the scripts, never asserted in tests).
"""

import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name != "timing.py")
SMOKE_ARGS = {
    "bench_agentic_rl.py": ["--json"],
    "bench_k2_model.py": ["--json"],
    "bench_k3_step.py": ["--json"],
    "bench_kda.py": ["--json", "--cache-png", "kda.png"],
    "bench_muon.py": ["--json"],
    "bench_rl_update.py": [],
    "bench_serve_compile.py": ["--json"],
    "bench_serve_prefix.py": ["--json"],
    "bench_serve_speculative.py": ["--json"],
    "bench_train.py": ["--json"],
    "cache_bytes.py": ["--png", "cache.png"],
}


def test_every_benchmark_has_a_smoke_run():
    assert set(SCRIPTS) == set(SMOKE_ARGS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_smoke_run(script, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    command = [sys.executable, str(ROOT / "benchmarks" / script), "--smoke", *SMOKE_ARGS[script]]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if "--json" in SMOKE_ARGS[script] or script == "bench_rl_update.py":
        machine = [json.loads(line) for line in lines]
        text = json.dumps(machine)
        assert '"capability"' in text and "peak_gflops" in text  # every table states its machine


def test_alternating_medians_rotate_the_order_of_the_sides(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from timing import STEADY_ROUNDS, alternating_medians

    calls: list[str] = []
    medians = alternating_medians([lambda n=n: calls.append(n) for n in "abc"], repeats=3, warmup=1)
    assert len(medians) == 3
    # the warm-up's quiet rounds, then one rotation a round
    assert "".join(calls) == "abc" * STEADY_ROUNDS + "abc" + "bca" + "cab"


@pytest.mark.parametrize("mode", ["on", "off"])
def test_bench_k3_step_passes_its_compile_flag_to_both_trainers(mode, monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_k3_step

    args = bench_k3_step.parse_args(["--compile", mode])
    for recipe in args.presets:
        assert bench_k3_step.trainer_config(recipe, args, tmp_path).compile == mode


def _touch_fresh_pages(pages: int = 4096) -> None:
    """Map ``pages`` fresh pages and write one byte to each: that many minor page faults."""
    with mmap.mmap(-1, pages * mmap.PAGESIZE) as memory:
        for offset in range(0, len(memory), mmap.PAGESIZE):
            memory[offset] = 1


def test_warm_until_steady_stops_after_quiet_rounds_in_a_row(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from timing import STEADY_FAULTS, STEADY_ROUNDS, warm_until_steady

    calls: list[str] = []
    assert warm_until_steady([lambda: calls.append("a"), lambda: calls.append("b")], rounds=4) == 4
    assert "".join(calls) == "abababab"  # quiet sides: exactly the rounds asked for
    assert warm_until_steady([lambda: None], rounds=1) == STEADY_ROUNDS  # steady takes that many quiet rounds
    assert warm_until_steady([lambda: None], rounds=0) == 0

    def faulting_at(calls_that_fault: set[int]):
        count = iter(range(100))

        def call() -> None:
            if next(count) in calls_that_fault:
                _touch_fresh_pages(2 * STEADY_FAULTS)

        return call

    assert warm_until_steady([lambda: None, faulting_at({0, 1})], rounds=1) == 2 + STEADY_ROUNDS
    # a quiet round between faulting ones is not yet steady
    assert warm_until_steady([faulting_at({0, 2})], rounds=1) == 3 + STEADY_ROUNDS
    assert warm_until_steady([lambda: _touch_fresh_pages(2 * STEADY_FAULTS)], max_rounds=4) == 4
