"""Shared fixtures: small models with weights large enough that routing and logits are non-trivial."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from k2lab import build_model, load_preset
from k2lab.models import CausalLM

torch.set_num_threads(2)


def randomize(model: CausalLM, std: float = 0.15, bias_std: float = 0.05, seed: int = 0) -> CausalLM:
    """Re-draw every weight with a larger std and give the routers a random correction bias."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if name.endswith("norm.weight"):
                tensor.copy_(1 + 0.1 * torch.randn(tensor.shape, generator=generator))
            elif name.endswith("e_score_correction_bias"):
                tensor.copy_(bias_std * torch.randn(tensor.shape, generator=generator))
            else:
                tensor.copy_(std * torch.randn(tensor.shape, generator=generator))
    return model.eval()


@pytest.fixture
def nano() -> CausalLM:
    return randomize(build_model(load_preset("k2-nano")))


# k3-nano overrides that leave exactly what transformers' Kimi Linear has (KDA with the softplus gate and
# low-rank output gate, NoPE MLA, SwiGLU DeepSeek MoE, plain residuals).
KIMI_LINEAR_STYLE = dict(
    kda_gate="softplus",
    kda_output_gate="low_rank",
    mla_output_gate=False,
    mlp_activation="swiglu",
    moe_latent_size=None,
    attnres_block_size=None,
)


def nano_variant(**overrides: object) -> CausalLM:
    return randomize(build_model(load_preset("k2-nano", **overrides)))


TINY_TEXT = (
    "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"
    "        self.y = y\n\n# the quick brown fox jumps over the lazy dog\n"
)


@pytest.fixture
def tiny_corpus(tmp_path, monkeypatch):
    """A 6-file text corpus (train/validation split by file) and a private tokenizer cache."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(6):
        (folder / f"doc{i}.txt").write_text(TINY_TEXT * (3 + i) + f"file {i}\n")
    monkeypatch.setenv("K2LAB_CACHE_DIR", str(tmp_path / "cache"))
    return folder


def tiny_recipe(path, corpus, **fields) -> object:
    """Write a k2-nano recipe (vocab 300, batch 2 × 32, fp32) over ``corpus`` to ``path``; returns the path."""
    values = {
        "preset": "k2-nano",
        "vocab_size": 300,
        "data": str(corpus),
        "batch_size": 2,
        "seq_len": 32,
        "eval_batches": 2,
        "precision": "fp32",
        "sample_tokens": 4,
        **fields,
    }
    lines = [
        f"{key} = {value!r}" if isinstance(value, str) else f"{key} = {value}"
        for key, value in values.items()
    ]
    path.write_text("\n".join(lines) + "\n[schedule]\nwarmup_steps = 2\n")
    return path


@pytest.fixture(scope="session")
def small_tokenizer(tmp_path_factory):
    """A 300-token byte-level BPE with k2lab's special tokens, trained on a little chat / JSON text."""
    from k2lab.data.corpus import load_corpus
    from k2lab.data.tokenizer import train_tokenizer

    folder = tmp_path_factory.mktemp("small-corpus")
    text = 'hello there, how are you? {"city": "Paris", "unit": "celsius", "days": 3} get_weather describe '
    for i in range(4):
        (folder / f"d{i}.txt").write_text(text * (20 + i))
    return train_tokenizer(load_corpus(str(folder)), vocab_size=300, use_cache=False)


def trajectory_tokenizer(root, count: int, seed: int) -> tuple[object, object, dict[str, int]]:
    """Zero-vision trajectories in ``root`` and a 400-token BPE trained on their text: (the JSONL path, the
    tokenizer, its pad / bos / eos ids as model config fields)."""
    import json

    from k2lab.data.corpus import load_corpus
    from k2lab.data.tokenizer import train_tokenizer
    from k2lab.vision.text_trajectories import ZeroVisionConfig, write_zero_vision

    data = write_zero_vision(ZeroVisionConfig(out=root / "zero_vision.jsonl", count=count, seed=seed))
    corpus = root / "corpus"
    corpus.mkdir()
    for i, line in enumerate(data.read_text().splitlines()):
        (corpus / f"doc{i}.txt").write_text("\n".join(m["content"] for m in json.loads(line)["messages"]))
    tokenizer = train_tokenizer(load_corpus(corpus), 400, use_cache=False)
    ids = dict(pad_token_id=tokenizer.pad_id, bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id)
    return data, tokenizer, ids


def free_port() -> int:
    """A TCP port free on the loopback interface right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(app) -> Iterator[str]:
    """Serve an ASGI ``app`` with uvicorn on a free loopback port in a thread; yields its base URL
    ``http://127.0.0.1:PORT`` once it has started and stops the server on exit."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 30
        while not server.started and time.time() < deadline:
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
