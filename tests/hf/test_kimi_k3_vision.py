"""Kimi K3's MoonViT-V2 in the released ``kimi_k3`` layout: vision_config both ways, the tensor names and shapes
vLLM's loader expects, a hand-written forward of the released tower over those tensors, and a K3 VLM through
``to_hf`` -> ``from_hf`` (same state, same logits on image + text)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from k2lab.config import ConfigError
from k2lab.errors import CheckpointError
from k2lab.hf import kimi_k3_vision
from k2lab.hf.io import from_hf, to_hf
from k2lab.hf.layout import gather
from k2lab.presets.vision_language import load_vlm_preset
from k2lab.vision.config import FP32_EPS, VisionConfig
from k2lab.vision.moonvit import MoonViT3D
from k2lab.vision.vlm import VisionLanguageModel, VLMConfig, build_vlm
from tests.conftest import randomize

VOCAB = 300
GRIDS = [[1, 4, 6], [1, 8, 8], [3, 2, 4]]  # two images and a 3-frame volume (patch grids)


def nano() -> VLMConfig:
    return load_vlm_preset("k3-vl-nano", vocab_size=VOCAB)


def pixels(grids: list[list[int]], patch: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(t * h * w for t, h, w in grids), 3, patch, patch, generator=g)


# ------------------------------------------------------------------------------------------------ config


def test_released_defaults_are_our_moonvit_v2() -> None:
    """An empty vision_config means vLLM's KimiK3VisionConfig defaults: exactly ``VisionConfig.moonvit_v2()``."""
    assert kimi_k3_vision.vision_config_from_hf({}, 7168) == VisionConfig.moonvit_v2(text_hidden_size=7168)
    released = {  # the released vision_config's values (vllm/transformers_utils/configs/kimi_k3.py)
        "model_type": "kimi_k3_vision", "patch_size": 14, "init_pos_emb_height": 64, "init_pos_emb_width": 64,
        "init_pos_emb_time": 4, "pos_emb_type": "divided_fixed", "vt_num_attention_heads": 12,
        "vt_num_hidden_layers": 27, "vt_hidden_size": 1024, "vt_intermediate_size": 4096,
        "merge_kernel_size": [2, 2], "video_attn_type": "spatial_temporal", "merge_type": "sd2_tpool",
        "mm_projector_type": "patchmergerv2", "mm_hidden_size": 1024, "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-5, "qkv_hidden_size": 1536, "norm_type": "rmsnorm", "attn_bias": False,
        "patch_embed_proj_bias": False, "mlp_type": "mlp2", "linear_bias": False,
        "activation_func": "gelu_pytorch_tanh", "pos_emb_interpolation_mode": "bilinear",
        "text_hidden_size": 7168, "_attn_implementation": "flash_attention_2",
    }  # fmt: skip
    ours = kimi_k3_vision.vision_config_from_hf(released, 7168)
    assert (ours.hidden_size, ours.attention_width, ours.head_dim, ours.num_attention_heads) == (
        1024,
        1536,
        128,
        12,
    )
    assert (ours.norm, ours.bias, ours.merge, ours.layer_norm_eps) == (
        "rmsnorm",
        False,
        "pixel_shuffle",
        2.0**-23,
    )
    written = kimi_k3_vision.vision_config_to_hf(ours)
    assert written == {k: v for k, v in released.items() if not k.startswith("_")}


@pytest.mark.parametrize(
    "vision",
    [
        load_vlm_preset("k3-vl-nano").vision,
        load_vlm_preset("k3-vl-mini").vision,
        VisionConfig.moonvit_v2(hidden_act="gelu"),
        VisionConfig.moonvit_v2(pos_emb_interpolation="bicubic", merge_kernel_size=(2, 1), projection_layer_norm_eps=1e-6),
    ],
    ids=["nano", "mini", "gelu", "bicubic-2x1"],
)  # fmt: skip
def test_vision_config_round_trip(vision: VisionConfig) -> None:
    data = json.loads(json.dumps(kimi_k3_vision.vision_config_to_hf(vision)))  # as config.json holds it
    assert data["model_type"] == "kimi_k3_vision"
    assert kimi_k3_vision.vision_config_from_hf(data, vision.text_hidden_size) == vision


def test_unsupported_vision_options_are_named() -> None:
    bad = {
        "norm_type": "layernorm",
        "attn_bias": True,
        "mm_projector_type": "patchmerger",
        "merge_type": "sd2",
    }
    with pytest.raises(ConfigError, match="unsupported MoonViT-V2 options") as caught:
        kimi_k3_vision.vision_config_from_hf(bad, 64)
    for key, value in bad.items():
        assert f"{key}={value!r}" in str(caught.value)
    with pytest.raises(ConfigError, match="mm_hidden_size=512"):
        kimi_k3_vision.vision_config_from_hf({"mm_hidden_size": 512}, 64)
    for tower, reason in (
        (VisionConfig.moonvit_3d(), "norm='layernorm'"),
        (VisionConfig.moonvit_v2(layer_norm_eps=1e-6), "layer_norm_eps=1e-06"),
        (VisionConfig.moonvit_v2(rope_theta=100.0), "rope_theta=100.0"),
    ):
        with pytest.raises(ConfigError, match=reason):
            kimi_k3_vision.vision_config_to_hf(tower)


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("merge_kernel_size", 2, "two integers"),
        ("merge_kernel_size", [2, 2, 2], "two integers"),
        ("merge_kernel_size", [2.0, 2], "two integers"),
        ("vt_hidden_size", "1024", "an integer"),
        ("vt_num_hidden_layers", 2.0, "an integer"),
        ("patch_size", True, "an integer"),
        ("mm_hidden_size", "1024", "an integer or null"),
        ("projector_ln_eps", "1e-5", "a number"),
        ("activation_func", 1, "a string"),
    ],
)
def test_wrong_types_are_named(field: str, value: object, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        kimi_k3_vision.vision_config_from_hf({field: value}, 64)
    assert str(caught.value) == f"vision_config.{field}: {value!r} should be {expected}"


def test_every_wrong_type_is_listed() -> None:
    with pytest.raises(ConfigError, match="vt_hidden_size: '8' .*; vision_config.merge_kernel_size: 2 "):
        kimi_k3_vision.vision_config_from_hf({"vt_hidden_size": "8", "merge_kernel_size": 2}, 64)


# ----------------------------------------------------------------------------------------------- weights


def released_names(vision: VisionConfig) -> dict[str, tuple[int, ...]]:
    """What vLLM's ``KimiK3ForConditionalGeneration.load_weights`` accepts for the tower and projector.

    From vllm/model_executor/models/kimi_k25_vit.py (``MoonViT3dPretrainedModel`` -> ``patch_embed.proj``
    Conv2d without bias, ``patch_embed.pos_emb.weight`` [H, W, D]; ``encoder.blocks.{i}`` =
    ``MoonViTEncoderLayer``: ``norm0``/``norm1`` nn.RMSNorm, ``wqkv`` QKVParallelLinear(D, heads of
    qkv_hidden_size / heads) [3A, D], ``wo`` [D, A], ``mlp.fc0`` [F, D], ``mlp.fc1`` [D, F];
    ``encoder.final_layernorm``; ``KimiK25MultiModalProjector`` patchmergerv2: ``linear_1`` [kD, kD],
    ``linear_2`` [T, kD], ``post_norm`` [T]) and vllm/models/kimi_k3/nvidia/model.py (``hf_to_vllm_mapper``:
    checkpoint ``mm_projector.proj.0`` / ``.proj.2`` -> ``linear_1`` / ``linear_2``). All bias-free.
    """
    d, a, f, p = vision.hidden_size, vision.attention_width, vision.intermediate_size, vision.patch_size
    k, t = vision.merge_area, vision.text_hidden_size
    names = {
        "vision_tower.patch_embed.proj.weight": (d, 3, p, p),
        "vision_tower.patch_embed.pos_emb.weight": (vision.pos_emb_height, vision.pos_emb_width, d),
        "vision_tower.encoder.final_layernorm.weight": (d,),
        "mm_projector.proj.0.weight": (k * d, k * d),
        "mm_projector.proj.2.weight": (t, k * d),
        "mm_projector.post_norm.weight": (t,),
    }
    for i in range(vision.num_hidden_layers):
        block = f"vision_tower.encoder.blocks.{i}."
        names |= {
            block + "norm0.weight": (d,),
            block + "wqkv.weight": (3 * a, d),
            block + "wo.weight": (d, a),
            block + "norm1.weight": (d,),
            block + "mlp.fc0.weight": (f, d),
            block + "mlp.fc1.weight": (d, f),
        }
    return names


def disk_tensors(tower: MoonViT3D) -> dict[str, torch.Tensor]:
    state = {"vision." + key: value for key, value in tower.state_dict().items()}
    groups = kimi_k3_vision.vision_weight_groups(tower.config, state)
    return {t.name: gather(state, t) for group in groups for t in group.canonical()}


@pytest.mark.parametrize("preset", ["k3-vl-nano", "k3-vl"])
def test_written_names_and_shapes_are_vllms(preset: str) -> None:
    vision = load_vlm_preset(preset).vision
    with torch.device("meta"):
        tower = MoonViT3D(vision)
    state = {"vision." + key: value for key, value in tower.state_dict().items()}
    written = {
        t.name: t.shape
        for group in kimi_k3_vision.vision_weight_groups(vision, state)
        for t in group.canonical()
    }
    assert written == released_names(vision)


def released_forward(
    disk: dict[str, torch.Tensor], cfg: dict, pixel_values: torch.Tensor, grids
) -> torch.Tensor:
    """The released tower + patchmergerv2 over the checkpoint tensors, written from vLLM's code (not ours):
    complex-pair rope on wqkv's (2j, 2j+1) rows, nn.RMSNorm's default eps, bilinear grid, tpool merge."""
    d, heads, a = cfg["vt_hidden_size"], cfg["vt_num_attention_heads"], cfg["qkv_hidden_size"]
    hd, (kh, kw), p = a // heads, cfg["merge_kernel_size"], cfg["patch_size"]
    vt = "vision_tower."
    x = F.conv2d(pixel_values, disk[vt + "patch_embed.proj.weight"], stride=p).flatten(1)
    grid = disk[vt + "patch_embed.pos_emb.weight"].permute(2, 0, 1)[None]
    omega = 1.0 / 10000 ** (torch.arange(d // 2, dtype=torch.float32) / (d / 2))
    freqs = 1.0 / 10000 ** (torch.arange(0, hd, 4)[: hd // 4].float() / hd)
    pos, cis = [], []
    for t, h, w in grids:
        spatial = F.interpolate(grid, size=(h, w), mode="bilinear")[0].permute(1, 2, 0).reshape(h * w, d)
        frames = torch.arange(t, dtype=torch.float32)[:, None] * omega
        time = torch.cat([frames.sin(), frames.cos()], -1)[:, None] if t > 1 else 0.0
        pos.append((spatial + time).reshape(-1, d))
        ys, xs = torch.meshgrid(torch.arange(h).float(), torch.arange(w).float(), indexing="ij")
        angles = torch.stack([xs.reshape(-1, 1) * freqs, ys.reshape(-1, 1) * freqs], -1).reshape(h * w, -1)
        cis.append(torch.polar(torch.ones_like(angles), angles).repeat(t, 1))
    x, cis = x + torch.cat(pos), torch.cat(cis)  # cis [N, hd/2]

    def rope(v: torch.Tensor) -> torch.Tensor:  # [N, heads, hd], pairs (2j, 2j+1) rotated by cis_j
        z = torch.view_as_complex(v.reshape(*v.shape[:-1], -1, 2)) * cis[:, None]
        return torch.view_as_real(z).flatten(-2)

    lengths = [t * h * w for t, h, w in grids]
    for i in range(cfg["vt_num_hidden_layers"]):
        b = f"{vt}encoder.blocks.{i}."
        q, k, v = (
            (F.rms_norm(x, (d,), disk[b + "norm0.weight"]) @ disk[b + "wqkv.weight"].T)
            .view(-1, 3, heads, hd)
            .unbind(1)
        )
        q, k = rope(q), rope(k)
        out = []
        for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True):
            weights = torch.softmax(torch.einsum("nhd,mhd->hnm", qs, ks) / math.sqrt(hd), -1)
            out.append(torch.einsum("hnm,mhd->nhd", weights, vs).reshape(len(qs), a))
        x = x + torch.cat(out) @ disk[b + "wo.weight"].T
        hidden = F.rms_norm(x, (d,), disk[b + "norm1.weight"]) @ disk[b + "mlp.fc0.weight"].T
        x = x + F.gelu(hidden, approximate="tanh") @ disk[b + "mlp.fc1.weight"].T
    x = F.rms_norm(x, (d,), disk[vt + "encoder.final_layernorm.weight"])
    tokens = []
    for seq, (t, h, w) in zip(x.split(lengths), grids, strict=True):
        v = seq.view(t, h // kh, kh, w // kw, kw, d).mean(0).permute(0, 2, 1, 3, 4)
        tokens.append(v.reshape(-1, kh * kw * d))
    y = (
        F.gelu(torch.cat(tokens) @ disk["mm_projector.proj.0.weight"].T)
        @ disk["mm_projector.proj.2.weight"].T
    )
    return F.rms_norm(y, (y.shape[-1],), disk["mm_projector.post_norm.weight"], eps=cfg["projector_ln_eps"])


def test_our_tower_is_the_released_one() -> None:
    """Our MoonViT-V2 features equal a from-the-code forward of the released tower on the written tensors."""
    vision = load_vlm_preset("k3-vl-nano").vision.model_copy(update={"num_hidden_layers": 2})
    torch.manual_seed(0)
    tower = MoonViT3D(vision).eval()
    randomize(tower, seed=3)
    x = pixels(GRIDS, vision.patch_size)
    with torch.no_grad():
        ours = tower(x, torch.tensor(GRIDS)).features
        theirs = released_forward(disk_tensors(tower), kimi_k3_vision.vision_config_to_hf(vision), x, GRIDS)
    assert ours.shape == (6 + 16 + 2, vision.text_hidden_size)
    assert (ours - theirs).abs().max().item() <= 1e-5
    assert torch.finfo(torch.float32).eps == FP32_EPS


# ---------------------------------------------------------------------------------------------- the VLM


def image_text_inputs(config: VLMConfig) -> dict[str, torch.Tensor]:
    """One sequence: text, an image of 4×6 patches (6 placeholders), text, an image of 8×8 (16), text."""
    grids = GRIDS[:2]
    image, start, end = config.image_token_id, config.vision_start_token_id, config.vision_end_token_id
    g = torch.Generator().manual_seed(1)

    def text(n: int) -> list[int]:
        return torch.randint(40, VOCAB, (n,), generator=g).tolist()

    ids = text(3) + [start, *[image] * 6, end] + text(2) + [start, *[image] * 16, end] + text(4)
    return {
        "input_ids": torch.tensor([ids]),
        "pixel_values": pixels(grids, config.vision.patch_size, seed=2),
        "image_grid_thw": torch.tensor(grids),
    }


@pytest.fixture(scope="module")
def k3_vlm() -> VisionLanguageModel:
    return randomize(build_vlm(nano()), seed=5)


@pytest.fixture(scope="module")
def written(k3_vlm: VisionLanguageModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return to_hf(k3_vlm, tmp_path_factory.mktemp("k3vl") / "ckpt")


def test_round_trip_same_state_and_logits(k3_vlm: VisionLanguageModel, written: Path) -> None:
    raw = json.loads((written / "config.json").read_text())
    assert (raw["model_type"], raw["architectures"]) == ("kimi_k3", ["KimiK3ForConditionalGeneration"])
    assert raw["vision_config"]["model_type"] == "kimi_k3_vision"
    assert raw["media_placeholder_token_id"] == k3_vlm.config.image_token_id
    loaded = from_hf(written)
    assert isinstance(loaded, VisionLanguageModel)
    text = loaded.config.text.replace(name=k3_vlm.config.text.name)  # the name is the directory's
    assert loaded.config.model_copy(update={"text": text}) == k3_vlm.config
    ours, theirs = k3_vlm.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[key], theirs[key]) for key in ours)
    inputs = image_text_inputs(k3_vlm.config)
    with torch.no_grad():
        before, after = k3_vlm(**inputs).logits, loaded.eval()(**inputs).logits
    assert torch.equal(before, after)
    vision_keys = {
        k: v.shape
        for k, v in load_file(written / "model.safetensors").items()
        if not k.startswith("language_model.")
    }
    assert vision_keys == {k: torch.Size(v) for k, v in released_names(k3_vlm.config.vision).items()}


def rewrite(source: Path, target: Path, tensors=None, config=None) -> Path:
    """A copy of checkpoint ``source`` with its tensors / config.json changed by the two callables."""
    target.mkdir()
    state = load_file(source / "model.safetensors")
    save_file(tensors(state) if tensors else state, target / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((source / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(config(raw) if config else raw))
    return target


def test_the_short_text_names_load(k3_vlm: VisionLanguageModel, written: Path, tmp_path: Path) -> None:
    """Every ``language_model.model.X`` as ``language_model.X`` (facts.md's form) loads the same model."""
    short = rewrite(
        written,
        tmp_path / "short",
        tensors=lambda s: {k.replace("language_model.model.", "language_model."): v for k, v in s.items()},
    )
    assert "language_model.embed_tokens.weight" in load_file(short / "model.safetensors")
    ours, theirs = k3_vlm.state_dict(), from_hf(short).state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[key], theirs[key]) for key in ours)


def test_missing_vision_tensor_is_listed(written: Path, tmp_path: Path) -> None:
    wqkv = "vision_tower.encoder.blocks.0.wqkv.weight"
    broken = rewrite(
        written, tmp_path / "missing", tensors=lambda s: {k: v for k, v in s.items() if k != wqkv}
    )
    with pytest.raises(CheckpointError, match=rf"missing.*{wqkv}"):
        from_hf(broken)
    narrow = rewrite(
        written, tmp_path / "narrow", tensors=lambda s: {**s, wqkv: s[wqkv][: 3 * 32]}
    )  # a K2.5-style [3D, D] wqkv where the config says 3·qkv_hidden_size rows
    with pytest.raises(CheckpointError, match=rf"mis-shaped.*{wqkv} \(96, 32\) \(expected \(144, 32\)\)"):
        from_hf(narrow)


def test_unsupported_vision_option_in_a_checkpoint(written: Path, tmp_path: Path) -> None:
    def layernorm(raw: dict) -> dict:
        return {**raw, "vision_config": {**raw["vision_config"], "norm_type": "layernorm"}}

    with pytest.raises(CheckpointError, match="norm_type='layernorm' \\(only 'rmsnorm' is implemented\\)"):
        from_hf(rewrite(written, tmp_path / "ln", config=layernorm))


def test_k25_vlm_stays_kimi_k25(tmp_path: Path) -> None:
    model = build_vlm(load_vlm_preset("k25-nano", vocab_size=VOCAB))
    raw = json.loads((to_hf(model, tmp_path / "k25") / "config.json").read_text())
    assert raw["model_type"] == "kimi_k25" and "mm_projector.pre_norm.weight" in load_file(
        tmp_path / "k25" / "model.safetensors"
    )


def test_sharded_round_trip(k3_vlm: VisionLanguageModel, tmp_path: Path) -> None:
    out = to_hf(k3_vlm, tmp_path / "sharded", max_shard_bytes=64_000)
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 2 and "mm_projector.post_norm.weight" in weight_map
    loaded = from_hf(out).state_dict()
    assert all(torch.equal(value, loaded[key]) for key, value in k3_vlm.state_dict().items())
