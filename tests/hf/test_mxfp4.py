"""MXFP4 (compressed-tensors ``mxfp4-pack-quantized``): the codec against the format's definition, export and
load through ``to_hf`` / ``from_hf``, compressed-tensors' own dequantiser reading what we wrote, and the
refusals."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from k2lab import build_model, load_preset
from k2lab.config import ConfigError
from k2lab.errors import CheckpointError
from k2lab.hf import from_hf, to_hf
from k2lab.hf.io import SINGLE_FILE
from k2lab.hf.mxfp4 import dequantize_mxfp4, quantization_config, quantize_mxfp4
from k2lab.models import CausalLM
from tests.conftest import KIMI_LINEAR_STYLE, nano_variant, randomize

E2M1 = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
)  # the format's magnitudes (OCP MX spec), for independent checks
GRID = torch.tensor([-v for v in reversed(E2M1[1:])] + list(E2M1), dtype=torch.float64)


def _group_scales(scale: torch.Tensor, width: int) -> torch.Tensor:
    """2^(E8M0 − 127) per element, float64, [out, in]."""
    return torch.pow(2.0, scale.double() - 127).repeat_interleave(32, dim=-1)[..., :width]


def _weights() -> torch.Tensor:
    """[64, 128] with groups of very different ranges, an all-zero group and group maxima at the rounding
    thresholds of the scale rule (1.75 · 2^k and just below)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 128, generator=generator) * 0.05
    weight[:8, :32] *= 300
    weight[8:16, 32:64] *= 1e-4
    weight[16, 64:96] = 0
    weight[17, 96] = 1.75
    weight[18, 96] = 1.7499
    weight[19, 0] = -6.0 * 2**-3
    return weight


def test_pack_unpack_round_trip_within_the_format_error():
    weight = _weights()
    packed, scale = quantize_mxfp4(weight)
    assert packed.dtype == scale.dtype == torch.uint8
    assert packed.shape == (64, 64) and scale.shape == (64, 4)
    restored = dequantize_mxfp4(packed, scale)
    assert restored.dtype == torch.float32 and restored.shape == weight.shape

    s = _group_scales(scale, 128)
    w = weight.double()
    v = w.abs() / s
    # scale rule: e = floor(log2(round_to_power_2(amax))) − 2, so amax / 2^e lies in [3.5, 7) per non-zero group
    amax = v.view(64, 4, 32).amax(dim=-1)
    nonzero = weight.view(64, 4, 32).abs().amax(dim=-1) > 0
    assert ((amax >= 3.5) & (amax < 7))[nonzero].all()
    # every element is E2M1 × 2^e, within half the E2M1 spacing at |w| / 2^e (clamping at 6 within 1)
    half_spacing = torch.where(v <= 2, 0.25, torch.where(v <= 4, 0.5, 1.0))
    error = (w - restored.double()).abs()
    assert (error <= half_spacing * s).all()
    # ... and it is the nearest such value (ties either way)
    nearest = (w[..., None] - GRID * s[..., None]).abs().amin(dim=-1)
    assert torch.equal(error, nearest)
    assert restored[16, 64:96].abs().sum() == 0


def test_values_already_representable_come_back_exactly():
    generator = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (48, 96), dtype=torch.uint8, generator=generator)
    scale = torch.randint(100, 150, (48, 6), dtype=torch.uint8, generator=generator)
    weight = dequantize_mxfp4(packed, scale)
    again = dequantize_mxfp4(*quantize_mxfp4(weight))
    assert torch.equal(again, weight)


def test_quantising_the_dequantised_weights_again_gives_the_same_bytes():
    """Small negative weights round to E2M1 −0 (code 8), which dequantises to 0.0 and packed again as +0:
    an export of an MXFP4 export differed in those nibbles. Zeros are written as +0 from the first."""
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(64, 128, generator=generator)
    weight[:, ::3] *= 1e-3  # far below each group's scale / 4: rounds to ±0
    packed, scale = quantize_mxfp4(weight)
    assert not ((packed & 0x0F) == 8).any() and not ((packed >> 4) == 8).any()
    again = quantize_mxfp4(dequantize_mxfp4(packed, scale))
    assert torch.equal(again[0], packed) and torch.equal(again[1], scale)


def test_codes_decode_as_the_format_defines():
    # byte 0x7A: low nibble 0xA (element 0) = sign 1, magnitude index 2 -> -1.0; high nibble 0x7 -> +6.0;
    # 0x93: 0x3 -> +1.5, 0x9 -> -0.5; 0x8F: 0xF -> -6.0, 0x8 -> -0.0
    packed = torch.zeros(1, 16, dtype=torch.uint8)
    packed[0, 0], packed[0, 1], packed[0, 15] = 0x7A, 0x93, 0x8F
    scale = torch.tensor([[127 + 3]], dtype=torch.uint8)
    weight = dequantize_mxfp4(packed, scale)
    expected = torch.zeros(1, 32)
    expected[0, :4] = torch.tensor([-1.0, 6.0, 1.5, -0.5]) * 2**3
    expected[0, 30:] = torch.tensor([-6.0, -0.0]) * 2**3
    assert torch.equal(weight, expected)


def test_quantize_refuses_partial_groups():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.zeros(4, 48))


# ---- to_hf(quantize="mxfp4") -> from_hf ------------------------------------------------------------------

VARIANTS = {
    "deepseek_v3": dict(preset="k2-nano"),
    "kimi_linear": dict(preset="k3-nano", **KIMI_LINEAR_STYLE),
}


def _model(variant: str) -> CausalLM:
    overrides = dict(VARIANTS[variant])
    preset = overrides.pop("preset")
    return randomize(build_model(load_preset(preset, **overrides)), std=0.1)


def _fake_quantized(model: CausalLM) -> CausalLM:
    """The model with every routed expert replaced by its MXFP4 round trip, built directly."""
    reference = _model_like(model)
    with torch.no_grad():
        for key, value in reference.state_dict().items():
            if ".mlp.experts." in key:
                value.copy_(torch.stack([dequantize_mxfp4(*quantize_mxfp4(w)) for w in value]))
    return reference.eval()


def _model_like(model: CausalLM) -> CausalLM:
    copy = build_model(model.config)
    copy.load_state_dict(model.state_dict())
    return copy


def logit_error(exact: torch.Tensor, other: torch.Tensor) -> dict[str, float]:
    """max |dlogit|, rms(dlogit) / rms(logit) and the share of positions with the same argmax."""
    delta = other - exact
    return {
        "max_abs": round(delta.abs().max().item(), 4),
        "rms_rel": round((delta.pow(2).mean() / exact.pow(2).mean()).sqrt().item(), 4),
        "top1_agree": round((other.argmax(-1) == exact.argmax(-1)).float().mean().item(), 3),
    }


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mxfp4_export_round_trips(variant: str, tmp_path: Path):
    model = _model(variant)
    out = to_hf(model, tmp_path / "mxfp4", quantize="mxfp4")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == variant
    assert config["quantization_config"] == quantization_config()
    disk = load_file(out / SINGLE_FILE)
    packed = [key for key in disk if key.endswith(".weight_packed")]
    moe_layers = sum(map(model.config.is_moe_layer, range(model.config.num_hidden_layers)))
    assert len(packed) == 3 * model.config.n_routed_experts * moe_layers
    assert all(".experts." in key and ".shared_experts." not in key for key in packed)
    assert not any(".experts." in key and key.endswith(".weight") and "shared" not in key for key in disk)

    loaded = from_hf(out).eval()
    reference = _fake_quantized(model)
    for key, value in reference.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    ids = _tokens(model.config.vocab_size)
    with torch.no_grad():
        exact, quantized = model(ids).logits, loaded(ids).logits
    assert torch.equal(quantized, reference(ids).logits)
    figures = logit_error(exact, quantized)
    print(f"\nMXFP4 {variant} (experts only) vs the unquantised model: {figures}")
    assert 0 < figures["rms_rel"] < 0.25 and figures["top1_agree"] >= 0.75


def test_compressed_tensors_dequantizer_reads_our_export(tmp_path: Path):
    from compressed_tensors.entrypoints.convert.converters import CompressedTensorsDequantizer

    model = _model("deepseek_v3")
    out = to_hf(model, tmp_path / "mxfp4", quantize="mxfp4")
    dequantizer = CompressedTensorsDequantizer(out, dtype=torch.float32)  # validates our quantization_config
    theirs = dequantizer.validate(load_file(out / SINGLE_FILE))
    ours = from_hf(out).state_dict()
    layer = model.config.first_k_dense_replace
    for e in range(model.config.n_routed_experts):
        for projection in ("gate_proj", "up_proj", "down_proj"):
            key = f"model.layers.{layer}.mlp.experts.{e}.{projection}.weight"
            assert torch.equal(theirs[key], ours[f"layers.{layer}.mlp.experts.{projection}"][e]), key


# ---- refusals and bad checkpoints ------------------------------------------------------------------------


def test_mxfp4_refuses_models_it_cannot_hold(tmp_path: Path):
    dense = nano_variant(first_k_dense_replace=2)
    with pytest.raises(ConfigError, match="has none \\(a dense model\\)"):
        to_hf(dense, tmp_path / "dense", quantize="mxfp4")
    ragged = nano_variant(moe_intermediate_size=48)
    with pytest.raises(ConfigError, match="multiple of 32: model.layers.1.mlp.experts.0.down_proj.weight"):
        to_hf(ragged, tmp_path / "ragged", quantize="mxfp4")
    with pytest.raises(ConfigError, match="'int4' is not a format"):
        to_hf(dense, tmp_path / "int4", quantize="int4")  # type: ignore[arg-type]
    assert not any(tmp_path.iterdir())


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return to_hf(_model("deepseek_v3"), tmp_path_factory.mktemp("mxfp4") / "nano", quantize="mxfp4")


def _copy(exported: Path, tmp_path: Path, edit_config=None, edit_tensors=None) -> Path:
    root = tmp_path / "bad"
    root.mkdir(parents=True)
    config = json.loads((exported / "config.json").read_text())
    tensors = load_file(exported / SINGLE_FILE)
    if edit_config:
        edit_config(config)
    if edit_tensors:
        edit_tensors(tensors)
    (root / "config.json").write_text(json.dumps(config))
    save_file({key: value.contiguous() for key, value in tensors.items()}, str(root / SINGLE_FILE))
    return root


EXPERT = "model.layers.1.mlp.experts.3.up_proj."


def test_bad_mxfp4_checkpoints_are_listed(exported: Path, tmp_path: Path):
    cases = [
        (
            dict(edit_tensors=lambda t: t.pop(EXPERT + "weight_scale")),
            f"1 missing tensor: {EXPERT}weight_scale",
        ),
        (
            dict(
                edit_tensors=lambda t: t.__setitem__(
                    EXPERT + "weight_scale", t[EXPERT + "weight_scale"][:, :1]
                )
            ),
            re.escape(f"mis-shaped tensor: {EXPERT}weight_scale U8 (32, 1) (expected U8 (32, 2))"),
        ),
        (
            dict(
                edit_tensors=lambda t: t.__setitem__(
                    EXPERT + "weight_packed", t[EXPERT + "weight_packed"].float()
                )
            ),
            re.escape(f"{EXPERT}weight_packed F32 (32, 32) (expected U8 (32, 32))"),
        ),
        (
            dict(edit_config=lambda c: c.pop("quantization_config")),
            "24 missing tensors: .* 48 unexpected tensors: model.layers.1.mlp.experts.0.down_proj.weight_packed",
        ),
        (
            dict(edit_config=lambda c: c["quantization_config"].update(format="pack-quantized")),
            "format 'pack-quantized' \\(only 'mxfp4-pack-quantized'\\)",
        ),
        (
            dict(
                edit_config=lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(
                    group_size=16
                )
            ),
            "not MXFP4: group_0.weights.group_size = 16 \\(expected 32\\)",
        ),
    ]
    for index, (edits, message) in enumerate(cases):
        with pytest.raises(CheckpointError, match=message):
            from_hf(_copy(exported, tmp_path / str(index), **edits))


def test_the_config_may_sit_in_text_config(exported: Path, tmp_path: Path):
    def move(config: dict) -> None:
        config["text_config"] = {"quantization_config": config.pop("quantization_config")}

    loaded = from_hf(_copy(exported, tmp_path, edit_config=move))
    assert torch.equal(
        loaded.state_dict()["layers.1.mlp.experts.up_proj"],
        from_hf(exported).state_dict()["layers.1.mlp.experts.up_proj"],
    )


# ---- kimi_k3: the released layout, read by mlx-lm ---------------------------------------------------------


def test_mxfp4_kimi_k3_export_loads_in_mlx_lm_with_our_logits(tmp_path: Path):
    """mlx-lm's loader maps the same codes and scales to MLX's own mxfp4 kernels (``QuantizedSwitchLinear``,
    MLX CPU): its fp32 logits must match our from_hf of the same export (both use the dequantised codes)."""
    pytest.importorskip("mlx_lm.models.kimi_k3")  # optional: the independent reference
    from tests.hf import mlx_k3
    from tests.hf.test_kimi_k3_mlx import TOLERANCE, tiny_config, token_ids

    config = tiny_config(num_nextn_predict_layers=1)
    model = randomize(build_model(config), std=0.1)
    out = to_hf(model, tmp_path / "k3", quantize="mxfp4")
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "kimi_k3" and "quantization_config" not in written
    assert written["text_config"]["quantization_config"] == quantization_config()
    disk = load_file(out / SINGLE_FILE)
    expert = "language_model.model.layers.1.block_sparse_moe.experts.0.w2."
    assert disk[expert + "weight_packed"].shape == (config.moe_latent_size, config.moe_intermediate_size // 2)
    assert disk[expert + "weight_scale"].shape == (config.moe_latent_size, config.moe_intermediate_size // 32)
    mtp_expert = f"language_model.model.layers.{config.num_hidden_layers}.block_sparse_moe.experts.0.w1."
    assert mtp_expert + "weight_packed" in disk  # the MTP layer's routed experts too

    loaded = from_hf(out).eval()
    reference = mlx_k3.load(out)
    switch = reference.language_model.model.layers[1].mlp.switch_mlp.down_proj
    assert type(switch).__name__ == "QuantizedSwitchLinear" and switch.mode == "mxfp4"
    ids = token_ids(config)
    with torch.no_grad():
        ours = loaded(torch.from_numpy(ids)).logits.numpy()
        exact = model(torch.from_numpy(ids)).logits
    diff = float(abs(ours - mlx_k3.logits(reference, ids)).max())
    assert torch.equal(torch.from_numpy(ours), _fake_quantized(model)(torch.from_numpy(ids)).logits.detach())
    print(
        f"\nMXFP4 kimi_k3: |our from_hf - mlx-lm| max {diff:.3g}; vs unquantised {logit_error(exact, torch.from_numpy(ours))}"
    )
    assert diff <= TOLERANCE and abs(ours).max() > 1.0


@pytest.mark.parametrize(
    "old, new",
    [
        ("language_model.model.layers.", "language_model.layers."),
        ("language_model.model.", "language_model."),
    ],
)
def test_mxfp4_kimi_k3_with_the_short_names_loads(tmp_path: Path, old: str, new: str):
    """The short ``language_model.layers.{i}`` names (and ``language_model.embed_tokens`` ...) with MXFP4
    experts on disk only as ``weight_packed`` / ``weight_scale``: the layout is chosen by the packed names."""
    model = randomize(build_model(load_preset("k3-nano")), std=0.1)
    out = to_hf(model, tmp_path / "k3", quantize="mxfp4")
    tensors = load_file(out / SINGLE_FILE)
    renamed = {key.replace(old, new): value for key, value in tensors.items()}
    assert any(key.startswith("language_model.layers.") and "weight_packed" in key for key in renamed)
    save_file(renamed, str(out / SINGLE_FILE), metadata={"format": "pt"})
    loaded = from_hf(out).eval()
    for key, value in _fake_quantized(model).state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


@pytest.mark.parametrize("group", [{"weights": [4]}, "x", {"weights": None}])
def test_malformed_config_groups_are_a_one_line_error(exported: Path, tmp_path: Path, group: object):
    def edit(config: dict) -> None:
        config["quantization_config"]["config_groups"] = {"group_0": group}

    with pytest.raises(CheckpointError, match="not MXFP4: group_0.weights.num_bits = None \\(expected 4\\)"):
        from_hf(_copy(exported, tmp_path, edit_config=edit))
