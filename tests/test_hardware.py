"""k2lab.hardware: the precision of each hot path, chosen from what the device runs fast."""

import json
import os
import subprocess
import sys

import pytest
import torch

from k2lab import hardware
from k2lab.errors import K2LabError
from k2lab.optim import OptimizerConfig
from k2lab.optim.grouping import build_optimizer
from k2lab.optim.muon import Muon


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No forcing variables, a private cache and no measurement left from another test."""
    for variable in (hardware.ENV_ALL, *hardware.ENV_PATH.values()):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("K2LAB_CACHE_DIR", str(tmp_path))
    hardware.cpu_rates.cache_clear()
    yield tmp_path
    hardware.cpu_rates.cache_clear()


def no_measuring(*args, **kwargs):
    raise AssertionError("a CPU without native bf16 must not be measured")


def test_cpu_without_native_bf16_is_fp32_and_never_measured(clean_env, monkeypatch):
    monkeypatch.setattr(hardware, "native_bf16_flags", lambda: [])
    monkeypatch.setattr(hardware, "matmul_rate", no_measuring)
    for path in hardware.PATHS:
        choice = hardware.choose(path)
        assert choice.dtype == torch.float32 and "emulated" in choice.reason


@pytest.mark.parametrize(("bf16_rate", "expected"), [(4.0, torch.bfloat16), (1.1, torch.float32)])
def test_native_bf16_is_used_only_when_the_measurement_confirms_it(
    clean_env, monkeypatch, bf16_rate, expected
):
    monkeypatch.setattr(hardware, "native_bf16_flags", lambda: ["avx512_bf16"])
    monkeypatch.setattr(hardware, "matmul_rate", lambda dtype: bf16_rate if dtype == torch.bfloat16 else 1.0)
    assert hardware.choose("autocast").dtype == expected


def test_measurement_is_cached_per_machine(clean_env, monkeypatch):
    calls = []
    monkeypatch.setattr(hardware, "native_bf16_flags", lambda: ["amx_bf16"])
    monkeypatch.setattr(hardware, "matmul_rate", lambda dtype: calls.append(dtype) or 2e9)
    first = hardware.cpu_rates()
    assert len(calls) == 2
    saved = json.loads((clean_env / "hardware.json").read_text())
    assert saved[hardware.machine_key()]["fp32"] == 2e9
    hardware.cpu_rates.cache_clear()  # a new process reads the file instead of measuring
    assert hardware.cpu_rates() == first and len(calls) == 2


@pytest.mark.parametrize("variable", hardware.ISA_LIMITS)
def test_an_instruction_set_cap_is_another_machine(clean_env, monkeypatch, variable):
    """The same CPU with its matmul libraries capped (``ONEDNN_MAX_CPU_ISA=AVX2``, …) keeps its flags but not
    its bf16 rate: the cached measurement of the uncapped CPU is not taken for it."""
    for name in hardware.ISA_LIMITS:
        monkeypatch.delenv(name, raising=False)
    plain = hardware.machine_key()
    monkeypatch.setenv(variable, "AVX2")
    assert hardware.machine_key() != plain


@pytest.mark.skipif(not hardware.native_bf16_flags(), reason="the CPU advertises no native bf16")
def test_a_cpu_capped_at_avx2_is_measured_again_and_runs_fp32(tmp_path):
    """End to end, in fresh processes (oneDNN reads its cap at start): the cache says this CPU runs bf16 4×
    faster than fp32 — what the uncapped CPU would have measured. Uncapped, ``auto`` takes that and picks bf16;
    with oneDNN capped at AVX2, where bf16 products are emulated (tens of times slower than fp32 on every CPU
    of the class), it measures again and picks fp32."""
    dropped = (*hardware.ISA_LIMITS, hardware.ENV_ALL, *hardware.ENV_PATH.values())
    env = {name: value for name, value in os.environ.items() if name not in dropped}
    env["K2LAB_CACHE_DIR"] = str(tmp_path)

    def run(code: str, **extra: str) -> str:
        command = [sys.executable, "-c", f"from k2lab import hardware; {code}"]
        return subprocess.run(
            command, env={**env, **extra}, capture_output=True, text=True, check=True
        ).stdout

    key = run("print(hardware.machine_key())").strip()
    (tmp_path / "hardware.json").write_text(json.dumps({key: {"fp32": 1e11, "bf16": 4e11}}))
    choice = "print(hardware.choose('autocast').describe())"
    uncapped = run(choice)
    assert uncapped.startswith("bf16 (") and "bf16 400 vs fp32 100" in uncapped  # the cached rates
    assert run(choice, ONEDNN_MAX_CPU_ISA="AVX2").startswith("fp32 (")
    assert len(json.loads((tmp_path / "hardware.json").read_text())) == 2  # both machines' entries kept


def test_a_corrupt_cache_is_measured_again(clean_env, monkeypatch):
    (clean_env / "hardware.json").write_text("{not json")
    monkeypatch.setattr(hardware, "matmul_rate", lambda dtype: 3e9)
    assert hardware.cpu_rates() == {"fp32": 3e9, "bf16": 3e9}


def test_requests_and_environment_force_a_precision(clean_env, monkeypatch):
    monkeypatch.setattr(hardware, "native_bf16_flags", lambda: [])
    assert hardware.choose("autocast", "bf16").dtype == torch.bfloat16
    monkeypatch.setenv("K2LAB_NS_PRECISION", "bf16")
    assert hardware.choose("newton_schulz").dtype == torch.bfloat16  # the variable overrides "auto"
    assert hardware.choose("autocast").dtype == torch.float32  # ... of its own path only
    assert hardware.choose("newton_schulz", "fp32").dtype == torch.float32  # an explicit request wins
    monkeypatch.setenv("K2LAB_PRECISION", "bf16")
    assert hardware.choose("autocast").describe() == "bf16 (forced by K2LAB_PRECISION)"


def test_bad_names_are_refused(clean_env, monkeypatch):
    with pytest.raises(ValueError, match="unknown hot path"):
        hardware.choose("attention")
    monkeypatch.setenv("K2LAB_NS_PRECISION", "fp8")
    with pytest.raises(K2LabError, match="K2LAB_NS_PRECISION must be auto, fp32 or bf16"):
        hardware.choose("newton_schulz")


def test_newton_schulz_dtype_follows_the_choice(clean_env, monkeypatch):
    model = torch.nn.Linear(8, 8, bias=False)
    for forced, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        monkeypatch.setenv("K2LAB_NS_PRECISION", forced)
        assert Muon(model.parameters()).param_groups[0]["ns_dtype"] == dtype
        optimizer = build_optimizer(model, OptimizerConfig(name="muon"), verbose=False)
        assert optimizer.param_groups[0]["ns_dtype"] == dtype


def test_legacy_ns_bf16_recipes_still_load():
    assert OptimizerConfig(ns_bf16=False).ns_precision == "fp32"
    assert OptimizerConfig.model_validate({"ns_bf16": True}).ns_precision == "bf16"
    with pytest.raises(ValueError, match="ns_bf16 must be true or false"):
        OptimizerConfig.model_validate({"ns_bf16": "yes"})


def test_the_real_machine_gets_an_answer():
    """Whatever this CPU is: a dtype, a reason naming its capability or the forcing variable."""
    choice = hardware.choose("autocast")
    assert choice.dtype in (torch.float32, torch.bfloat16)
    assert torch.backends.cpu.get_cpu_capability() in choice.reason or "forced" in choice.reason
    assert hardware.describe_machine()["threads"] == torch.get_num_threads()
