"""Which precision each hot path computes in, decided once from what this device runs fast.

Machines of one class differ: a CPU with AMX or AVX512-BF16 multiplies bf16 matrices natively (≈ 2.5–6× its
fp32 rate), one with AVX2 only emulates bf16 (≈ 250× *slower* than fp32). Every path that could compute in
bf16 (the model step under autocast, Newton–Schulz, benchmarks, the matrices a compiled CPU decode step
streams: ``k2lab.infer.decode_weights``) asks :func:`choose` instead of hard-coding a dtype (eager decoding
runs in the checkpoint's own dtype):

    choose("autocast", requested="auto")  ->  Choice(dtype=torch.bfloat16, reason="...")

The rule for ``requested="auto"``:

    CUDA   bf16 where ``torch.cuda.is_bf16_supported()`` (Ampere and later), else fp32
    CPU    fp32 unless the CPU advertises native bf16 (``amx_bf16`` / ``avx512_bf16`` in /proc/cpuinfo),
           and then bf16 only if a one-time micro-measurement confirms it: a square bf16 matmul at least
           ``BF16_MIN_SPEEDUP`` × the fp32 rate. The measurement is cached per machine (CPU model, flags,
           torch's CPU capability, the instruction-set caps of ``ISA_LIMITS``, threads, torch version) in
           ``$K2LAB_CACHE_DIR`` or ``~/.cache/k2lab``.

A CPU without native bf16 is never measured (an emulated 512³ bf16 product alone takes seconds) and never
runs bf16 unless asked. ``requested="fp32"`` / ``"bf16"`` force a precision, as do the environment variables
``K2LAB_PRECISION`` (every path) and ``K2LAB_NS_PRECISION`` (Newton–Schulz only), which override ``"auto"``
(the suite runs under both to show no test depends on one machine's rounding).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from k2lab.errors import K2LabError

Precision = Literal["auto", "fp32", "bf16"]
PATHS = ("autocast", "newton_schulz", "benchmark", "decode_weights")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
BF16_MIN_SPEEDUP = 1.3  # bf16 must beat fp32 by this much to be worth its rounding
PROBE_SIZE = 512  # n of the n³ products timed (≈ 0.3 s on 2 cores)
# Settings that cap the instruction sets torch's kernels and matmul libraries use. The CPU's flags stay the
# same, but with oneDNN capped at AVX2 a Zen 5 with avx512_bf16 multiplies bf16 at 2.6 GFLOP/s (emulated)
# against 208 in fp32 (637 uncapped): a measurement taken without the cap must not decide with it.
ISA_LIMITS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY")
ENV_ALL = "K2LAB_PRECISION"
ENV_PATH = {"newton_schulz": "K2LAB_NS_PRECISION"}


CompileMode = Literal["auto", "on", "off"]
DeviceChoice = Literal["auto", "cpu", "cuda"]  # where one process runs (k2lab.train.distributed)


def compile_decision(
    requested: CompileMode | str, device: str, cuda_reason: str, cpu_reason: str
) -> tuple[bool, str]:
    """Whether a path runs under ``torch.compile`` on ``device``, and why: "on" / "off" as asked; "auto"
    compiles on CUDA (``cuda_reason``) and stays eager on CPU (``cpu_reason``: the path's own figures)."""
    if requested in ("on", "off"):
        return requested == "on", "requested"
    if device == "cuda":
        return True, f"auto: {cuda_reason}"
    return False, f"auto: {cpu_reason}"


@dataclass(frozen=True)
class Choice:
    """A path's compute dtype and why (printed by ``k2lab train``, recorded in metrics and summaries)."""

    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return "bf16" if self.dtype == torch.bfloat16 else "fp32"

    def describe(self) -> str:
        return f"{self.name} ({self.reason})"


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``; empty where there is none)."""
    return _cpu_info()[1]


def cpu_model() -> str:
    return _cpu_info()[0]


@functools.cache
def _cpu_info() -> tuple[str, frozenset[str]]:
    path = Path("/proc/cpuinfo")
    text = path.read_text() if path.exists() else ""
    model, flags = platform.processor() or platform.machine(), frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            model = value.strip()
        elif key.strip() in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
    return model, flags


def native_bf16_flags() -> list[str]:
    """The native-bf16 flags this CPU advertises (empty: bf16 would be emulated)."""
    return [flag for flag in NATIVE_BF16_FLAGS if flag in cpu_flags()]


def matmul_rate(dtype: torch.dtype, n: int = PROBE_SIZE, repeats: int = 5, device: str = "cpu") -> float:
    """FLOP/s of an ``n × n @ n × n`` product in ``dtype``: the fastest of ``repeats`` timed calls."""
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=generator, device=device).to(dtype)
    b = torch.randn(n, n, generator=generator, device=device).to(dtype)
    best = float("inf")
    for _ in range(repeats + 1):  # the first call warms the kernel up
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def cache_file() -> Path:
    base = os.environ.get("K2LAB_CACHE_DIR")
    return (Path(base) if base else Path.home() / ".cache" / "k2lab") / "hardware.json"


def machine_key() -> str:
    """What identifies this machine's matmul rates: CPU model, flags, torch's CPU capability, the
    instruction-set caps set in the environment (``ISA_LIMITS``), threads and torch version."""
    limits = [f"{name}={os.environ[name]}" for name in ISA_LIMITS if os.environ.get(name)]
    parts = [
        cpu_model(),
        " ".join(sorted(cpu_flags())),
        torch.backends.cpu.get_cpu_capability(),
        *limits,
        str(torch.get_num_threads()),
        torch.__version__,
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


@functools.cache
def cpu_rates() -> dict[str, float]:
    """Measured fp32 and bf16 ``PROBE_SIZE``³ matmul rates (FLOP/s) of this CPU, cached per machine.

    Only called on a CPU that advertises native bf16."""
    path, key = cache_file(), machine_key()
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    entry = cached.get(key) if isinstance(cached, dict) else None
    if isinstance(entry, dict) and {"fp32", "bf16"} <= set(entry):
        return {"fp32": float(entry["fp32"]), "bf16": float(entry["bf16"])}
    rates = {"fp32": matmul_rate(torch.float32), "bf16": matmul_rate(torch.bfloat16)}
    record = {**rates, "cpu": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__}
    cached = cached if isinstance(cached, dict) else {}
    cached[key] = record
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cached, indent=2) + "\n")
        tmp.replace(path)
    except OSError:
        pass  # a read-only home: measure again next process
    return rates


def auto_choice(device: str = "cpu") -> Choice:
    """What ``"auto"`` means on ``device`` (see the module doc)."""
    if device == "cuda":
        if torch.cuda.is_bf16_supported():
            return Choice(torch.bfloat16, f"CUDA {torch.cuda.get_device_name()} runs bf16 natively")
        return Choice(torch.float32, "this CUDA device has no native bf16")
    capability = torch.backends.cpu.get_cpu_capability()
    flags = native_bf16_flags()
    if not flags:
        return Choice(torch.float32, f"CPU {capability} without amx_bf16/avx512_bf16: bf16 would be emulated")
    rates = cpu_rates()
    speedup = rates["bf16"] / rates["fp32"]
    measured = f"bf16 {rates['bf16'] / 1e9:.0f} vs fp32 {rates['fp32'] / 1e9:.0f} GFLOP/s"
    if speedup >= BF16_MIN_SPEEDUP:
        return Choice(torch.bfloat16, f"CPU {capability} with {'+'.join(flags)}, {measured}")
    return Choice(torch.float32, f"CPU {capability} with {'+'.join(flags)} but {measured}")


def choose(path: str, requested: Precision | str = "auto", device: str = "cpu") -> Choice:
    """The compute dtype of hot path ``path`` (one of ``PATHS``) for a ``requested`` precision."""
    if path not in PATHS:
        raise ValueError(f"unknown hot path {path!r}; one of {', '.join(PATHS)}")
    if requested == "auto":
        for variable in (ENV_PATH.get(path), ENV_ALL):
            forced = os.environ.get(variable) if variable else None
            if forced and forced != "auto":
                return Choice(_dtype(forced, variable), f"forced by {variable}")
        return auto_choice(device)
    return Choice(_dtype(requested, "precision"), "requested")


def _dtype(name: str, source: str) -> torch.dtype:
    if name not in DTYPES:
        raise K2LabError(f"{source} must be auto, fp32 or bf16, got {name!r}")
    return DTYPES[name]


def describe_machine() -> dict[str, object]:
    """The CPU facts a benchmark table states: model, capability, threads, native-bf16 flags."""
    return {
        "cpu": cpu_model(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "native_bf16": native_bf16_flags(),
    }
