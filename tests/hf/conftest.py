"""Fixtures of the export tests: a small byte-level BPE with K2's special tokens, a k2-nano model whose
vocabulary fits it (saved as a k2lab model directory with the tokenizer), and that directory exported; a
k25-nano with a non-default tower (patch 8, volumes of 2 frames) exported the same way."""

from __future__ import annotations

from pathlib import Path

import pytest

from k2lab import build_model, load_preset
from k2lab.data.tokenizer import Tokenizer, train_bpe
from k2lab.hf.export import ExportConfig, export
from k2lab.model_dir import save_model
from k2lab.models import CausalLM
from k2lab.presets.vision_language import load_vlm_preset
from k2lab.vision.vlm import VLMConfig, build_vlm
from tests.conftest import randomize

TEXTS = [
    "def main():\n    print('hello world')  # ünïcode 日本語\n",
    'The quick brown fox jumps over the lazy dog. 0123456789 {"key": [1, 2.5, null]}\n',
    "namespace functions {\n// Search the web.\ntype search = (_: {\n  query: string;\n}) => any;\n}",
] * 20
VOCAB = 400
K25_TOWER = {"patch_size": 8, "pos_emb_time": 2}  # not transformers' class defaults (patch 14, 4 frames)


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer(train_bpe(TEXTS, VOCAB))


def nano_for(tokenizer: Tokenizer, preset: str = "k2-nano", **overrides: object) -> CausalLM:
    """``preset`` (with ``overrides``) at the tokenizer's vocabulary and special ids, weights re-drawn
    (std 0.15)."""
    config = load_preset(preset, **overrides).replace(
        vocab_size=VOCAB,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id,
    )
    return randomize(build_model(config, seed=0))


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer: Tokenizer) -> Path:
    directory = save_model(nano_for(tokenizer), tmp_path_factory.mktemp("model") / "nano")
    tokenizer.save(directory / "tokenizer.json")
    return directory


@pytest.fixture(scope="session")
def exported(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("export") / "nano-hf"
    return export(ExportConfig(out=out), model_dir, log=lambda line: None)


def k25_config(tokenizer: Tokenizer) -> VLMConfig:
    """k25-nano with the ``K25_TOWER`` at the tokenizer's vocabulary and special ids."""
    return load_vlm_preset(
        "k25-nano",
        special_tokens=tokenizer.special_tokens,
        vision_overrides=K25_TOWER,
        vocab_size=VOCAB,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id,
    )


@pytest.fixture(scope="session")
def k25_export(tmp_path_factory: pytest.TempPathFactory, tokenizer: Tokenizer) -> Path:
    """The ``k25_config`` model (seed 0) with the tokenizer, exported as kimi_k25."""
    directory = save_model(build_vlm(k25_config(tokenizer), seed=0), tmp_path_factory.mktemp("k25") / "m")
    tokenizer.save(directory / "tokenizer.json")
    out = tmp_path_factory.mktemp("k25-export") / "hf"
    return export(ExportConfig(out=out), directory, log=lambda line: None)
