"""MTP layers in checkpoints: DeepSeek-V3 names, exact round trips, and checkpoints that declare MTP layers
without holding them (what transformers' ``save_pretrained`` writes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from k2lab import build_model, load_preset
from k2lab.errors import CheckpointError
from k2lab.hf import from_hf, to_hf
from k2lab.hf.io import SINGLE_FILE
from k2lab.hf.mapping import config_from_hf, config_to_hf
from tests.conftest import KIMI_LINEAR_STYLE, randomize

MTP_OWN = {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"}
MTP_COPIES = {"embed_tokens.weight", "shared_head.head.weight"}


def layer_keys(path: Path, index: int) -> dict[str, tuple[int, ...]]:
    prefix = f"model.layers.{index}."
    with safe_open(str(path / SINGLE_FILE), "pt") as handle:
        return {
            key.removeprefix(prefix): tuple(handle.get_slice(key).get_shape())
            for key in handle.keys()  # noqa: SIM118 - safe_open handles are not iterable
            if key.startswith(prefix)
        }


def mtp_outputs(model, ids: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        return model.mtp_logits(ids, model(ids, output_hidden=True).hidden)


PRESETS = {"deepseek_v3": ("k2-nano", {}), "kimi_linear": ("k3-nano", KIMI_LINEAR_STYLE)}


@pytest.mark.parametrize("fmt", list(PRESETS))
def test_mtp_layers_written_in_deepseek_layout_and_read_back_exactly(fmt: str, tmp_path: Path):
    preset, style = PRESETS[fmt]
    model = randomize(build_model(load_preset(preset, num_nextn_predict_layers=2, **style)))
    L, D, V = model.config.num_hidden_layers, model.config.hidden_size, model.config.vocab_size
    to_hf(model, tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["model_type"] == fmt and config["num_nextn_predict_layers"] == 2
    last_mla = max(i for i, kind in enumerate(model.config.layer_types) if kind == "mla")
    for j in range(2):
        names = layer_keys(tmp_path / "ckpt", L + j)
        assert set(names) >= MTP_OWN | MTP_COPIES
        assert names["eh_proj.weight"] == (D, 2 * D) and names["embed_tokens.weight"] == (V, D)
        # the block is named exactly as the last main MLA + MoE layer
        assert set(names) - MTP_OWN - MTP_COPIES == set(layer_keys(tmp_path / "ckpt", last_mla))
    state = load_file(str(tmp_path / "ckpt" / SINGLE_FILE))
    assert torch.equal(state[f"model.layers.{L}.embed_tokens.weight"], model.embed.weight)
    assert torch.equal(state[f"model.layers.{L}.shared_head.head.weight"], model.lm_head.weight)
    assert torch.equal(state[f"model.layers.{L}.shared_head.norm.weight"], model.mtp[0].final_norm.weight)

    back = from_hf(tmp_path / "ckpt")
    assert len(back.mtp) == 2
    ids = torch.randint(3, V, (2, 9))
    for ours, theirs in zip(mtp_outputs(model, ids), mtp_outputs(back, ids), strict=True):
        assert torch.equal(ours, theirs)
    assert len(from_hf(tmp_path / "ckpt", mtp=False).mtp) == 0


def test_config_carries_num_nextn_predict_layers():
    config = load_preset("k2-nano", num_nextn_predict_layers=1)
    assert config_from_hf(config_to_hf(config)) == config.model_copy(update={"name": "hf"})
    assert (
        config_from_hf({**config_to_hf(config), "num_nextn_predict_layers": None}).num_nextn_predict_layers
        == 0
    )


def test_declared_but_absent_mtp_layers_load_without_them(tmp_path: Path):
    """transformers' save_pretrained keeps ``num_nextn_predict_layers`` (default 1) but writes no MTP layer."""
    model = randomize(build_model(load_preset("k2-nano")))
    to_hf(model, tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "num_nextn_predict_layers": 1}))
    loaded = from_hf(tmp_path / "ckpt")
    assert len(loaded.mtp) == 0 and loaded.config.num_nextn_predict_layers == 0
    ids = torch.randint(3, 128, (1, 6))
    assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_incomplete_mtp_layer_is_reported(tmp_path: Path):
    model = randomize(build_model(load_preset("k2-nano", num_nextn_predict_layers=1)))
    to_hf(model, tmp_path / "ckpt")
    file = tmp_path / "ckpt" / SINGLE_FILE
    state = load_file(str(file))
    del state[f"model.layers.{model.config.num_hidden_layers}.hnorm.weight"]
    save_file(state, str(file), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="1 missing tensor: model.layers.2.hnorm.weight"):
        from_hf(tmp_path / "ckpt")
