"""Fixtures of the export tests: a small byte-level BPE with K2's special tokens, a k2-nano model whose
vocabulary fits it (saved as a k2lab model directory with the tokenizer), and that directory exported."""

from __future__ import annotations

from pathlib import Path

import pytest

from k2lab import build_model, load_preset
from k2lab.data.tokenizer import Tokenizer, train_bpe
from k2lab.hf.export import ExportConfig, export
from k2lab.model_dir import save_model
from k2lab.models import CausalLM
from tests.conftest import randomize

TEXTS = [
    "def main():\n    print('hello world')  # ünïcode 日本語\n",
    'The quick brown fox jumps over the lazy dog. 0123456789 {"key": [1, 2.5, null]}\n',
    "namespace functions {\n// Search the web.\ntype search = (_: {\n  query: string;\n}) => any;\n}",
] * 20
VOCAB = 400


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
