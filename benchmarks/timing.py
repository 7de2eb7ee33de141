"""Shared timing for the side-by-side benchmarks: interleaved calls, median wall time."""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import threading
import time
from collections.abc import Callable

import torch

from k2lab.allocator import keep_freed_memory

keep_freed_memory()  # as the k2lab command does (k2lab.allocator); both sides of a comparison share it


# A call is quiet when it faults in fewer fresh pages than this (8 MiB of 4 KiB pages); the heap is steady
# after this many quiet rounds in a row (a k2-mini or k3-mini step faults in 5–15k pages now and then, with
# quiet steps between, for its first ≈ 25 steps).
STEADY_FAULTS = 2048
STEADY_ROUNDS = 3
MAX_WARMUP_ROUNDS = 40


def page_faults() -> int:
    """Minor page faults of this process so far (first touches of fresh memory)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def warm_until_steady(
    fns: list[Callable[[], object]], rounds: int = 1, max_rounds: int = MAX_WARMUP_ROUNDS
) -> int:
    """Untimed rounds of every ``fn()`` until the process heap is steady; returns the rounds run.

    At least ``rounds`` rounds, then more until the last ``STEADY_ROUNDS`` rounds in a row were quiet: no call
    in them faulted in ``STEADY_FAULTS`` fresh pages or more (``max_rounds`` at most). A training step frees
    and re-allocates hundreds of MB of activations each call; with freed memory kept (``k2lab.allocator``) the
    heap still grows for the first steps, until its free blocks fit every allocation, and till then steps
    first-touch fresh pages (≈ 20,000 faults in each of the first few k2-mini or k3-mini steps on a KVM guest,
    ≈ 150–250 ms of it, then 5–15k now and then, with quiet steps between, until ≈ step 25). A long training
    run lives in the steady state, so that is what the timed calls measure.
    """
    if rounds <= 0:
        return 0
    quiet = 0
    for round_ in range(max_rounds):
        faulted = []
        for fn in fns:
            before = page_faults()
            fn()
            faulted.append(page_faults() - before)
        quiet = quiet + 1 if max(faulted) < STEADY_FAULTS else 0
        if round_ + 1 >= rounds and quiet >= STEADY_ROUNDS:
            return round_ + 1
    return max_rounds


def alternating_medians(fns: list[Callable[[], object]], repeats: int, warmup: int = 1) -> list[float]:
    """Median wall time of each ``fn()`` over ``repeats`` calls, after ``warmup`` or more untimed rounds
    (``warm_until_steady``).

    Calls are interleaved so that load from other processes hits every side alike, and the order rotates
    each round (a, b, c; b, c, a; c, a, b; ...) so that no side always runs right after the same other one
    (whose leftovers in the caches and the heap it would otherwise always meet).
    """
    warm_until_steady(fns, warmup)
    times: list[list[float]] = [[] for _ in fns]
    for round_ in range(repeats):
        for i in range(len(fns)):
            index = (i + round_) % len(fns)
            start = time.perf_counter()
            fns[index]()
            times[index].append(time.perf_counter() - start)
    return [statistics.median(fn_times) for fn_times in times]


def synced(fn: Callable[[], object], device: torch.device | str) -> Callable[[], object]:
    """``fn`` that returns only when the work it queued on a CUDA ``device`` has finished (so that wall
    time measures the kernels, not their launch); ``fn`` itself on the CPU."""
    if torch.device(device).type != "cuda":
        return fn

    def call() -> object:
        result = fn()
        torch.cuda.synchronize()
        return result

    return call


def gpu_report(size: int = 8192, repeats: int = 10) -> dict[str, object]:
    """The CUDA device, torch's CUDA version and its measured square-matmul peaks (TFLOP/s, fastest of
    ``repeats``): bf16, and fp32 with TF32 off (the precision the fp32 sides run in)."""
    from k2lab.hardware import matmul_rate

    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        fp32 = matmul_rate(torch.float32, size, repeats, device="cuda")
    finally:
        torch.set_float32_matmul_precision(saved)
    return {
        "gpu": torch.cuda.get_device_name(),
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "gpu_bf16_peak_tflops": round(matmul_rate(torch.bfloat16, size, repeats, device="cuda") / 1e12, 1),
        "gpu_fp32_peak_tflops": round(fp32 / 1e12, 1),
        "gpu_peak_size": size,
    }


# ---- what every benchmark states about its machine, and its smoke mode ------------------------------------
EMULATED_BF16_PEAK_SIZE = 256  # an emulated bf16 2048³ product takes ~1 min on an AVX2-only CPU


def measure_peaks(size: int = 2048, repeats: int = 5) -> dict[str, float]:
    """Square-matmul peaks (FLOP/s, fastest of ``repeats``) in fp32 at ``size``³ and in bf16 at ``size``³
    where the CPU has native bf16, else at ``EMULATED_BF16_PEAK_SIZE``³ (``bf16_size`` says which)."""
    from k2lab.hardware import matmul_rate, native_bf16_flags

    bf16_size = size if native_bf16_flags() else min(size, EMULATED_BF16_PEAK_SIZE)
    return {
        "fp32": matmul_rate(torch.float32, size, repeats),
        "bf16": matmul_rate(torch.bfloat16, bf16_size, repeats),
        "size": size,
        "bf16_size": bf16_size,
    }


def machine_report(peak_size: int = 2048, peaks: dict[str, float] | None = None) -> dict[str, object]:
    """CPU model, torch capability, threads, native-bf16 flags, measured fp32/bf16 matmul peaks (GFLOP/s),
    and the precision ``k2lab.hardware`` picks: the facts a benchmark table must state."""
    from k2lab.hardware import choose, describe_machine

    peaks = peaks or measure_peaks(peak_size)
    return {
        "name": "machine",
        **describe_machine(),
        "fp32_peak_gflops": round(peaks["fp32"] / 1e9, 1),
        "bf16_peak_gflops": round(peaks["bf16"] / 1e9, 1),
        "peak_sizes": {"fp32": peaks["size"], "bf16": peaks["bf16_size"]},
        "auto_precision": choose("benchmark").describe(),
    }


def print_report(
    rows: list[dict], machine: dict[str, object], as_json: bool, describe: Callable[[dict], str]
) -> None:
    """A benchmark's output: with ``as_json`` one JSON line per row, then the machine's; else the machine's
    line and ``describe(row)`` for each row."""
    if as_json:
        for line in (*rows, machine):
            print(json.dumps(line))
        return
    print(machine_line(machine))
    for row in rows:
        print(describe(row))


def machine_line(report: dict[str, object]) -> str:
    flags = "+".join(report["native_bf16"]) or "no native bf16"  # type: ignore[arg-type]
    sizes = report["peak_sizes"]
    return (
        f"machine: {report['cpu']}, {report['capability']} ({flags}), {report['threads']} threads; matmul peak "
        f"fp32 {report['fp32_peak_gflops']} GFLOP/s ({sizes['fp32']}³), bf16 {report['bf16_peak_gflops']} "  # type: ignore[index]
        f"GFLOP/s ({sizes['bf16']}³); auto precision {report['auto_precision']}"  # type: ignore[index]
    )


def _device(name: str) -> str:
    if name == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError("this torch sees no CUDA device")
    return name


def add_device_argument(parser: argparse.ArgumentParser, description: str) -> None:
    """``--device cpu|cuda`` (default cpu); ``cuda`` is refused with a clear message where there is none."""
    parser.add_argument("--device", type=_device, choices=["cpu", "cuda"], default="cpu", help=description)


def add_smoke_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes and one repeat: checks that the script still runs (the test suite runs every "
        "benchmark this way); its figures mean nothing",
    )


def apply_smoke(args: argparse.Namespace, **tiny: object) -> argparse.Namespace:
    """With ``--smoke``, replace the named settings by their tiny values (and ``repeats`` by 1)."""
    if getattr(args, "smoke", False):
        for key, value in {"repeats": 1, **tiny}.items():
            setattr(args, key, value)
    return args


def serving_threads(args: argparse.Namespace) -> None:
    """Torch's threads as ``k2lab serve`` arranges them (``k2lab.serve.threads``): ``--threads`` (else the
    default) for the engine's thread, kept in ``args.engine_threads`` for ``Engine(threads=…)``, and this
    thread single-threaded. Call it before this thread touches a tensor."""
    from k2lab.serve.threads import hand_threads_to_engine  # only the serve benchmarks need it

    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    args.engine_threads = hand_threads_to_engine()


def run_machine_report(args: argparse.Namespace) -> dict[str, object]:
    """``machine_report`` of a benchmark run: the peaks measured at 2048³, or 256³ under ``--smoke``; with
    ``--device cuda`` also the GPU's (``gpu_report`` at 8192², 1024² under ``--smoke``). After
    ``serving_threads`` it measures with the engine's thread count (its measurements done)."""
    if getattr(args, "engine_threads", None):
        torch.set_num_threads(args.engine_threads)
    smoke = getattr(args, "smoke", False)
    report = machine_report(256 if smoke else 2048)
    if getattr(args, "device", "cpu") == "cuda":
        report.update(gpu_report(1024 if smoke else 8192))
    return report


def serve_concurrently(
    engine, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0, shutdown: bool = True
) -> tuple[float, list[list[int]]]:
    """Submit every prompt at once to a started ``k2lab.serve.Engine`` (``max_tokens`` each; greedy, or sampled
    at ``temperature`` with request i seeded i), wait for all of them, shut the engine down (unless not
    ``shutdown``); returns (seconds, replies)."""
    from k2lab.serve import Request, SamplingParams  # only the serve benchmarks need it

    done = threading.Semaphore(0)
    start = time.perf_counter()
    requests = [
        engine.submit(
            Request(p, SamplingParams(max_tokens, temperature, seed=i), on_finish=lambda _: done.release())
        )
        for i, p in enumerate(prompts)
    ]
    for _ in requests:
        done.acquire()
    seconds = time.perf_counter() - start
    if shutdown:
        engine.shutdown()
    return seconds, [r.tokens for r in requests]


ServeRun = Callable[
    [], tuple[float, list[list[int]], object]
]  # a fresh engine's run: (seconds, replies, extra)


def serve_sides(
    sides: dict[str, ServeRun], repeats: int
) -> tuple[dict[str, float], dict[str, list[list[int]]], dict[str, object]]:
    """The serve benchmarks' A/B: each side's run ``repeats`` times, the sides alternating in ``sides``' order;
    per side the median seconds (the middle run, the upper one of an even count), the last run's replies and
    the last ``extra`` that was not None (an engine's counters)."""
    times: dict[str, list[float]] = {side: [] for side in sides}
    replies: dict[str, list[list[int]]] = {}
    extras: dict[str, object] = dict.fromkeys(sides)
    for _ in range(repeats):
        for side, run in sides.items():
            seconds, replies[side], extra = run()
            times[side].append(seconds)
            extras[side] = extra if extra is not None else extras[side]
    return {side: sorted(t)[len(t) // 2] for side, t in times.items()}, replies, extras


def side_rates(median: dict[str, float], tokens: int, first: str, second: str) -> dict[str, float]:
    """``{first}_tokens_per_s``, ``{second}_tokens_per_s`` and ``ratio`` (first's seconds ÷ second's: how much
    faster the second side ran) of ``serve_sides``' medians for ``tokens`` completion tokens a run."""
    return {
        f"{first}_tokens_per_s": round(tokens / median[first], 1),
        f"{second}_tokens_per_s": round(tokens / median[second], 1),
        "ratio": round(median[first] / median[second], 2),
    }
