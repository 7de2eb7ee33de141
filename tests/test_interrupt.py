"""Ctrl-C in a long command: exit code 130 and one line naming the checkpoint the run keeps, no traceback
(rl, visual-rl and mopd distill exited 130 without a word: the user could not tell what was kept)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k2lab import build_model, load_preset
from k2lab.interrupt import RunInterrupted, last_checkpoint, reports_interrupt
from k2lab.model_dir import save_model
from k2lab.presets.vision_language import load_vlm_preset
from k2lab.train.run_checkpoints import list_checkpoints
from k2lab.vision.vlm import build_vlm

ROOT = Path(__file__).resolve().parents[1]

# the run in a child process that sends itself SIGINT once its first checkpoint is durable (as Ctrl-C at a
# terminal would; a pytest-xdist worker ignores SIGINT, so the child puts Python's handler back)
SCRIPT = """
import os, signal, sys
from k2lab.cli import main
from k2lab.train.run_checkpoints import CheckpointWriter
signal.signal(signal.SIGINT, signal.default_int_handler)
original = CheckpointWriter.save
def save(self, *args, **kwargs):
    directory = original(self, *args, **kwargs)
    self.wait()
    os.kill(os.getpid(), signal.SIGINT)
    return directory
CheckpointWriter.save = save
main(sys.argv[1:])
"""


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, small_tokenizer) -> Path:
    """A nano text policy, a nano VLM and a two-expert directory, each with the small tokenizer."""
    root = tmp_path_factory.mktemp("inputs")
    text = load_preset("k2-nano", vocab_size=300, max_position_embeddings=2048)
    vlm = load_vlm_preset("k25-nano", small_tokenizer.special_tokens, vocab_size=300)
    for directory, model in [(root / "policy", build_model(text)), (root / "vlm", build_vlm(vlm, seed=3))]:
        save_model(model, directory)
        small_tokenizer.save(directory / "tokenizer.json")
    experts = [{"domain": "arithmetic", "effort": "low", "budget": 3}]
    save_model(build_model(text), root / "experts" / "arithmetic-low" / "model")
    small_tokenizer.save(root / "experts" / "arithmetic-low" / "model" / "tokenizer.json")
    manifest = {"checkpoint": "random", "experts": experts, "rl": {}}
    (root / "experts" / "experts.json").write_text(json.dumps(manifest))
    return root


COMMANDS = {  # command -> (arguments before --out, the checkpoint's counter)
    "rl": (["rl", "-c", "{in}/policy", "--group", "2", "--prompts", "1", "--envs", "arithmetic",
            "--max-new-tokens", "4", "--critic", "none"], "iteration"),
    "visual-rl": (["visual-rl", "-c", "{in}/vlm", "--group", "2", "--prompts", "1", "--max-new-tokens", "4",
                   "--eval-samples", "0"], "iteration"),
    "mopd distill": (["mopd", "distill", "--experts", "{in}/experts", "--student", "{in}/policy",
                      "--prompts", "1"], "step"),
}  # fmt: skip


@pytest.mark.parametrize("command", COMMANDS)
def test_ctrl_c_after_the_first_checkpoint_names_it(command, inputs, tmp_path):
    args, counter = COMMANDS[command]
    out = tmp_path / "run"
    length = "--steps" if counter == "step" else "--iterations"
    argv = [a.replace("{in}", str(inputs)) for a in args] + [length, "50", "--checkpoint-every", "1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, *argv, "--threads", "1", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 130, output[-2000:]
    assert "Traceback" not in output
    assert [n for n, _ in list_checkpoints(out)] == [1]  # the loop stopped at the first checkpoint
    line = next(x for x in result.stderr.splitlines() if x.startswith("interrupted:"))
    assert line == (
        f"interrupted: {out} keeps its last checkpoint, {counter} 1 (later {counter}s were not saved); "
        "run the same command again to continue"
    )
    assert not (out / "model").exists()


def test_the_innermost_block_names_the_run_and_the_outermost_hint_wins(tmp_path, capsys):
    """A study around a run: the run's directory and checkpoint, the study's hint, printed once."""
    run = tmp_path / "study" / "run"
    (run / "checkpoints" / "step_00000004").mkdir(parents=True)
    (run / "checkpoints" / "step_00000012").mkdir()
    study = reports_interrupt(tmp_path / "study", lambda: "its finished runs", "run the study again")
    inner = reports_interrupt(run, last_checkpoint(run, "iteration"), "the run's own hint")
    with pytest.raises(RunInterrupted) as stopped, study, inner:
        raise KeyboardInterrupt
    assert isinstance(stopped.value, KeyboardInterrupt) and stopped.value.__suppress_context__
    expected = (
        f"interrupted: {run} keeps its last checkpoint, iteration 12 (later iterations were not saved); "
        "run the study again"
    )
    assert capsys.readouterr().err.strip().splitlines() == [expected]


def test_a_run_without_a_checkpoint_says_so(tmp_path, capsys):
    fresh = tmp_path / "fresh"
    with pytest.raises(KeyboardInterrupt), reports_interrupt(fresh, last_checkpoint(fresh), "rerun"):
        raise KeyboardInterrupt
    assert capsys.readouterr().err.strip() == f"interrupted: {fresh} keeps no checkpoint yet; rerun"
