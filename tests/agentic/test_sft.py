"""Agentic SFT end to end on a tiny checkpoint: assistant-only labels, packing, PTX mixing, loss going down,
exact resume after SIGKILL, and one-paragraph errors for malformed trajectories."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from k2lab import build_model, load_preset
from k2lab.agentic.sft import (
    ConversationRows,
    SFTBatches,
    SFTData,
    SFTDataError,
    assistant_loss,
    encode_conversations,
    load_conversations,
    load_sft_checkpoint,
    split_conversations,
    validation_rows,
)
from k2lab.data import PackedBatches, load_corpus, load_tokenizer, train_tokenizer
from k2lab.errors import K2LabError
from k2lab.model_dir import load_model, save_model
from k2lab.runtime.chat import IM_END, normalize_messages, render_assistant_body
from k2lab.runtime.chat_format import chat_format_of
from k2lab.runtime.chat_k3 import normalize_messages_k3, render_assistant_body_k3, render_chat_k3
from k2lab.train.config import load_sft_config
from k2lab.train.metrics import read_metrics
from k2lab.train.run_checkpoints import load_latest_checkpoint

STEPS, SEQ_LEN, PTX_RATIO = 30, 280, 0.25
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def weather_conversation(city: str, temp: int, think: bool = False) -> dict:
    """user -> assistant tool call -> tool result -> assistant answer (thinking optional)."""
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": city}},
    }
    first = {"role": "assistant", "content": None, "tool_calls": [call]}
    if think:
        first["reasoning_content"] = f"Look up {city}."
    return {
        "messages": [
            {"role": "user", "content": f"Weather in {city}?"},
            first,
            {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temp": temp})},
            {"role": "assistant", "content": f"It is {temp} C in {city}."},
        ],
        "tools": [WEATHER],
    }


CONVERSATIONS = [
    weather_conversation("Paris", 21, think=True),
    weather_conversation("Rome", 25),
    weather_conversation("Oslo", 3),
    weather_conversation("Lima", 18, think=True),
    weather_conversation("Cairo", 33),
    weather_conversation("Tokyo", 12),
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4"}]},
    weather_conversation("Quito", 15),
]  # fmt: skip


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    """A random k2-nano checkpoint with a BPE tokenizer, a PTX corpus, trajectories and a recipe."""
    root = tmp_path_factory.mktemp("sft")
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(4):
        text = "def add(a, b):\n    return a + b\n# the quick brown fox jumps\n" * (3 + i)
        (corpus / f"doc{i}.txt").write_text(text + f"Weather in Paris? It is {20 + i} C.\n")
    tokenizer = train_tokenizer(load_corpus(corpus), 300, use_cache=False)
    special = dict(
        pad_token_id=tokenizer.pad_id, bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id
    )
    # a context of 2,048: the SFT rows here (SEQ_LEN, the default 1,024) must fit it (k2-nano's own is 256)
    config = load_preset("k2-nano", vocab_size=tokenizer.vocab_size, max_position_embeddings=2048, **special)
    model = build_model(config, seed=0)
    save_model(model, root / "ckpt")
    tokenizer.save(root / "ckpt" / "tokenizer.json")
    data = root / "trajectories.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    recipe = root / "recipe.toml"
    recipe.write_text(
        f"steps = {STEPS}\nbatch_size = 2\nseq_len = {SEQ_LEN}\neval_every = 10\neval_batches = 2\n"
        f'save_every = 3\nprecision = "fp32"\nsample_tokens = 4\ndata = "{corpus}"\n'
        f"[optimizer]\nlr = 0.01\n[schedule]\nwarmup_steps = 2\n[sft]\nptx_ratio = {PTX_RATIO}\n"
    )
    return {"root": root, "ckpt": root / "ckpt", "data": data, "recipe": recipe, "corpus": corpus}


def sft_command(setup: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "k2lab", "sft", "--checkpoint", str(setup["ckpt"]), "--data", str(setup["data"]),
        "--recipe", str(setup["recipe"]), "--out", str(out), *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def reference(setup) -> tuple[Path, dict, float]:
    """An uninterrupted ``k2lab sft`` run of the recipe, its summary and wall time. A subprocess like the
    killed and resumed runs: this process's ``torch.set_num_threads`` (conftest) changes CPU kernels' sums."""
    out = setup["root"] / "reference"
    start = time.perf_counter()
    result = subprocess.run(sft_command(setup, out), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    return out, json.loads((out / "summary.json").read_text()), time.perf_counter() - start


def train_batches(setup) -> list:
    """The training conversations (the hash split's train side), packed once in file order."""
    tokenizer = load_tokenizer(setup["ckpt"])
    train, _ = split_conversations(load_conversations(setup["data"]), 0.05)
    units = encode_conversations(train, tokenizer, SEQ_LEN)
    return validation_rows(units, SEQ_LEN, tokenizer.pad_id, batch_size=2, max_batches=100)


def test_labels_are_exactly_the_assistant_tokens(setup):
    tokenizer = load_tokenizer(setup["ckpt"])
    conversations = load_conversations(setup["data"])
    units = encode_conversations(conversations, tokenizer, 1000)
    rows = ConversationRows(units, seq_len=600, pad_id=tokenizer.pad_id, shuffle=False)
    batch = rows.take(3)
    for row in range(3):
        segments, labels = batch.segment_ids[row], batch.labels[row]
        assert segments.max() >= 2  # two conversations and the padding share the row
        for segment in range(int(segments.max())):  # the last segment is padding
            positions = (segments == segment).nonzero().flatten()
            text = tokenizer.decode(labels[positions][labels[positions] != -100].tolist())
            assert text.endswith(IM_END) and "<|im_user|>" not in text and "<|im_system|>" not in text
        assert (labels[segments == segments.max()] == -100).all()  # padding: no loss
    packed = units[: rows.index]  # file order: no label crosses from one conversation into the next
    assert int((batch.labels != -100).sum()) == sum(int(u.targets[1:].sum()) for u in packed)
    # conversation by conversation: the decoded targets are the assistant bodies, each closed by <|im_end|>
    for conversation, unit in zip(conversations, units, strict=True):
        single = ConversationRows([unit], seq_len=len(unit.ids) - 1, pad_id=tokenizer.pad_id).take(1)
        labels = single.labels[0]
        expected = "".join(
            render_assistant_body(m) + IM_END
            for m in normalize_messages(conversation.messages)
            if m["role"] == "assistant"
        )
        assert tokenizer.decode(labels[labels != -100].tolist()) == expected
        assert int((labels != -100).sum()) == int(unit.targets[1:].sum())
    # a conversation longer than a row is cut to one row (or dropped); the short one fits either way
    assert {len(u.ids) for u in encode_conversations(conversations, tokenizer, 200)} == {
        201,
        len(units[6].ids),
    }
    assert len(encode_conversations(conversations, tokenizer, 200, overlong="skip")) == 1


def test_a_k3_family_model_learns_k3_markup(setup):
    """SFT of a K3-family model whose tokenizer has the XTML tokens (as k2lab trains one for it) renders K3's
    markup, as its rollouts do; the targets are each assistant turn after its generation prompt
    (``<|open|>message role="assistant"<|sep|><|open|>think<|sep|>``) through ``<|end_of_msg|>``."""
    tokenizer = train_tokenizer(load_corpus(setup["corpus"]), 300, use_cache=False, family="k3")
    model = build_model(load_preset("k3-nano", vocab_size=tokenizer.vocab_size), seed=0)
    chat_format = chat_format_of(model, tokenizer=tokenizer)
    conversations = load_conversations(setup["data"])
    units = encode_conversations(conversations, tokenizer, 2000, chat_format=chat_format)
    think_open = "<|open|>think<|sep|>"
    for conversation, unit in zip(conversations, units, strict=True):
        text = tokenizer.decode(unit.ids.tolist())
        assert text == render_chat_k3(conversation.messages, conversation.tools, add_generation_prompt=False)
        assert "<|im_" not in text and text.startswith("<|open|>message role=")
        expected = "".join(
            render_assistant_body_k3(m).removeprefix(think_open) + "<|close|>message<|sep|><|end_of_msg|>"
            for m in normalize_messages_k3(conversation.messages)
            if m["role"] == "assistant"
        )
        assert tokenizer.decode(unit.ids[unit.targets].tolist()) == expected
    # SFTData takes the format from the checkpoint's model and tokenizer
    overrides = {
        "sft.init_checkpoint": str(setup["ckpt"]),
        "sft.data": str(setup["data"]),
        "sft.ptx_ratio": 0,
    }
    data = SFTData(load_sft_config(setup["recipe"], seq_len=1000, **overrides), tokenizer, model)
    assert data.chat_format.family == "k3"
    assert tokenizer.decode(data.train_units[0].ids.tolist()).startswith("<|open|>message role=")


def test_sft_takes_the_training_rules_of_the_checkpoints_family(setup, tmp_path):
    """SFT's model is its checkpoint's, not the recipe's preset: a K3-family checkpoint fine-tunes with
    Quantile Balancing and Per-Head Muon, a K2 one with the sign rule and whole-matrix Muon, and a rule the
    recipe sets wins."""
    tokenizer = train_tokenizer(load_corpus(setup["corpus"]), 300, use_cache=False, family="k3")
    config = load_preset("k3-nano", vocab_size=tokenizer.vocab_size, max_position_embeddings=2048)
    save_model(build_model(config, seed=0), tmp_path / "k3")
    tokenizer.save(tmp_path / "k3" / "tokenizer.json")
    sets = {"sft.data": str(setup["data"]), "sft.ptx_ratio": 0, "steps": 1, "seq_len": 2000}

    def rules(checkpoint: Path, **extra: object) -> tuple[str, bool]:
        recipe = load_sft_config(setup["recipe"], **sets, **{"sft.init_checkpoint": str(checkpoint)}, **extra)
        settled = SFTData.from_config(recipe).config
        return settled.balance.bias_rule, settled.optimizer.per_head_muon

    assert rules(tmp_path / "k3") == ("quantile", True)
    assert rules(setup["ckpt"]) == ("deepseek", False)
    assert rules(tmp_path / "k3", **{"optimizer.per_head_muon": False}) == ("quantile", False)


def test_ptx_rows_at_the_configured_ratio_and_resumable_stream(setup):
    tokenizer = load_tokenizer(setup["ckpt"])
    units = encode_conversations(load_conversations(setup["data"]), tokenizer, SEQ_LEN)

    def stream() -> SFTBatches:
        ptx = PackedBatches(load_corpus(setup["corpus"]).train, tokenizer, 1, SEQ_LEN, seed=0)
        return SFTBatches(ConversationRows(units, SEQ_LEN, tokenizer.pad_id, seed=0), 4, ptx, ptx_ratio=0.3)

    batches = stream()
    ptx_rows = []
    for _ in range(10):
        batch = next(batches)
        assert batch.input_ids.shape == (4, SEQ_LEN)
        ptx_rows.append(int((batch.labels != -100).all(dim=1).sum()))  # SFT rows always have masked tokens
    assert sum(ptx_rows) == 12 and set(ptx_rows) == {1, 2}  # ⌊10·4·0.3⌋, spread evenly
    state = json.loads(json.dumps(batches.state_dict()))
    expected = [next(batches) for _ in range(6)]  # crosses into the next epoch of conversations
    resumed = stream()
    resumed.load_state_dict(state)
    for want, got in zip(expected, [next(resumed) for _ in range(6)], strict=True):
        assert torch.equal(want.input_ids, got.input_ids) and torch.equal(want.labels, got.labels)
        assert torch.equal(want.segment_ids, got.segment_ids)


def test_sft_lowers_the_assistant_loss(setup, reference):
    out, summary, seconds = reference
    batches = train_batches(setup)
    before = assistant_loss(load_model(setup["ckpt"]), batches)
    after = assistant_loss(load_model(out / "model"), batches)
    print(
        f"assistant loss on the training conversations: {before:.3f} -> {after:.3f} ({STEPS} steps, {seconds:.1f}s)"
    )
    assert after < before - 1.0
    assert summary["steps"] == STEPS and np.isfinite(summary["val_loss"])
    assert (out / "model" / "tokenizer.json").is_file() and (out / "dashboard.png").is_file()
    rows = read_metrics(out)
    assert "val_loss" in rows[9] and rows[-1]["loss"] < rows[0]["loss"]
    _, state = load_latest_checkpoint(out)
    # the PTX stream served exactly ⌊30·2·0.25⌋ rows of the pre-training corpus
    assert state["data"]["sft"]["micro"] == STEPS and state["data"]["sft"]["ptx"]["batches"] == 15


@pytest.mark.timeout(200)
def test_sigkill_and_resume_reproduce_the_uninterrupted_losses(setup, reference):
    def losses(run: Path) -> list:
        return [(r["step"], r["loss"]) for r in read_metrics(run)] if (run / "metrics.jsonl").exists() else []

    killed = setup["root"] / "killed"
    command = sft_command(setup, killed)
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and len(losses(killed)) < 8:
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert 8 <= len(losses(killed)) < STEPS, "the kill should land mid-run"
    resumed = subprocess.run([*command, "--resume"], capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed" in resumed.stdout
    assert losses(killed) == losses(reference[0])  # every step, bit for bit


def test_sequences_longer_than_the_checkpoints_context_are_refused(setup):
    overrides = {"sft.init_checkpoint": str(setup["ckpt"]), "sft.data": str(setup["data"])}
    with pytest.raises(
        SFTDataError, match=r"seq_len 4096 exceeds the context of .*max_position_embeddings 2048"
    ):
        SFTData.from_config(load_sft_config(setup["recipe"], seq_len=4096, **overrides))


def test_malformed_lines_are_named(setup, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(CONVERSATIONS[0]) + "\n\n" + '{"messages": [{"role": "user"\n')
    command = [sys.executable, "-m", "k2lab", "sft", "-c", str(setup["ckpt"]), "--data", str(bad)]
    result = subprocess.run(
        [*command, "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert result.returncode == 2, result.stderr
    assert "line 3 is not valid JSON" in result.stderr and "Traceback" not in result.stderr
    cases = {
        '{"messages": [{"role": "robot", "content": "hi"}]}': "line 1: messages[0].role must be one of",
        '{"messages": [{"role": "user", "content": "hi"}]}': "line 1 has no assistant message",
        '["not", "an", "object"]': "line 1 must be a JSON object",
    }
    for line, message in cases.items():
        bad.write_text(line + "\n")
        with pytest.raises(SFTDataError, match=re.escape(message)):
            load_conversations(bad)


def test_a_checkpoint_that_is_not_a_directory_is_named_as_such(tmp_path):
    """`k2lab sft -c nope` said "checkpoint nope has no tokenizer.json"."""
    with pytest.raises(K2LabError, match=r"^checkpoint directory .*nope does not exist$"):
        load_sft_checkpoint(tmp_path / "nope")
    (tmp_path / "file").write_text("")
    with pytest.raises(K2LabError, match=r"file is a file; a checkpoint is a directory"):
        load_sft_checkpoint(tmp_path / "file")
