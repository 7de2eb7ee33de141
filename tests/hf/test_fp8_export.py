"""Block-FP8 export (DeepSeek-V3 / Kimi-K2 release format): the codec's error bound, which tensors are
quantised, the round trip through ``from_hf`` (exactly the dequantised weights, also as compressed-tensors'
FP8 block dequantiser reads them) and the refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from k2lab import build_model, load_preset
from k2lab.cli import main
from k2lab.config import ConfigError
from k2lab.data.tokenizer import Tokenizer
from k2lab.hf import dequantize_fp8, from_hf, to_hf
from k2lab.hf.fp8 import FP8_MAX, quantize_fp8
from k2lab.hf.fp8_export import fp8_quantization_config
from k2lab.hf.io import SINGLE_FILE
from k2lab.model_dir import save_model
from k2lab.models import CausalLM
from tests.conftest import KIMI_LINEAR_STYLE, randomize
from tests.hf.conftest import VOCAB, nano_for
from tests.hf.test_mxfp4 import logit_error


@pytest.mark.parametrize("shape", [(300, 200), (128, 128), (5, 130), (64, 32)])
def test_quantize_fp8_within_e4m3_rounding(shape: tuple[int, int]):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=generator) * 0.02
    weight[:50, :10] *= 300  # blocks of very different ranges
    if shape[0] > 128:
        weight[128:256, :128] = 0  # an all-zero block
    quantized, scale_inv = quantize_fp8(weight)
    assert quantized.dtype == torch.float8_e4m3fn and scale_inv.dtype == torch.float32
    assert scale_inv.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    # scale_inv = block absmax / 448, computed here block by block
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            block = weight[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            amax = block.abs().max()
            assert scale_inv[i, j] == (amax / FP8_MAX if amax > 0 else 1.0)
    restored = dequantize_fp8(quantized, scale_inv)
    per_element = scale_inv.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
    # e4m3: 3 mantissa bits -> relative error <= 2^-4; subnormals (below 2^-6) are 2^-9 apart -> <= 2^-10
    bound = torch.maximum(weight.abs() * 2**-4, per_element * 2**-10)
    assert ((restored - weight).abs() <= bound).all()


def test_values_already_representable_come_back_exactly():
    generator = torch.Generator().manual_seed(1)
    codes = (torch.randn(200, 150, generator=generator) * 100).clamp(-FP8_MAX, FP8_MAX)
    codes = codes.to(torch.float8_e4m3fn)
    codes[0, 0] = codes[0, 128] = codes[128, 0] = codes[128, 128] = FP8_MAX  # every block reaches 448
    scale_inv = torch.tensor([[2.0**-7, 3.0], [0.125, 2.0**-20]])
    weight = dequantize_fp8(codes, scale_inv)
    quantized, again = quantize_fp8(weight)
    assert torch.equal(again, scale_inv) and torch.equal(dequantize_fp8(quantized, again), weight)


# ---- to_hf(quantize="fp8") -> from_hf --------------------------------------------------------------------


def _k2(**overrides: object) -> CausalLM:
    return randomize(build_model(load_preset("k2-nano", **overrides)), std=0.1)


def _release_quantized_names(model: CausalLM) -> set[str]:
    """The tensors DeepSeek-V3 / Kimi-K2 store in FP8, listed by hand for a k2-nano layout."""
    config = model.config
    names = set()
    for layer in range(config.num_hidden_layers + config.num_nextn_predict_layers):
        prefix = f"model.layers.{layer}."
        attention = ["q_a_proj", "q_b_proj"] if config.q_lora_rank else ["q_proj"]
        names |= {
            f"{prefix}self_attn.{p}.weight" for p in [*attention, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
        }
        projections = ("gate_proj", "up_proj", "down_proj")
        if layer < config.first_k_dense_replace:
            names |= {f"{prefix}mlp.{p}.weight" for p in projections}
        else:
            names |= {f"{prefix}mlp.shared_experts.{p}.weight" for p in projections}
            names |= {
                f"{prefix}mlp.experts.{e}.{p}.weight"
                for e in range(config.n_routed_experts)
                for p in projections
            }
    return names


@pytest.mark.parametrize(
    "overrides", [{}, {"q_lora_rank": None, "num_nextn_predict_layers": 1}], ids=["k2-nano", "mtp"]
)
def test_fp8_export_is_the_release_format_and_loads_back_exactly(overrides: dict, tmp_path: Path):
    model = _k2(**overrides)
    out = to_hf(model, tmp_path / "fp8", quantize="fp8", dtype=torch.bfloat16)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }
    with safe_open(str(out / SINGLE_FILE), framework="pt") as handle:
        dtypes = {key: handle.get_slice(key).get_dtype() for key in handle.keys()}  # noqa: SIM118
    scaled = {key.removesuffix("_scale_inv") for key in dtypes if key.endswith("_scale_inv")}
    assert scaled == _release_quantized_names(model)
    for key, dtype in dtypes.items():
        expected = (
            "F8_E4M3"
            if key in scaled
            else "F32"
            if key.endswith(("_scale_inv", "correction_bias"))
            else "BF16"
        )
        assert dtype == expected, key

    disk = load_file(out / SINGLE_FILE)
    loaded = from_hf(out, mtp=True).eval()
    reference = _dequantized_reference(model, disk)
    for key, value in reference.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def _dequantized_reference(model: CausalLM, disk: dict[str, torch.Tensor]) -> CausalLM:
    """Our model with every tensor taken from ``disk`` (FP8 ones dequantised), put in by the key plan."""
    from k2lab.hf.mapping import hf_tensors

    reference = build_model(model.config)
    state = reference.state_dict()
    with torch.no_grad():
        for name, view in hf_tensors(model.config, state):
            value = disk[name]
            if name + "_scale_inv" in disk:
                value = dequantize_fp8(value, disk[name + "_scale_inv"])
            view.copy_(value.float().reshape(view.shape))
    return reference.eval()


def test_compressed_tensors_fp8_block_dequantizer_reads_our_export(tmp_path: Path):
    from compressed_tensors.entrypoints.convert.converters import FP8BlockDequantizer

    model = _k2()
    out = to_hf(model, tmp_path / "fp8", quantize="fp8")
    dequantizer = FP8BlockDequantizer.from_pretrained(out, dtype=torch.float32)
    theirs = dequantizer.validate(load_file(out / SINGLE_FILE))
    reference = _dequantized_reference(model, theirs)  # their dequantised weights, our names
    loaded = from_hf(out)
    for key, value in reference.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key

    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        figures = logit_error(model(ids).logits, loaded(ids).logits)
    print(f"\nFP8 block 128x128 k2-nano vs the unquantised model: {figures}")
    # weights within 2^-4 (~2.7 % rms), but layer 0's changes flip some of layer 1's expert choices in this
    # random model (each layer-0 tensor alone moves the logits by up to 25 %), so the figure is loose
    assert 0 < figures["rms_rel"] < 0.35 and figures["top1_agree"] >= 0.75


def test_fp8_refuses_checkpoints_without_a_release_format(tmp_path: Path):
    kimi_linear = randomize(build_model(load_preset("k3-nano", **KIMI_LINEAR_STYLE)))
    with pytest.raises(ConfigError, match="this model is written as 'kimi_linear', which has no FP8 release"):
        to_hf(kimi_linear, tmp_path / "kl", quantize="fp8")
    assert not (tmp_path / "kl").exists()
    assert fp8_quantization_config()["weight_block_size"] == [128, 128]


# ---- k2lab export --quantize -----------------------------------------------------------------------------


def test_the_export_command_quantizes(
    tmp_path: Path, model_dir: Path, tokenizer: Tokenizer, capsys: pytest.CaptureFixture[str]
):
    for method, config_key in (("fp8", "fmt"), ("mxfp4", "format")):
        out = tmp_path / method
        with pytest.raises(SystemExit) as done:
            main(["export", str(model_dir), "--out", str(out), "--quantize", method, "--dtype", "bf16"])
        assert done.value.code == 0, capsys.readouterr().err
        assert config_key in json.loads((out / "config.json").read_text())["quantization_config"]
        assert (out / "tokenizer.json").is_file() and from_hf(out).config.vocab_size == VOCAB
    kimi_linear = save_model(nano_for(tokenizer, "k3-nano", **KIMI_LINEAR_STYLE), tmp_path / "kimi-linear")
    dense = save_model(nano_for(tokenizer, first_k_dense_replace=2), tmp_path / "dense")
    cases = [
        (kimi_linear, "fp8", "written as 'kimi_linear', which has no FP8 release format"),
        (dense, "mxfp4", "quantises the routed experts, and this deepseek_v3 model has none"),
        (model_dir, "int8", "quantize: Input should be 'mxfp4' or 'fp8'"),
    ]
    for source, method, message in cases:
        with pytest.raises(SystemExit) as done:
            main(
                [
                    "export",
                    str(source),
                    "--out",
                    str(tmp_path / "refused"),
                    "--quantize",
                    method,
                    "--tokenizer",
                    str(model_dir / "tokenizer.json"),
                ]
            )
        assert done.value.code == 2
        assert message in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "refused").exists()
