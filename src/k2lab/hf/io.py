"""Read and write DeepseekV3 / Kimi-K2 and Kimi Linear Hugging Face checkpoint directories.

A directory holds ``config.json`` and safetensors weights: one ``model.safetensors``, or shards listed by
``model.safetensors.index.json`` (``weight_map``: key -> file). On disk routed experts are one tensor per
expert and projection (``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``); we stack them into
our ``[E, out, in]`` parameters. transformers-5 fused keys (``mlp.experts.gate_up_proj`` [E, 2F, D], gate
rows then up rows, and ``mlp.experts.down_proj`` [E, D, F]) are read too. Which tensors a format has, and the
alternative layouts accepted for each, come from ``k2lab.hf.mapping.weight_groups`` (Kimi Linear:
``k2lab.hf.kimi_linear``).

FP8 (the public DeepSeek-V3 / Kimi-K2 release format): a quantised weight is ``float8_e4m3fn`` with a sibling
``<name>_scale_inv`` (fp32, ``[ceil(out/128), ceil(in/128)]``), and the dequantised weight is
``w[i, j] = w_fp8[i, j] · scale_inv[i // 128, j // 128]`` (block size from
``quantization_config.weight_block_size``; ``k2lab.hf.fp8``). Weights are dequantised as they are loaded, and so
are compressed-tensors MXFP4 pairs (``weight_packed`` + ``weight_scale``, Kimi K3's routed experts) when the
config declares them (``k2lab.hf.mxfp4_load``). ``to_hf(quantize=...)`` writes either (``k2lab.hf.quantize``).

Loading checks every tensor header against the model's expected names and shapes before reading any data,
and raises ``CheckpointError`` listing missing, unexpected and mis-shaped tensors. MTP layers
(``model.layers.{num_hidden_layers + j}.*``, ``k2lab.hf.mtp``) load into the model's MTP modules when the
checkpoint holds them (skipped with ``mtp=False``, and always for Kimi K2.5); ``rotary_emb.inv_freq`` is skipped.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from safetensors import SafetensorError, safe_open

from k2lab.config import ModelConfig, format_validation_error
from k2lab.errors import CheckpointError, K2LabError
from k2lab.fsutil import read_json_object, recover_directory, staged_directory
from k2lab.hf import kimi_k25
from k2lab.hf.formats import MODEL_TYPES, read_format, write_format
from k2lab.hf.fp8 import DEFAULT_FP8_BLOCK, SCALE_SUFFIX, dequantize_fp8
from k2lab.hf.layout import HFTensor, WeightGroup, gather, row_dim, slot_view
from k2lab.hf.mtp import is_skipped, mtp_layer_index, present_mtp_layers
from k2lab.hf.mxfp4 import declared_mxfp4
from k2lab.hf.mxfp4_load import PackedPair, match_packed, with_packed_weights
from k2lab.hf.quantize import Quantize, quantize_checkpoint
from k2lab.hf.vlm_formats import read_vlm_format, write_vlm_format
from k2lab.models import CausalLM, build_model
from k2lab.models.init import cast_model, materialize
from k2lab.vision.vlm import VisionLanguageModel, build_vlm

__all__ = [
    "HF_MODEL_TYPES",
    "CheckpointError",
    "carry_over_other_files",
    "dequantize_fp8",
    "from_hf",
    "read_hf_config",
    "to_hf",
]

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# A kimi_k25 export's processor files (k2lab.hf.processor_files): rewritten with the checkpoint, never carried
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

#: The ``model_type`` values ``from_hf`` reads and ``to_hf`` writes (decoders and Kimi K2.5).
HF_MODEL_TYPES = (*MODEL_TYPES, kimi_k25.MODEL_TYPE)

_LIST_LIMIT = 10
_FP8_DTYPES = {"F8_E4M3"}
# safetensors dtypes a floating-point parameter (or an FP8 block scale) is read from, besides FP8 with scales.
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
# Written in fp32 whatever ``to_hf``'s dtype: the router bias and KDA's decay parameters.
_FP32_SUFFIXES = ("e_score_correction_bias", "A_log", "dt_bias", SCALE_SUFFIX)
# Floating-point dtypes kept whatever ``to_hf``'s dtype: quantised (FP8) weights.
_QUANTIZED_DTYPES = (torch.float8_e4m3fn,)

# safetensors dtype names (https://github.com/huggingface/safetensors, format section).
_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


# ---------------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------------


def read_hf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``config.json`` of checkpoint directory ``path`` as a dict; ``CheckpointError`` if unusable.

    Checks that the directory and file exist, that the file is a JSON object and that ``model_type`` is a
    supported one (``deepseek_v3``, ``kimi_k2``, ``kimi_linear``, ``kimi_k3`` or ``kimi_k25``).
    """
    root = Path(path)
    recover_directory(root)  # put back the copy a write killed mid-swap left hidden beside it
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    config_path = root / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(f"{root} has no {CONFIG_FILE}; not a Hugging Face checkpoint directory")
    data = read_json_object(config_path)
    model_type = data.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise CheckpointError(
            f"{config_path}: model_type {model_type!r} is not supported (expected one of {list(HF_MODEL_TYPES)})"
        )
    return data


def from_hf(
    path: str | os.PathLike[str],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    mtp: bool = True,
) -> CausalLM | VisionLanguageModel:
    """Load a DeepseekV3 / Kimi-K2, Kimi Linear or Kimi K3 (text-only ``kimi_k3``, ``k2lab.hf.kimi_k3``)
    checkpoint directory as a ``CausalLM``, or a Kimi K2.5 (``kimi_k25``) one as a ``VisionLanguageModel`` (any
    of the namings in ``k2lab.hf.kimi_k25``). The decoder formats are listed in ``k2lab.hf.formats``.

    Args:
        path: directory with ``config.json`` and ``model.safetensors`` or sharded safetensors plus
            ``model.safetensors.index.json``. Legacy ``rope_theta`` + ``rope_scaling`` and transformers-5
            ``rope_parameters`` configs are both accepted; ``model_type`` must be ``deepseek_v3``,
            ``kimi_k2`` or ``kimi_linear`` (original Moonshot or transformers layout, ``k2lab.hf.kimi_linear``).
        dtype: parameter dtype. The router (``mlp.gate.weight`` and ``e_score_correction_bias``) stays fp32,
            as in transformers (``_keep_in_fp32_modules_strict``) and as ``SigmoidRouter`` builds it.
        device: where the parameters are allocated.
        mtp: load the multi-token-prediction layers the checkpoint holds (of the ``num_nextn_predict_layers``
            its config declares; a checkpoint saved by transformers declares them but holds none); False
            skips them and builds the decoder alone. Kimi K2.5 checkpoints always load without.

    The model is built on the meta device, allocated once on ``device`` and filled tensor by tensor, one
    safetensors file at a time, so peak memory is about the model plus one tensor. FP8 block-quantised
    weights (``weight_scale_inv`` siblings) are dequantised on the way in.

    Raises:
        CheckpointError: missing directory / config / weights, malformed JSON, unsupported ``model_type``
            or quantisation, an invalid config, or tensors that are missing, unexpected or mis-shaped
            (the message lists them), or weights holding NaN or infinite values.
    """
    root = Path(path)
    raw = read_hf_config(root)
    block = _fp8_block_size(raw, root)
    files = _weight_files(root)
    headers = _read_headers(files)

    if (vlm_format := read_vlm_format(raw)) is not None:  # k2lab.hf.vlm_formats
        vlm_config = _parse_config(vlm_format.config_from_hf, raw, root)
        model = build_vlm(vlm_config, device="meta")
        cast_model(model, dtype)
        groups = vlm_format.weight_groups(vlm_config, model_state(model))
        ignored = decoder_ignored(
            vlm_config.text, headers, vlm_format.text_config(raw), vlm_format.decoder_name
        )
        tied, decoder_name, embed_key = (
            vlm_config.text.tie_word_embeddings,
            vlm_format.decoder_name,
            "language_model.embed.weight",
        )
    else:
        fmt = read_format(raw["model_type"])
        config = _parse_config(fmt.config_from_hf, raw, root)
        names = [fmt.decoder_name(key) for key in headers]
        held = present_mtp_layers(names, config.num_hidden_layers, config.num_nextn_predict_layers)
        config = config.replace(num_nextn_predict_layers=held if mtp else 0)
        model = build_model(config, device="meta")
        cast_model(model, dtype)
        groups = fmt.weight_groups(config, model_state(model))
        ignored = decoder_ignored(config, headers, fmt.text_config(raw), fmt.decoder_name)
        tied, decoder_name, embed_key = config.tie_word_embeddings, fmt.decoder_name, "embed.weight"
    plan = _LoadPlan.build(groups, headers, ignored, block, root, mxfp4=declared_mxfp4(raw, root))
    _check_index_keys(root, headers)  # after the plan, which names missing tensors in its own terms
    if tied:
        _check_tied_head(plan, headers, decoder_name, embed_key)
    materialize(model, device)
    load_tensors(model, plan, files)
    check_finite(model.state_dict(), str(root))
    return model


@dataclass(frozen=True)
class _DiskTensor:
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name, e.g. "BF16", "F8_E4M3"


@dataclass
class _LoadPlan:
    targets: dict[str, HFTensor] = field(default_factory=dict)  # disk key -> what it holds
    scales: dict[str, str] = field(default_factory=dict)  # disk weight key -> its scale_inv key
    block: tuple[int, int] = DEFAULT_FP8_BLOCK
    packed: dict[str, PackedPair] = field(default_factory=dict)  # disk weight_packed key -> its MXFP4 scale

    @classmethod
    def build(
        cls,
        groups: Iterable[WeightGroup],
        headers: Mapping[str, _DiskTensor],
        ignored: Callable[[str], bool],
        block: tuple[int, int],
        root: Path,
        mxfp4: bool = False,
    ) -> _LoadPlan:
        """Match disk keys to the model's weight groups; raise ``CheckpointError`` listing every mismatch.

        ``ignored(key)`` says which disk keys are not part of the model (MTP layers, a tied head ...);
        with ``mxfp4`` a weight may be on disk as an MXFP4 pair (``k2lab.hf.mxfp4_load``).
        """
        expected: dict[str, HFTensor] = {}
        present = with_packed_weights(headers) if mxfp4 else headers
        # Per group of our tensors, the layout found on disk (e.g. per-expert or transformers-5 fused experts).
        for group in groups:
            for tensor in group.choose(present):
                expected[tensor.name] = tensor

        packed = match_packed(
            {key: tensor.shape for key, tensor in expected.items()}, headers if mxfp4 else {}
        )
        accounted = packed.disk_keys
        missing = sorted(set(expected) - set(headers) - set(packed.weights)) + packed.missing
        unexpected: list[str] = []
        misshaped: list[str] = list(packed.misshaped)
        mistyped: list[str] = []
        scales: dict[str, str] = {}
        for key, disk in headers.items():
            if key in accounted:
                continue
            if key.endswith(SCALE_SUFFIX) and key.removesuffix(SCALE_SUFFIX) in expected:
                weight_key = key.removesuffix(SCALE_SUFFIX)
                scales[weight_key] = key
                if disk.dtype not in _FLOAT_DTYPES:
                    mistyped.append(f"{key} {disk.dtype} (block scales must be F32, BF16 or F16)")
                if len(expected[weight_key].shape) < 2:
                    misshaped.append(f"{key} {disk.shape} (the 1-D tensor {weight_key} has no block scales)")
                elif disk.shape != (want := _scale_shape(expected[weight_key].shape, block)):
                    misshaped.append(f"{key} {disk.shape} (expected {want} for block size {list(block)})")
            elif key in expected:
                if not expected[key].accepts(disk.shape):
                    misshaped.append(f"{key} {disk.shape} (expected {expected[key].shape})")
                if disk.dtype not in _FLOAT_DTYPES | _FP8_DTYPES:
                    mistyped.append(
                        f"{key} {disk.dtype} (expected F32, BF16, F16, or F8_E4M3 with block scales)"
                    )
            elif not ignored(key):
                unexpected.append(key)
        for key in sorted(set(expected) & set(headers)):
            if headers[key].dtype in _FP8_DTYPES and key not in scales:
                missing.append(f"{key}{SCALE_SUFFIX} (the FP8 weight {key} needs its block scales)")

        problems = [
            _describe(label, items)
            for label, items in (
                ("missing", missing),
                ("unexpected", sorted(unexpected)),
                ("mis-shaped", misshaped),
                ("wrongly typed", mistyped),
            )
            if items
        ]
        if problems:
            raise CheckpointError(f"{root} does not match its {CONFIG_FILE}: " + "; ".join(problems))
        targets = expected | {disk_key: expected[key] for key, disk_key in packed.weights.items()}
        return cls(targets=targets, scales=scales, block=block, packed=packed.pairs)

    def renamed(self, disk_names: Mapping[str, str]) -> _LoadPlan:
        """The plan keyed by the names actually on disk (``disk_names``: planned name -> disk name)."""
        return _LoadPlan(
            targets={disk_names.get(k, k): v for k, v in self.targets.items()},
            scales={disk_names.get(k, k): disk_names.get(v, v) for k, v in self.scales.items()},
            block=self.block,
            packed=self.packed,
        )


def decoder_ignored(
    config: ModelConfig,
    headers: Mapping[str, _DiskTensor],
    raw_config: Mapping[str, Any],
    decoder_name: Callable[[str], str] = lambda key: key,
) -> Callable[[str], bool]:
    """Disk keys of a decoder checkpoint that are not our parameters: MTP layers the model does not hold
    (``config.num_nextn_predict_layers`` of them it does) and the MTP layers' copies of the shared embedding
    and head, ``rotary_emb.inv_freq``, a stored copy of a tied head, transformers' empty shared expert.
    ``decoder_name`` maps a disk key to the decoder's own name (``model.layers.…``, ``lm_head.weight``)
    when it is nested in a larger model."""
    mtp_layers = (raw_config.get(key) or 0 for key in ("num_nextn_predict_layers", "num_mtp_layers"))
    declared = max((int(n) for n in mtp_layers), default=0)  # none declared: layer L's tensors are unexpected
    held = config.num_nextn_predict_layers

    def ignored(key: str) -> bool:
        name = decoder_name(key)
        index = mtp_layer_index(name, config.num_hidden_layers)
        if index is not None and (held <= index < declared or (index < held and is_skipped(name))):
            return True  # MTP layers not loaded; the shared embedding / head copies, AttnRes leftovers
        if ".shared_experts." in key and config.n_shared_experts == 0 and not math.prod(headers[key].shape):
            return True  # transformers saves the empty shared expert of an MoE without shared experts
        return name.endswith("rotary_emb.inv_freq") or (
            config.tie_word_embeddings and name == "lm_head.weight"
        )

    return ignored


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict to read or write: without the head when it is tied to the embedding."""
    state = model.state_dict()
    lm = model.language_model if isinstance(model, VisionLanguageModel) else model
    prefix = "language_model." if isinstance(model, VisionLanguageModel) else ""
    if lm.config.tie_word_embeddings:
        state.pop(prefix + "lm_head.weight", None)
    return state


def _check_tied_head(
    plan: _LoadPlan, headers: Mapping[str, _DiskTensor], decoder_name: Callable[[str], str], embed_key: str
) -> None:
    """With a head tied to the embedding (our state key ``embed_key``) a stored ``lm_head.weight`` is not read,
    so it must equal the embedding on disk: otherwise the checkpoint describes two models (transformers would
    load the stored head). ``CheckpointError`` naming the file when it differs."""
    heads = [key for key in headers if decoder_name(key) == "lm_head.weight"]
    embeds = [key for key, target in plan.targets.items() if any(s.key == embed_key for s in target.slots)]
    if not heads or not embeds or embeds[0] not in headers:
        return
    embedding = _read_tensor(headers[embeds[0]].file, embeds[0])
    for key in heads:
        head = _read_tensor(headers[key].file, key)
        same = head.shape == embedding.shape and head.is_floating_point() and embedding.is_floating_point()
        if not (same and torch.equal(head.float(), embedding.float())):
            raise CheckpointError(
                f"{headers[key].file}: {key} differs from the embedding {embeds[0]}, but {CONFIG_FILE} "
                "says tie_word_embeddings (the head is the embedding)"
            )


def _read_tensor(file: Path, key: str) -> torch.Tensor:
    """Tensor ``key`` of safetensors ``file``."""
    with _open(file) as handle:
        return handle.get_tensor(key)


def listing(items: Sequence[str]) -> str:
    """The first ten ``items``, then how many more."""
    shown = ", ".join(items[:_LIST_LIMIT])
    return shown + (f", ... and {len(items) - _LIST_LIMIT} more" if len(items) > _LIST_LIMIT else "")


def _describe(label: str, items: Sequence[str]) -> str:
    return f"{len(items)} {label} tensor{'s' if len(items) != 1 else ''}: {listing(items)}"


def check_finite(state: dict[str, torch.Tensor], source: str) -> None:
    """``CheckpointError`` naming the floating-point tensors of ``state`` that hold NaN or infinite values
    (a diverged or damaged model, which would only generate garbage)."""
    nonfinite = [
        key for key in sorted(state) if state[key].is_floating_point() and not state[key].isfinite().all()
    ]
    if nonfinite:
        raise CheckpointError(
            f"{source} holds NaN or infinite values in {len(nonfinite)} tensors ({listing(nonfinite)}): a "
            "diverged or damaged model; load an earlier checkpoint"
        )


def check_cast_range(items: Iterable[tuple[str, torch.Tensor, torch.dtype]]) -> None:
    """Refuse (one-line ``K2LabError``) to write (name, tensor, disk dtype) ``items`` when a cast would turn a
    finite value into inf: fp16's largest is 65504, and an export with ``--dtype fp16`` wrote the overflowing
    weights as inf, which k2lab then refused to load as "a diverged or damaged model". Names the tensors and
    their largest magnitude. Used by ``to_hf`` and the GGUF export before anything is written."""
    over: list[str] = []
    narrowest: torch.dtype | None = None
    for name, tensor, dtype in items:
        if not (tensor.is_floating_point() and dtype.is_floating_point) or tensor.dtype == dtype:
            continue
        peak = tensor.detach().abs().amax() if tensor.numel() else None
        if peak is not None and peak.isfinite() and peak.to(dtype).isinf():  # the cast rounds as on the way
            over.append(f"{name} (max |value| {float(peak):.6g})")
            narrowest = dtype
    if narrowest is not None:
        largest = torch.finfo(narrowest).max
        raise K2LabError(
            f"{str(narrowest).removeprefix('torch.')} cannot hold the weights (largest finite value "
            f"{largest:.6g}), they would be written as inf: {listing(over)}; choose another dtype (bf16, fp32)"
        )


def _scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    *lead, rows, cols = shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def load_tensors(model: torch.nn.Module, plan: _LoadPlan, files: Sequence[Path]) -> None:
    """Copy every planned tensor into the (materialised) model, one file at a time."""
    state = model.state_dict()
    scale_keys = set(plan.scales.values())
    scale_values: dict[str, torch.Tensor] = {}
    if scale_keys:  # block scales are ~1/16384 of their weights: read them all first (any shard)
        for file in files:
            with _open(file) as handle:
                for key in scale_keys.intersection(handle.keys()):
                    scale_values[key] = handle.get_tensor(key)
    with torch.no_grad():
        for file in files:
            with _open(file) as handle:
                for key in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                    target = plan.targets.get(key)
                    if target is None:
                        continue
                    tensor = handle.get_tensor(key)
                    if key in plan.scales:
                        tensor = dequantize_fp8(tensor, scale_values[plan.scales[key]], plan.block)
                    elif key in plan.packed:
                        tensor = plan.packed[key].dequantize(tensor, handle, file)
                    tensor = target.to_ours(tensor)
                    for slot in target.slots:
                        destination = slot_view(state, slot)
                        source = tensor
                        if slot.disk_rows is not None:
                            source = tensor.narrow(
                                row_dim(tensor), slot.disk_rows[0], slot.disk_rows[1] - slot.disk_rows[0]
                            )
                        destination.copy_(source.reshape(destination.shape))


def _parse_config(parse: Callable[..., Any], raw: Mapping[str, Any], root: Path) -> Any:
    """``parse(raw, name=...)`` with its errors turned into ``CheckpointError`` naming the file."""
    try:
        return parse(raw, name=root.resolve().name or "hf")
    except ValidationError as error:
        raise CheckpointError(
            f"{root / CONFIG_FILE}: invalid config: {format_validation_error(error)}"
        ) from error
    except (ValueError, TypeError) as error:
        raise CheckpointError(f"{root / CONFIG_FILE}: {error}") from error


def _fp8_block_size(raw: Mapping[str, Any], root: Path) -> tuple[int, int]:
    """The FP8 block size from ``quantization_config`` (128x128 when absent); reject other quantisations."""
    quant = raw.get("quantization_config")
    if not quant or declared_mxfp4(raw, root):  # MXFP4: k2lab.hf.mxfp4_load
        return DEFAULT_FP8_BLOCK
    where = f"{root / CONFIG_FILE}: quantization_config"
    if not isinstance(quant, dict):
        raise CheckpointError(f"{where} should be a JSON object")
    method = quant.get("quant_method")
    if method != "fp8":
        raise CheckpointError(f"{where}: quant_method {method!r} is not supported (only block-wise fp8)")
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise CheckpointError(f"{where}: fmt {fmt!r} is not supported (only e4m3)")
    block = quant.get("weight_block_size", list(DEFAULT_FP8_BLOCK))
    if (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise CheckpointError(f"{where}: weight_block_size {block!r} should be two positive integers")
    return int(block[0]), int(block[1])


def _weight_files(root: Path) -> list[Path]:
    """The safetensors files of ``root``: the index's shards, else ``model.safetensors``, else any."""
    index_path = root / INDEX_FILE
    if index_path.is_file():
        names = list(dict.fromkeys(_weight_map(index_path).values()))
        absent = [name for name in names if not (root / name).is_file()]
        if absent:
            raise CheckpointError(f"{index_path} lists shard files that do not exist: " + ", ".join(absent))
        return [root / name for name in names]
    if (root / SINGLE_FILE).is_file():
        return [root / SINGLE_FILE]
    found = sorted(root.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"{root} has no safetensors weights ({SINGLE_FILE} or {INDEX_FILE})")
    return found


def _weight_map(index_path: Path) -> dict[str, str]:
    """The ``weight_map`` (tensor -> shard file) of ``index_path``; ``CheckpointError`` when it is not a
    non-empty object of relative file names inside the checkpoint directory."""
    weight_map = read_json_object(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path} has no weight_map")
    for key, name in weight_map.items():
        if not isinstance(name, str) or not name:
            raise CheckpointError(f"{index_path}: weight_map[{key!r}] is {name!r}, not a shard file name")
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise CheckpointError(
                f"{index_path}: weight_map[{key!r}] = {name!r} is outside the checkpoint directory"
            )
    return weight_map


def _check_index_keys(root: Path, headers: Mapping[str, _DiskTensor]) -> None:
    """Every tensor ``model.safetensors.index.json`` lists is in the shard it names (``CheckpointError``)."""
    index_path = root / INDEX_FILE
    if not index_path.is_file():
        return
    absent = [
        f"{key} (not in {name})"
        for key, name in _weight_map(index_path).items()
        if key not in headers or headers[key].file != root / name
    ]
    if absent:
        raise CheckpointError(
            f"{index_path} lists tensors its shards do not hold: " + _describe("absent", absent)
        )


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{file} cannot be read as safetensors ({error})") from error


def _read_headers(files: Iterable[Path]) -> dict[str, _DiskTensor]:
    """Name, shape and dtype of every tensor in ``files`` (headers only, no tensor data)."""
    headers: dict[str, _DiskTensor] = {}
    for file in files:
        with _open(file) as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                if key in headers:
                    raise CheckpointError(f"tensor {key} is stored twice: in {headers[key].file} and {file}")
                piece = handle.get_slice(key)
                headers[key] = _DiskTensor(file, tuple(piece.get_shape()), piece.get_dtype())
    return headers


# ---------------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------------


def to_hf(
    model: CausalLM | VisionLanguageModel,
    path: str | os.PathLike[str],
    max_shard_bytes: int | None = None,
    dtype: torch.dtype | None = None,
    quantize: Quantize | None = None,
) -> Path:
    """Write ``model`` as a Hugging Face checkpoint directory; returns its path.

    The format is DeepseekV3, Kimi Linear for a model with KDA layers or NoPE MLA, or Kimi K3 (``kimi_k3``,
    vLLM's and mlx-lm's layout) for a model with K3-only features (``k2lab.hf.formats.write_format``).
    Writes ``config.json``, safetensors with one tensor per expert and projection, and
    ``generation_config.json`` when the config has token ids. The result loads with ``from_hf`` and, but
    for kimi_k3, with ``transformers.AutoModelForCausalLM.from_pretrained(path)`` (no remote code).

    Args:
        model: the model to export.
        path: target directory. It is written atomically: everything goes to a temporary sibling directory
            that then replaces ``path``; files already in ``path`` that are not checkpoint files (tokenizer,
            README ...) are carried over.
        max_shard_bytes: when given, tensors are packed in order into ``model-0000i-of-0000n.safetensors``
            shards of at most this size (a larger single tensor gets a shard of its own) with
            ``model.safetensors.index.json``; if everything fits in one shard a single ``model.safetensors``
            is written, as transformers does.
        dtype: cast floating-point weights to this dtype (default: keep each tensor's dtype). The router's
            ``e_score_correction_bias`` and KDA's ``A_log`` / ``dt_bias`` always stay fp32, as in the public
            checkpoints.
        quantize: ``"mxfp4"`` (routed experts as compressed-tensors MXFP4, as Kimi K3 is released) or
            ``"fp8"`` (block FP8, the DeepSeek-V3 / Kimi-K2 release format): ``k2lab.hf.quantize``. The
            quantised tensors and their scales keep their dtypes whatever ``dtype`` says.

    Tensors are streamed to disk one at a time (no second copy of the model in memory; with ``quantize``,
    the quantised tensors are made first, at most a quarter of the model's fp32 size).

    Raises:
        ConfigError: the model has settings the format cannot express (RoPE MLA or YaRN with K3's features,
            a tied head in Kimi Linear ...); nothing is written.
    """
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    layout = _Written.of(model)  # first: refuses what the format cannot express
    tensors = layout.tensors
    if quantize is not None:
        tensors = quantize_checkpoint(quantize, layout.hf_config, tensors)  # adds its quantization_config
    items = [(key, tensor, _disk_dtype(key, tensor, dtype)) for key, tensor in tensors]
    check_cast_range(items)
    torch_dtype = str(_disk_dtype("lm_head.weight", layout.head, dtype)).removeprefix("torch.")
    layout.hf_config["torch_dtype"] = torch_dtype
    if "torch_dtype" in layout.hf_config.get("text_config", {}):  # kimi_k25's decoder config: the same
        layout.hf_config["text_config"]["torch_dtype"] = torch_dtype

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() and not target.is_dir():
        raise CheckpointError(f"{target} exists and is not a directory")
    with staged_directory(target) as staging:
        (staging / CONFIG_FILE).write_text(json.dumps(layout.hf_config, indent=2) + "\n")
        _write_generation_config(staging, layout.config)
        _write_weights(staging, items, max_shard_bytes)
        carry_over_other_files(target, staging)
    return target


@dataclass
class _Written:
    """What ``to_hf`` writes for a model: its format's config.json dict, the decoder's ``ModelConfig``, the
    checkpoint tensors (name, values; MTP layers' shared copies included) and the head (its dtype names the
    checkpoint's ``torch_dtype``)."""

    hf_config: dict[str, Any]
    config: ModelConfig
    tensors: list[tuple[str, torch.Tensor]]
    head: torch.Tensor

    @classmethod
    def of(cls, model: CausalLM | VisionLanguageModel) -> _Written:
        """The layout of ``model`` (``ConfigError`` for settings its format cannot express)."""
        if isinstance(model, VisionLanguageModel):
            vlm_format = write_vlm_format(model.config)  # kimi_k3 for a MoonViT-V2 tower, else kimi_k25
            hf_config = vlm_format.config_to_hf(model.config)  # first: refuses what it cannot express
            config, state = model.config.text, model_state(model)
            groups = vlm_format.weight_groups(model.config, state)
            head = model.language_model.lm_head.weight
            copies: list[HFTensor] = []
        else:
            config, fmt = model.config, write_format(model.config)
            hf_config = fmt.config_to_hf(config)
            state = model_state(model)
            groups = fmt.weight_groups(config, state)
            head = model.lm_head.weight
            copies = fmt.shared_copies(config, state)  # MTP layers' embed_tokens / shared_head.head (hf.mtp)
        written = [tensor for group in groups for tensor in group.canonical()] + copies
        tensors = [(tensor.name, gather(state, tensor)) for tensor in written]
        return cls(hf_config=hf_config, config=config, tensors=tensors, head=head)


def _disk_dtype(key: str, tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``tensor`` is written in: ``dtype`` for a floating-point weight, its own for integers,
    quantised tensors and the fp32-kept ones (router bias, KDA's ``A_log`` / ``dt_bias``), or with no ``dtype``."""
    kept = not tensor.is_floating_point() or tensor.dtype in _QUANTIZED_DTYPES
    if dtype is None or kept or key.endswith(_FP32_SUFFIXES):
        return tensor.dtype
    return dtype


def _write_generation_config(staging: Path, config: ModelConfig) -> None:
    """``generation_config.json`` with the config's bos / eos / pad ids, when it has any."""
    generation = {
        key: getattr(config, key)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id")
        if getattr(config, key) is not None
    }
    if generation:
        (staging / GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2) + "\n")


def _write_weights(
    staging: Path, items: Sequence[tuple[str, torch.Tensor, torch.dtype]], max_shard_bytes: int | None
) -> None:
    """The (name, tensor, disk dtype) ``items`` as one ``model.safetensors``, or as shards of at most
    ``max_shard_bytes`` with ``model.safetensors.index.json``."""
    sizes = [tensor.numel() * disk_dtype.itemsize for _, tensor, disk_dtype in items]
    shards = _pack_shards(sizes, max_shard_bytes)
    names = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map: dict[str, str] = {}
    for name, members in zip(names, shards, strict=True):
        shard = [items[i] for i in members]
        _write_safetensors(staging / name, shard, metadata={"format": "pt"})
        weight_map.update({key: name for key, _, _ in shard})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
        (staging / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _pack_shards(sizes: Sequence[int], max_shard_bytes: int | None) -> list[list[int]]:
    """Greedy in-order packing of tensor indices into shards of at most ``max_shard_bytes``."""
    if max_shard_bytes is None:
        return [list(range(len(sizes)))]
    shards: list[list[int]] = [[]]
    used = 0
    for index, size in enumerate(sizes):
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(index)
        used += size
    return shards


def _write_safetensors(
    path: Path, items: Sequence[tuple[str, torch.Tensor, torch.dtype]], metadata: Mapping[str, str]
) -> None:
    """Stream (name, tensor, dtype) triples into one safetensors file, casting one tensor at a time.

    ``safetensors.torch.save_file`` would need every tensor materialised and contiguous at once (per-expert
    tensors are views of our fused weights, which it rejects as shared memory), so the format is written
    directly: u64 little-endian header size, JSON header padded to 8 bytes, then the raw bytes in order.
    """
    if sys.byteorder != "little":  # pragma: no cover - safetensors data is little-endian
        raise RuntimeError("writing safetensors needs a little-endian machine")
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, tensor, dtype in items:
        if dtype not in _ST_DTYPES:
            raise TypeError(f"cannot store {name} with dtype {dtype} in safetensors")
        size = tensor.numel() * dtype.itemsize
        header[name] = {
            "dtype": _ST_DTYPES[dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(blob)))
        handle.write(blob)
        for _, tensor, dtype in items:
            data = tensor.detach().to(device="cpu", dtype=dtype).contiguous().reshape(-1)
            if data.numel():
                handle.write(memoryview(data.view(torch.uint8).numpy()))


_CHECKPOINT_FILE = re.compile(r"^(model.*\.safetensors|model\.safetensors\.index\.json)$")


def carry_over_other_files(target: Path, staging: Path) -> None:
    """Copy the files of an existing ``target`` that the new version does not hold (tokenizer, README, eval
    results ...) into ``staging``, which is about to replace it: everything but what ``staging`` already has
    and the old checkpoint files (``config.json``, ``generation_config.json``, weights and index, which are
    rewritten or dropped with the checkpoint, as are a vision-language export's processor files: a text model
    written over one must not keep them). Used by ``to_hf`` and ``k2lab export``."""
    if not target.is_dir():
        return
    for entry in target.iterdir():
        name = entry.name
        if os.path.lexists(staging / name) or name in (CONFIG_FILE, GENERATION_CONFIG_FILE, *PROCESSOR_FILES):
            continue
        if _CHECKPOINT_FILE.match(name):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, staging / entry.name, symlinks=True)
        else:
            shutil.copy2(entry, staging / entry.name, follow_symlinks=False)
