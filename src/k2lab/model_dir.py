"""A model directory: k2lab's own format (config + weights), and loading any supported model directory.

A *run*'s rotating checkpoints for exact resume (optimizer, data position, RNG) are
``k2lab.train.run_checkpoints``; this module holds just a model, for ``generate``, ``serve``, SFT and RL.

Layout of ``DIR``::

    k2lab.json          {"format": "k2lab-model", "version": 1, "config": {...ModelConfig...}}
                        (a vision-language model: "kind": "vlm", "config": {...VLMConfig...})
    model.safetensors   our parameter names, fused experts [E, out, in]

Writes are atomic: files go to a temporary sibling directory that is renamed over ``DIR`` at the end, so a
crash leaves either the old checkpoint or the new one, never a mix. ``load_model`` also accepts a
DeepseekV3/Kimi-K2 Hugging Face directory (``config.json`` + safetensors) through ``k2lab.hf.from_hf``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from pydantic import ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file

from k2lab.config import ModelConfig, format_validation_error
from k2lab.errors import CheckpointError, K2LabError
from k2lab.fsutil import (
    check_format_version,
    read_json_object,
    recover_directory,
    save_tensors,
    staged_directory,
)
from k2lab.hf import from_hf
from k2lab.hf.io import check_finite, listing
from k2lab.models import CausalLM, build_model
from k2lab.models.init import cast_model, materialize
from k2lab.vision.vlm import VisionLanguageModel, VLMConfig, build_vlm

FORMAT = "k2lab-model"
VERSION = 1
MANIFEST = "k2lab.json"
WEIGHTS = "model.safetensors"
KINDS = (None, "vlm")  # the manifest's "kind": absent for a causal LM
# What a floating-point parameter may be stored as (cast to the model's dtype on load).
_FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def tied_head_key(model: torch.nn.Module) -> str | None:
    """The state-dict key of a head tied to the embedding (not stored), or None (also for a module that is
    not a whole model, such as a draft's MTP block)."""
    if isinstance(model, VisionLanguageModel):
        return "language_model.lm_head.weight" if model.config.text.tie_word_embeddings else None
    config = getattr(model, "config", None)
    return "lm_head.weight" if config is not None and config.tie_word_embeddings else None


def save_model(model: CausalLM | VisionLanguageModel, directory: str | os.PathLike[str]) -> Path:
    """Write ``model`` to ``directory`` atomically (replacing an existing checkpoint there)."""
    target = Path(directory)
    with staged_directory(target) as staging:
        manifest = {"format": FORMAT, "version": VERSION, "config": model.config.model_dump(mode="json")}
        if isinstance(model, VisionLanguageModel):
            manifest["kind"] = "vlm"
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        state = {key: value.detach().contiguous() for key, value in model.state_dict().items()}
        state.pop(tied_head_key(model), None)
        save_tensors(state, staging / WEIGHTS, metadata={"format": FORMAT})
    return target


def check_model_directory(directory: str | os.PathLike[str]) -> Path:
    """``directory`` as a path, or a ``CheckpointError`` when it does not exist or is a file; call it before
    looking for a file inside (a missing directory is not a missing tokenizer.json). A directory that a write
    killed between the two renames of its swap left hidden beside it is put back first (``recover_directory``,
    as ``from_hf`` and ``export`` do)."""
    path = Path(directory)
    recover_directory(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(
            f"{path} is a file; a checkpoint is a directory (model.safetensors and its config)"
        )
    return path


def load_model(
    directory: str | os.PathLike[str], dtype: torch.dtype = torch.float32
) -> CausalLM | VisionLanguageModel:
    """Load a k2lab checkpoint or a DeepseekV3 / Kimi-K2 / Kimi Linear / Kimi K2.5 Hugging Face directory."""
    path = check_model_directory(directory)
    if (path / MANIFEST).is_file():
        return _load_own(path, dtype)
    if (path / "config.json").is_file():
        return from_hf(path, dtype=dtype)
    hint = f"; a run's model is in {path / 'model'}" if (path / "model" / MANIFEST).is_file() else ""
    raise CheckpointError(
        f"{path} holds neither {MANIFEST} (k2lab format) nor config.json (Hugging Face format){hint}"
    )


def load_text_model(directory: str | os.PathLike[str], use: str) -> CausalLM:
    """``load_model`` of a text model, for a ``use`` that trains or samples one (``"RL"``, ``"SFT"`` ...):
    ``K2LabError`` for a vision-language checkpoint, which ``k2lab rl`` took and then failed every episode on
    (its config has no ``vocab_size``), ending "done" with the policy unchanged."""
    model = load_model(directory)
    if not isinstance(model, CausalLM):
        raise K2LabError(f"{directory} is a vision-language model; {use} takes a text model")
    return model


def _load_own(path: Path, dtype: torch.dtype) -> CausalLM | VisionLanguageModel:
    manifest = read_json_object(path / MANIFEST)
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path / MANIFEST}: format is {manifest.get('format')!r}, expected {FORMAT!r}")
    check_manifest_version(manifest, path / MANIFEST)
    vlm = manifest.get("kind") == "vlm"
    try:
        config = (VLMConfig if vlm else ModelConfig).model_validate(manifest.get("config"))
    except ValidationError as error:
        raise CheckpointError(
            f"{path / MANIFEST}: invalid config: {format_validation_error(error)}"
        ) from error
    weights = path / WEIGHTS
    if not weights.is_file():
        raise CheckpointError(f"{path} has no {WEIGHTS}")
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{weights} cannot be read ({error})") from error
    model = build_vlm(config, device="meta") if vlm else build_model(config, device="meta")
    check_state_dict(model, state, str(weights))
    materialize(model)
    model.load_state_dict(state, strict=tied_head_key(model) is None)
    return cast_model(model, dtype)


FINGERPRINT_SAMPLE = 1 << 20  # bytes read from each end of a weights file


def checkpoint_fingerprint(directory: str | os.PathLike[str]) -> str:
    """SHA-256 naming a checkpoint directory's contents wherever it lies (a run moved or copied keeps it): its
    top-level ``.json`` files whole (config, manifest, tokenizer) and of each ``.safetensors`` file its size and
    first and last ``FINGERPRINT_SAMPLE`` bytes (the header and weights at both ends; bounded reading at any
    model size: weights trained further differ there)."""
    digest = hashlib.sha256()
    for path in sorted(Path(directory).iterdir()):
        if not path.is_file() or path.suffix not in (".json", ".safetensors"):
            continue
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as handle:
            if path.suffix == ".json":
                digest.update(handle.read())
                continue
            size = os.fstat(handle.fileno()).st_size
            digest.update(str(size).encode() + handle.read(FINGERPRINT_SAMPLE))
            handle.seek(max(size - FINGERPRINT_SAMPLE, 0))
            digest.update(handle.read(FINGERPRINT_SAMPLE))
    return digest.hexdigest()


def check_manifest_version(manifest: dict, source: Path) -> None:
    """``CheckpointError`` unless ``manifest`` has a ``version`` this code reads (an integer, 1 … ``VERSION``)
    and a known ``kind`` (absent, or ``"vlm"``)."""
    check_format_version(manifest, source, VERSION)
    if manifest.get("kind") not in KINDS:
        raise CheckpointError(f"{source}: kind {manifest.get('kind')!r} is unknown (expected none or 'vlm')")


def check_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Raise ``CheckpointError`` listing missing, unexpected, mis-shaped and wrongly typed tensors (a
    floating-point parameter stored as integers, booleans or FP8) of ``state`` for ``model`` (a whole model
    or a module such as a draft's), and tensors holding NaN or infinite values (a diverged or damaged model,
    which would only generate garbage)."""
    reference = model.state_dict()
    expected = {key: tuple(value.shape) for key, value in reference.items()}
    expected.pop(tied_head_key(model), None)
    problems = []
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    misshaped = [
        f"{key} {tuple(state[key].shape)} (expected {expected[key]})"
        for key in sorted(set(state) & set(expected))
        if tuple(state[key].shape) != expected[key]
    ]
    mistyped = [
        f"{key} {state[key].dtype} (expected a floating-point dtype: float32, bfloat16 or float16)"
        for key in sorted(set(state) & set(expected))
        if reference[key].is_floating_point() and state[key].dtype not in _FLOAT_DTYPES
    ]
    for label, items in (
        ("missing", missing),
        ("unexpected", unexpected),
        ("mis-shaped", misshaped),
        ("wrongly typed", mistyped),
    ):
        if items:
            problems.append(f"{len(items)} {label}: {listing(items)}")
    if problems:
        raise CheckpointError(f"{source} does not match the model config: " + "; ".join(problems))
    check_finite(state, source)
