"""The kimi_k3 checkpoint layout (text model + MTP): config fields, round trips, the read variants, errors.

Models are k3-nano (4 layers: KDA, MLA, KDA, MLA; vocab 128, hidden 64, 8 experts top-2, latent 32, AttnRes
blocks of 2) with overrides, weights re-drawn large (std 0.15) so logits are O(1). The mlx-lm reference
checks of these files are in tests/hf/test_kimi_k3_mlx.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from k2lab import build_model, load_preset
from k2lab.cli import main
from k2lab.config import ConfigError
from k2lab.errors import CheckpointError
from k2lab.hf import from_hf, kimi_k3, to_hf
from k2lab.hf.export import ExportConfig, export
from k2lab.hf.formats import checkpoint_model_type
from k2lab.hf.io import INDEX_FILE, SINGLE_FILE
from k2lab.model_dir import save_model
from k2lab.models import CausalLM
from tests.conftest import KIMI_LINEAR_STYLE, randomize
from tests.hf.conftest import nano_for

P = "language_model.model."


def _model(**overrides: object) -> CausalLM:
    return randomize(build_model(load_preset("k3-nano", **overrides), seed=0))


def _assert_same(ours: CausalLM, loaded: CausalLM) -> None:
    assert loaded.config == ours.config.replace(name=loaded.config.name)
    theirs = loaded.state_dict()
    assert list(theirs) == list(ours.state_dict())
    for key, value in ours.state_dict().items():
        assert torch.equal(theirs[key], value), key
    ids = torch.randint(0, ours.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = ours(ids, output_hidden=True), loaded(ids, output_hidden=True)
        assert torch.equal(a.logits, b.logits)
        if ours.config.num_nextn_predict_layers:
            assert torch.equal(ours.mtp_logits(ids, a.hidden)[0], loaded.mtp_logits(ids, b.hidden)[0])


def _rewrite(root: Path, change) -> None:
    """Apply ``change(tensors)`` (a dict, edited in place) to a single-file checkpoint."""
    tensors = load_file(root / SINGLE_FILE)
    change(tensors)
    save_file(tensors, root / SINGLE_FILE, metadata={"format": "pt"})


# ------------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "overrides",
    [
        {"num_nextn_predict_layers": 1},
        {  # every K3 field off or moved from its preset value
            "situ_beta1": 3.0,
            "situ_beta2": 20.0,
            "moe_latent_norm": False,
            "kda_gate_lower_bound": -4.0,
            "mla_output_gate": False,
            "attnres_block_size": 1,
            "tie_word_embeddings": True,
            "rms_norm_eps": 1e-5,
            "routed_scaling_factor": 2.5,
        },
        {
            "mlp_activation": "swiglu",
            "kda_gate": "softplus",
            "kda_output_gate": "low_rank",
            "moe_latent_size": None,
        },
    ],
)
def test_config_round_trip(overrides: dict):
    config = load_preset("k3-nano", **overrides)
    data = json.loads(json.dumps(kimi_k3.config_to_hf(config)))
    assert kimi_k3.config_from_hf(data, name=config.name) == config
    assert kimi_k3.text_config_from_hf(kimi_k3.text_config_to_hf(config), name=config.name) == config


def test_config_writes_the_released_field_names():
    data = kimi_k3.config_to_hf(load_preset("k3-nano", num_nextn_predict_layers=1))
    assert data["model_type"] == "kimi_k3" and data["architectures"] == ["KimiK3ForConditionalGeneration"]
    assert "vision_config" not in data
    text = data["text_config"]
    assert text["model_type"] == "kimi_linear"
    expected = {
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "attn_res_block_size": 2,
        "routed_expert_hidden_size": 32,
        "latent_moe_use_norm": True,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "topk_method": "noaux_tc",
        "routed_scaling_factor": 1.0,
        "num_nextn_predict_layers": 1,
        "rms_norm_eps": 1e-6,
        "first_k_dense_replace": 1,
    }
    assert {key: text[key] for key in expected} == expected
    assert text["linear_attn_config"] == {
        "full_attn_layers": [2, 4],
        "kda_layers": [1, 3],
        "num_heads": 2,
        "head_dim": 16,
        "short_conv_kernel_size": 4,
        "gate_lower_bound": -5.0,
        "use_full_rank_gate": True,
    }


def test_absent_k3_fields_take_the_engines_defaults():
    text = {
        key: value
        for key, value in kimi_k3.text_config_to_hf(load_preset("k3-nano")).items()
        if key
        not in ("latent_moe_use_norm", "first_k_dense_replace", "mlp_layer_types", "activation_situ_beta")
    }
    config = kimi_k3.config_from_hf({"model_type": "kimi_k3", "text_config": text})
    assert config.moe_latent_norm is False and config.first_k_dense_replace == 0 and config.situ_beta1 == 1.0
    # where vLLM's KimiLinearConfig differs (mla_use_nope False, rms_norm_eps 1e-6) we follow mlx-lm's
    lean = {key: value for key, value in text.items() if key not in ("mla_use_nope", "rms_norm_eps")}
    config = kimi_k3.config_from_hf({"model_type": "kimi_k3", "text_config": lean})
    assert config.rms_norm_eps == 1e-5 and not config.mla_rope


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"mla_use_output_gate": "yes"}, "mla_use_output_gate: 'yes' should be true or false"),
        ({"attn_res_block_size": 2.5}, "attn_res_block_size: 2.5 should be an integer"),
        ({"activation_situ_linear_beta": None}, "activation_situ_linear_beta null"),
        ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func 'softmax' is not supported"),
        ({"topk_method": "greedy"}, "topk_method 'greedy' is not supported"),
        ({"mla_use_nope": False}, "mla_use_nope False is not supported"),
        ({"model_type": "deepseek_v3"}, "text_config.model_type 'deepseek_v3' is not supported"),
        ({"linear_attn_config": {"gate_lower_bound": 1.0}}, "gate_lower_bound 1.0 should be negative"),
        ({"linear_attn_config": {"use_full_rank_gate": 1}}, "use_full_rank_gate: 1 should be true or false"),
    ],
)
def test_bad_text_config_fields_are_named(tmp_path: Path, change: dict, message: str):
    root = to_hf(_model(), tmp_path / "ckpt")
    data = json.loads((root / "config.json").read_text())
    for key, value in change.items():
        if key == "linear_attn_config":
            data["text_config"][key].update(value)
        else:
            data["text_config"][key] = value
    (root / "config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=message):
        from_hf(root)


def test_a_kimi_k3_config_without_text_config_is_refused(tmp_path: Path):
    root = to_hf(_model(), tmp_path / "ckpt")
    (root / "config.json").write_text(json.dumps({"model_type": "kimi_k3"}))
    with pytest.raises(CheckpointError, match="needs a text_config object"):
        from_hf(root)


# ------------------------------------------------------------------------------------------------ weights


@pytest.mark.parametrize(
    "overrides",
    [
        {"num_nextn_predict_layers": 1},
        {"num_hidden_layers": 6, "mla_layers": (3, 6), "attnres_block_size": 2},  # 3 AttnRes blocks
        {"attnres_block_size": 1, "moe_latent_norm": False, "tie_word_embeddings": True},
    ],
)
def test_to_hf_from_hf_round_trip(tmp_path: Path, overrides: dict):
    ours = _model(**overrides)
    root = to_hf(ours, tmp_path / "ckpt")
    assert json.loads((root / "config.json").read_text())["model_type"] == "kimi_k3"
    names = set(load_file(root / SINGLE_FILE))
    assert (
        f"{P}output_attn_res_proj.weight" in names and f"{P}layers.0.self_attention_res_norm.weight" in names
    )
    assert ("language_model.lm_head.weight" in names) is not ours.config.tie_word_embeddings
    _assert_same(ours, from_hf(root))


def test_mtp_layers_use_the_released_names(tmp_path: Path):
    root = to_hf(_model(num_nextn_predict_layers=1), tmp_path / "ckpt")
    tensors = load_file(root / SINGLE_FILE)
    layer = f"{P}layers.4."
    for leaf in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head", "self_attn.g_proj"):
        assert layer + leaf + ".weight" in tensors
    assert layer + "block_sparse_moe.routed_expert_up_proj.weight" in tensors
    assert not [key for key in tensors if key.startswith(layer) and "_res_" in key]  # no AttnRes in MTP
    assert torch.equal(tensors[layer + "shared_head.head.weight"], tensors["language_model.lm_head.weight"])
    assert tensors[f"{P}layers.0.self_attn.A_log"].shape == (2,)  # vLLM's current 1-D A_log
    assert tensors[f"{P}layers.0.self_attention_res_proj.weight"].shape == (1, 64)


def test_sharded_round_trip(tmp_path: Path):
    ours = _model(num_nextn_predict_layers=1)
    root = to_hf(ours, tmp_path / "ckpt", max_shard_bytes=100_000)
    index = json.loads((root / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 2 and not (root / SINGLE_FILE).exists()
    assert all(key.startswith("language_model.") for key in index["weight_map"])
    _assert_same(ours, from_hf(root))


def test_the_read_variants(tmp_path: Path):
    """``language_model.layers.{i}``, mlx-lm's ``*_res.proj_weight`` / ``.norm_weight``, A_log [1, 1, H, 1],
    {q,k,v}_conv1d [H·K, W], and AttnRes tensors a K3 checkpoint carries for its MTP layer (skipped)."""
    ours = _model(num_nextn_predict_layers=1)
    root = to_hf(ours, tmp_path / "ckpt")

    def change(tensors: dict[str, torch.Tensor]) -> None:
        for key in list(tensors):
            new = key.replace(f"{P}layers.", "language_model.layers.")
            new = new.replace("_res_proj.weight", "_res.proj_weight").replace(
                "_res_norm.weight", "_res.norm_weight"
            )
            value = tensors.pop(key)
            if key.endswith("A_log"):
                value = value.reshape(1, 1, -1, 1)
            elif key.endswith("_conv1d.weight"):
                value = value.squeeze(1)  # [H·K, W]
            tensors[new] = value
        tensors[f"{P}layers.4.self_attention_res_proj.weight"] = torch.zeros(1, 64)
        tensors[f"{P}layers.4.mlp_res_norm.weight"] = torch.ones(64)

    _rewrite(root, change)
    assert f"{P}output_attn_res.proj_weight" in load_file(root / SINGLE_FILE)
    _assert_same(ours, from_hf(root))
    assert from_hf(root, mtp=False).config.num_nextn_predict_layers == 0


@pytest.mark.parametrize("tied", [False, True])
def test_the_short_names_without_model_load(tmp_path: Path, tied: bool):
    """Every ``language_model.model.`` as ``language_model.`` (facts.md's ``language_model.embed_tokens``):
    embedding, final norm, ``output_attn_res_{norm,proj}`` and layers; the head stays ``language_model.lm_head``
    (a tied head's stored copy is skipped)."""
    ours = _model(num_nextn_predict_layers=1, tie_word_embeddings=tied)
    root = to_hf(ours, tmp_path / "ckpt")

    def change(tensors: dict[str, torch.Tensor]) -> None:
        for key in list(tensors):
            tensors[key.replace(P, "language_model.")] = tensors.pop(key)
        if tied:
            tensors["language_model.lm_head.weight"] = tensors["language_model.embed_tokens.weight"].clone()

    _rewrite(root, change)
    assert "language_model.embed_tokens.weight" in load_file(root / SINGLE_FILE)
    _assert_same(ours, from_hf(root))


def test_a_flat_kimi_linear_config_with_k3_fields_reads_unprefixed(tmp_path: Path):
    """The text config alone (model_type kimi_linear, K3 fields) with the names without ``language_model.``,
    as mlx-lm's kimi_k3 also loads a config without text_config."""
    ours = _model(num_nextn_predict_layers=1)
    root = to_hf(ours, tmp_path / "ckpt")
    data = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps(data["text_config"]))

    def change(tensors: dict[str, torch.Tensor]) -> None:
        for key in list(tensors):
            tensors[key.removeprefix("language_model.")] = tensors.pop(key)

    _rewrite(root, change)
    _assert_same(ours, from_hf(root))


def test_bad_checkpoints_list_what_is_wrong(tmp_path: Path):
    root = to_hf(_model(), tmp_path / "ckpt")

    def change(tensors: dict[str, torch.Tensor]) -> None:
        del tensors[f"{P}layers.1.self_attn.g_proj.weight"]
        tensors[f"{P}layers.0.extra.weight"] = torch.zeros(2)
        tensors[f"{P}output_attn_res_proj.weight"] = torch.zeros(64)
        tensors["vision_tower.patch_embed.proj.weight"] = torch.zeros(2)

    _rewrite(root, change)
    with pytest.raises(CheckpointError) as error:
        from_hf(root)
    message = str(error.value)
    assert f"1 missing tensor: {P}layers.1.self_attn.g_proj.weight" in message
    assert f"2 unexpected tensors: {P}layers.0.extra.weight, vision_tower.patch_embed.proj.weight" in message
    assert f"1 mis-shaped tensor: {P}output_attn_res_proj.weight (64,) (expected (1, 64))" in message


def test_a_vision_config_is_not_read_as_text_only(tmp_path: Path):
    root = to_hf(_model(), tmp_path / "ckpt")
    data = json.loads((root / "config.json").read_text())
    with pytest.raises(ConfigError, match="vision_config"):
        kimi_k3.config_from_hf({**data, "vision_config": {"vt_hidden_size": 32}})


def test_weight_groups_take_a_key_prefix():
    config = load_preset("k3-nano")
    state = build_model(config, device="meta").state_dict()
    groups = kimi_k3.weight_groups(config, state, prefix="lm.", slot_prefix="language_model.")
    first = groups[0].canonical()[0]
    assert (first.name, first.slots[0].key) == ("lm.model.embed_tokens.weight", "language_model.embed.weight")
    assert (
        kimi_k3.decoder_name("lm.layers.3.mlp.gate_proj.weight", "lm.")
        == "model.layers.3.mlp.gate_proj.weight"
    )


# ------------------------------------------------------------------------------------------------- dispatch


@pytest.mark.parametrize(
    "feature",
    [
        {"kda_gate": "lower_bound"},
        {"kda_output_gate": "full_rank"},
        {"mla_output_gate": True},
        {"mlp_activation": "situ_glu"},
        {"moe_latent_size": 32},
        {"attnres_block_size": 2},
    ],
)
def test_each_k3_feature_writes_kimi_k3(tmp_path: Path, feature: dict):
    ours = _model(**{**KIMI_LINEAR_STYLE, **feature})
    assert checkpoint_model_type(ours.config) == "kimi_k3"
    root = to_hf(ours, tmp_path / "ckpt")
    assert json.loads((root / "config.json").read_text())["model_type"] == "kimi_k3"
    _assert_same(ours, from_hf(root))


def test_kimi_linear_models_stay_kimi_linear(tmp_path: Path):
    config = load_preset("k3-nano", **KIMI_LINEAR_STYLE)
    assert checkpoint_model_type(config) == "kimi_linear"
    assert checkpoint_model_type(load_preset("k2-nano")) == "deepseek_v3"


def test_init_hf_writes_kimi_k3(tmp_path: Path):
    with pytest.raises(SystemExit) as done:
        main(["init", "--preset", "k3-nano", "--hf", "--out", str(tmp_path / "hf")])
    assert done.value.code == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "kimi_k3"
    loaded = from_hf(tmp_path / "hf")
    assert isinstance(loaded, CausalLM) and loaded.config == load_preset("k3-nano").replace(name="hf")


def test_export_writes_kimi_k3(tmp_path: Path, tokenizer, model_dir: Path):
    ours = nano_for(tokenizer, "k3-nano")
    source = save_model(ours, tmp_path / "k3")
    out = export(
        ExportConfig(out=tmp_path / "out", tokenizer=model_dir / "tokenizer.json"),
        source,
        log=lambda line: None,
    )
    assert json.loads((out / "config.json").read_text())["model_type"] == "kimi_k3"
    loaded = from_hf(out)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in ours.state_dict().items())


def test_a_tied_kimi_k3_refuses_a_stored_head_that_is_not_the_embedding(tmp_path: Path):
    """The parent config's tie flag makes a stored ``language_model.lm_head.weight`` a copy: it must be one."""
    root = to_hf(_model(tie_word_embeddings=True), tmp_path / "ckpt")
    _rewrite(
        root,
        lambda t: t.update({"language_model.lm_head.weight": torch.ones_like(t[P + "embed_tokens.weight"])}),
    )
    with pytest.raises(CheckpointError, match="language_model.lm_head.weight differs from the embedding"):
        from_hf(root)
