"""``k2lab export``: a complete Hugging Face model repository from a run, a training checkpoint or a model
directory (``k2lab.hf.export_source`` says which weights and which tokenizer).

The repository (written atomically through ``k2lab.fsutil.staged_directory``: a crash leaves the old
directory or the new one) holds:

* ``config.json`` and the safetensors weights as ``to_hf`` writes them, in shards of at most
  ``max_shard_size`` (``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``) once the
  weights pass it, else one ``model.safetensors``;
* the tokenizer files of ``k2lab.hf.tokenizer_files`` (``tokenizer.json``, ``tokenizer_config.json`` with
  bos/eos/pad and every special token, ``special_tokens_map.json``) and the chat template of
  ``k2lab.hf.chat_template`` (in ``tokenizer_config.json`` and as ``chat_template.jinja``);
* ``generation_config.json``: ``bos_token_id``, ``pad_token_id``, ``eos_token_id`` = [end of sequence, the end
  of a chat turn] (the ids ``k2lab serve`` stops at: ``<|im_end|>`` for K2's format, ``<|end_of_msg|>`` for
  K3's) and the sampling
  defaults of ``k2lab generate`` (``GenerationConfig``: temperature 0 = ``do_sample`` false);
* for a kimi_k25 vision-language model, the processor files of ``k2lab.hf.processor_files``
  (``processor_config.json``, ``preprocessor_config.json``, ``video_preprocessor_config.json``), from which
  ``transformers.AutoProcessor.from_pretrained`` builds ``Kimi_K25Processor``, preprocessing as k2lab does.

Every layout loads with ``k2lab.hf.from_hf``; the engines that load it depend on the layout ``to_hf`` picks
(``k2lab.hf.formats`` / ``k2lab.hf.vlm_formats``):

* deepseek_v3 / kimi_k2 / kimi_linear (and the kimi_k25 vision-language model): transformers
  (``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``, no remote code) and vLLM;
* kimi_k3 (a model with K3-only features; with a ``vision_config`` for a MoonViT-V2 tower): vLLM and mlx-lm
  (``mlx_lm.load``, the text model); transformers has no kimi_k3 model, so ``from_pretrained`` refuses it.

The chat format (``k2lab.runtime.chat_format.chat_format_for``) is chosen once per export and gives both the
template and the end-of-turn id. ``format="gguf"`` writes one llama.cpp file at ``out`` instead
(``k2lab.hf.gguf_export``). ``quantize`` writes quantised weights (``k2lab.hf.quantize``): ``mxfp4`` routed
experts as compressed-tensors MXFP4 (the Kimi K3 release format), ``fp8`` block FP8 for a DeepseekV3 /
Kimi-K2 model (the DeepSeek-V3 / Kimi-K2 release format); a model that cannot take the format is refused
before anything is written.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from k2lab.data.tokenizer import Tokenizer
from k2lab.errors import CheckpointError, K2LabError
from k2lab.fsutil import check_replaceable, check_replaceable_file, reported_write, staged_directory
from k2lab.hf.chat_template import chat_template_for
from k2lab.hf.export_source import Choice, find_source, guarded_directory
from k2lab.hf.gguf_export import GGUF_MAGIC, write_gguf
from k2lab.hf.io import CONFIG_FILE, GENERATION_CONFIG_FILE, HF_MODEL_TYPES, carry_over_other_files, to_hf
from k2lab.hf.processor_files import processor_files_for
from k2lab.hf.quantize import Quantize
from k2lab.hf.tokenizer_files import tokenizer_files
from k2lab.infer.generate import GenerationConfig
from k2lab.model_dir import MANIFEST as MODEL_MANIFEST
from k2lab.models import CausalLM
from k2lab.runtime.chat_format import chat_format_for
from k2lab.vision.vlm import VisionLanguageModel

__all__ = ["ExportConfig", "export", "generation_config", "parse_size"]

Log = Callable[[str], object]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes of ``"5GB"`` (10⁹, as transformers' ``max_shard_size``), ``"2GiB"`` (2³⁰), ``"100KB"``, ``"512"``."""
    if isinstance(text, int):
        size = text
    else:
        match = _SIZE.match(text)
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _UNITS:
            raise ValueError(f"a size like 5GB, 500MB, 2GiB or a number of bytes, got {text!r}")
        size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"the size must be positive, got {text!r}")
    return size


class ExportConfig(BaseModel):
    """What ``k2lab export SOURCE`` writes (the source is the command's argument)."""

    model_config = ConfigDict(extra="forbid")

    out: Path = Field(
        description="Directory to write the model repository to: new, empty or an earlier export (replaced "
        "atomically, keeping files added to it such as a README; another model or a directory of other files "
        "is refused, and so is the source's run)."
    )
    format: Literal["hf", "gguf"] = Field(
        default="hf",
        description="hf = Hugging Face model repository (transformers and vLLM; a kimi_k3 one: vLLM and "
        "mlx-lm); gguf = one llama.cpp file at out.",
    )
    max_shard_size: str = Field(
        default="5GB",
        description="Largest safetensors shard (5GB = 5·10⁹ bytes, 2GiB = 2·2³⁰, or bytes); larger weights "
        "are split with model.safetensors.index.json.",
    )
    dtype: Literal["keep", "fp32", "bf16", "fp16"] = Field(
        default="keep",
        description="Weight dtype on disk (keep = as loaded, fp32); the router bias stays fp32.",
    )
    checkpoint: Choice = Field(
        default="latest",
        description="For a run directory: latest = the final model or newest checkpoint; best = lowest "
        "val_loss logged at a checkpoint's step.",
    )
    tokenizer: Path | None = Field(
        default=None, description="tokenizer.json to export (default: the one found beside the weights)."
    )
    quantize: Quantize | None = Field(
        default=None,
        description="Quantised weights: mxfp4 = routed experts as compressed-tensors MXFP4 (Kimi K3's release "
        "format; MoE models); fp8 = block FP8 e4m3 with 128x128 weight_scale_inv (DeepSeek-V3 / Kimi-K2 "
        "release format; deepseek_v3 checkpoints).",
    )

    @field_validator("max_shard_size")
    @classmethod
    def _size(cls, value: str) -> str:
        parse_size(value)
        return value

    @model_validator(mode="before")
    @classmethod
    def _gguf_out_names_a_file(cls, data: Any) -> Any:
        """``out`` as given: ``new/`` names a directory, which a GGUF export (one file) must not be written as
        (``Path`` drops the slash, and a file called ``new`` appeared)."""
        if isinstance(data, dict) and data.get("format") == "gguf":
            out = str(data.get("out", ""))
            if out.endswith(("/", os.sep)):
                raise ValueError(
                    f"out={out!r} names a directory; format gguf writes one file: give its path "
                    f"(say {out}model.gguf)"
                )
        return data


def generation_config(
    tokenizer: Tokenizer, defaults: GenerationConfig | None = None, turn_end: str = "<|im_end|>"
) -> dict:
    """``generation_config.json``: the special ids (eos: end of sequence and the chat format's end of turn,
    ``<|im_end|>`` for K2, ``<|end_of_msg|>`` for K3) and sampling."""
    defaults = defaults or GenerationConfig()
    end_of_turn = tokenizer.special_tokens.get(turn_end)
    eos = [tokenizer.eos_id] + ([end_of_turn] if end_of_turn is not None else [])
    data: dict = {"bos_token_id": tokenizer.bos_id, "eos_token_id": eos, "pad_token_id": tokenizer.pad_id}
    data = {key: value for key, value in data.items() if value is not None}
    if defaults.temperature > 0:
        data.update(do_sample=True, temperature=defaults.temperature, top_p=defaults.top_p)
    else:
        data["do_sample"] = False
    return data


def _text_config(model: CausalLM | VisionLanguageModel):
    return model.config.text if isinstance(model, VisionLanguageModel) else model.config


def check_tokenizer(tokenizer: Tokenizer, model: CausalLM | VisionLanguageModel) -> None:
    """The tokenizer fits the model: no more ids than its vocabulary, the same bos / eos / pad ids."""
    config = _text_config(model)
    tokenizer.check_fits(config.vocab_size)
    for role, ours in (("bos", tokenizer.bos_id), ("eos", tokenizer.eos_id), ("pad", tokenizer.pad_id)):
        declared = getattr(config, f"{role}_token_id")
        if declared is not None and ours is not None and declared != ours:
            raise K2LabError(
                f"tokenizer {tokenizer.path} has {role} id {ours} but the model config says "
                f"{role}_token_id {declared}"
            )


def export(config: ExportConfig, source: Path, log: Log = print) -> Path:
    """Write the model repository of ``source`` (run, checkpoint or model directory) to ``config.out``."""
    if config.quantize is not None and config.format == "gguf":
        raise K2LabError("--quantize applies to --format hf; a GGUF file is written unquantised (--dtype)")
    out = Path(config.out)
    if config.format == "gguf" and out.is_dir():
        raise CheckpointError(
            f"{out} is a directory; --format gguf writes one file: give its path (say {out}/model.gguf)"
        )
    if config.format == "gguf":
        check_replaceable_file(out, "a GGUF file", source, GGUF_MAGIC)
    if config.format == "hf":
        check_export_directory(out, source)
    found = find_source(source, config.checkpoint, config.tokenizer, log)
    log(f"exporting {found.description}")
    model, tokenizer = found.load(log)
    if tokenizer is None:
        raise CheckpointError(
            f"no tokenizer.json found for {found.path} (beside the weights, in the run's model/ or the run's "
            "tokenizer setting); pass --tokenizer FILE"
        )
    check_tokenizer(tokenizer, model)
    chat_format = chat_format_for(_text_config(model), special=tokenizer.special_tokens)  # chosen once
    template = chat_template_for(chat_format)  # K3's XTML for K3 models with the XTML tokens
    if config.format == "gguf":
        if mtp := _text_config(model).num_nextn_predict_layers:  # llama.cpp's converter skips them too
            log(
                f"the GGUF file holds the main model: its {mtp} MTP layer(s) are not written (llama.cpp runs none)"
            )
        with reported_write(out, "the GGUF file"):
            return write_gguf(model, tokenizer, out, template, DTYPES.get(config.dtype, torch.float32))
    log(f"tokenizer {tokenizer.path or '(in memory)'} ({tokenizer.vocab_size} ids)")
    files = tokenizer_files(tokenizer, template, _text_config(model).max_position_embeddings)
    files[GENERATION_CONFIG_FILE] = (
        json.dumps(generation_config(tokenizer, turn_end=chat_format.turn_end), indent=2) + "\n"
    )
    files.update(processor_files_for(model, log))  # kimi_k25: what AutoProcessor reads
    with reported_write(out, "the export"):
        return _write_repository(model, config, out, files)


def _write_repository(
    model: CausalLM | VisionLanguageModel, config: ExportConfig, out: Path, files: dict[str, str]
) -> Path:
    """The checkpoint (``to_hf``) and the tokenizer ``files`` (name -> text), staged and swapped in at
    ``out`` with the files added to an earlier export there."""
    with staged_directory(out) as staging:
        dtype = DTYPES.get(config.dtype)
        to_hf(
            model,
            staging,
            max_shard_bytes=parse_size(config.max_shard_size),
            dtype=dtype,
            quantize=config.quantize,
        )
        for name, text in files.items():
            (staging / name).write_text(text, encoding="utf-8")
        carry_over_other_files(out, staging)  # the README, eval results ... added to an earlier export
    return out


def check_export_directory(out: Path, source: Path) -> None:
    """Refuse (``CheckpointError``) an ``out`` that the export would destroy something at: it must be new,
    empty or an earlier export (``is_earlier_export``), and keep out of the source: not hold it nor lie
    inside it, and for a training checkpoint the same for its whole run (``RUN/model`` is the run's final
    model, which an export of ``RUN/checkpoints/step_2`` there replaced)."""
    guarded, what = guarded_directory(source)
    if guarded.resolve() in out.resolve().parents:
        raise CheckpointError(
            f"{out} lies inside the {what} {guarded}: writing the export there would change it; choose a "
            "directory outside it"
        )
    check_replaceable(out, "the export", guarded, is_earlier_export, "export", source_name=what)


def is_earlier_export(directory: Path) -> bool:
    """Whether ``directory`` is an earlier export: a Hugging Face repository of a ``model_type`` that k2lab
    writes (``HF_MODEL_TYPES``), which ``export`` may replace (carrying over files it does not write).
    Another model is refused (``CheckpointError``) with its reason: a k2lab model directory, or another
    kind of model (a Llama, say); anything else is False ("holds other files")."""
    if (directory / MODEL_MANIFEST).exists():
        raise CheckpointError(
            f"{directory} is a k2lab model directory ({MODEL_MANIFEST}), not an earlier export: writing the "
            "export there would replace the model; choose a new or empty directory"
        )
    try:
        model_type = json.loads((directory / CONFIG_FILE).read_text()).get("model_type")
    except (OSError, ValueError, RecursionError, AttributeError):
        return False
    if model_type in HF_MODEL_TYPES:
        return True
    if isinstance(model_type, str):
        raise CheckpointError(
            f"{directory} holds a {model_type!r} model ({CONFIG_FILE}), not an earlier k2lab export: writing "
            "the export there would replace it; choose a new or empty directory"
        )
    return False
