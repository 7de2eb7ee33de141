"""k2lab's own model directory: what ``load_model`` refuses (manifest versions and kinds it does not know,
tensors of a dtype that is not floating point)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from k2lab import build_model, load_preset
from k2lab.errors import CheckpointError, K2LabError
from k2lab.model_dir import MANIFEST, WEIGHTS, load_model, load_text_model, save_model
from k2lab.models import CausalLM


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    return save_model(build_model(load_preset("k2-nano")), tmp_path / "model")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"version": 99}, "version 99 is not supported"),
        ({"version": "one"}, "version 'one' is not supported"),
        ({"version": True}, "version True is not supported"),
        ({"version": 0}, "version 0 is not supported"),
        ({"kind": "banana"}, "kind 'banana' is unknown"),
    ],
)
def test_unknown_manifest_versions_and_kinds_are_refused(saved: Path, change: dict, message: str):
    manifest = json.loads((saved / MANIFEST).read_text())
    (saved / MANIFEST).write_text(json.dumps({**manifest, **change}))
    with pytest.raises(CheckpointError, match=f"{MANIFEST}: {message}"):
        load_model(saved)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.uint8, torch.float8_e4m3fn])
def test_a_parameter_stored_as_a_non_float_dtype_is_refused(saved: Path, dtype: torch.dtype):
    state = load_file(saved / WEIGHTS)
    state["norm.weight"] = state["norm.weight"].to(dtype)
    save_file(state, str(saved / WEIGHTS))
    with pytest.raises(CheckpointError, match=f"1 wrongly typed: norm.weight {dtype}"):
        load_model(saved)


def test_half_precision_weights_load(saved: Path):
    state = {key: value.bfloat16() for key, value in load_file(saved / WEIGHTS).items()}
    save_file(state, str(saved / WEIGHTS))
    assert load_model(saved).norm.weight.dtype == torch.float32


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_weights_holding_nan_or_inf_are_refused(saved: Path, bad: float):
    """A diverged or damaged model loaded in silence and generated garbage (or a multinomial traceback)."""
    state = load_file(saved / WEIGHTS)
    state["norm.weight"][3] = bad
    save_file(state, str(saved / WEIGHTS))
    with pytest.raises(CheckpointError, match="holds NaN or infinite values in 1 tensors \\(norm.weight\\)"):
        load_model(saved)


@pytest.mark.parametrize("preset", ["k2-nano", "k3-nano", "k25-nano", "k3-vl-nano"])
def test_every_fresh_models_state_is_finite(preset: str, tmp_path: Path):
    from k2lab.presets.vision_language import load_vlm_preset
    from k2lab.vision.vlm import build_vlm

    model = (
        build_vlm(load_vlm_preset(preset))
        if "-vl" in preset or "k25" in preset
        else build_model(load_preset(preset))
    )
    assert load_model(save_model(model, tmp_path / "model")) is not None  # no buffer legitimately infinite


def test_a_load_puts_back_a_model_a_killed_save_left_hidden(saved: Path):
    """A save killed between its swap's two renames leaves the previous model as .NAME.old.xxxxxxxx/NAME:
    from_hf and export put it back; load_model said the directory did not exist."""
    hidden = saved.parent / f".{saved.name}.old.abcd1234"
    hidden.mkdir()
    saved.rename(hidden / saved.name)
    assert load_model(saved) is not None and saved.is_dir() and not (hidden / saved.name).exists()


def test_commands_that_train_or_sample_a_text_model_refuse_a_vision_language_one(
    small_tokenizer, tmp_path: Path
):
    """`k2lab rl` on a K2.5 checkpoint failed every episode on the VLM's config, then said "RL done" and wrote
    the input back as its policy (exit 0)."""
    from k2lab.cli import main
    from k2lab.presets.vision_language import load_vlm_preset
    from k2lab.vision.vlm import build_vlm

    vlm = save_model(build_vlm(load_vlm_preset("k25-nano")), tmp_path / "vlm")
    small_tokenizer.save(vlm / "tokenizer.json")
    with pytest.raises(K2LabError, match="is a vision-language model; RL takes a text model"):
        load_text_model(vlm, "RL")
    assert isinstance(
        load_text_model(save_model(build_model(load_preset("k2-nano")), tmp_path / "t"), "RL"), CausalLM
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["rl", "-c", str(vlm), "--out", str(tmp_path / "rl"), "--iterations", "1"])
    assert exit_info.value.code == 2
    assert not (tmp_path / "rl" / "model").exists()
