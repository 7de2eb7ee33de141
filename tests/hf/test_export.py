"""``k2lab export``: a complete HF repository from a model directory, a training checkpoint or a run, loaded
back by transformers (``AutoModelForCausalLM`` + ``AutoTokenizer``: same ids, logits within 1e-4 and the same
greedy tokens as k2lab) and by ``from_hf``; sharding past ``max_shard_size``; which checkpoint of a run is
taken; the errors and the atomic write."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from k2lab import build_model, load_preset
from k2lab.cli import main
from k2lab.data.corpus import load_corpus
from k2lab.data.tokenizer import SPECIAL_TOKENS, Tokenizer, train_tokenizer
from k2lab.errors import K2LabError
from k2lab.hf import from_hf
from k2lab.hf.export import ExportConfig, export, parse_size
from k2lab.hf.io import INDEX_FILE, SINGLE_FILE
from k2lab.infer import GenerationConfig, generate
from k2lab.model_dir import load_model, save_model
from k2lab.runtime.chat_k3 import with_k3_tokens
from k2lab.train.config import TrainConfig
from k2lab.train.run_checkpoints import checkpoint_directory, save_training_checkpoint
from tests.conftest import randomize
from tests.hf.conftest import TEXTS, VOCAB, nano_for

transformers = pytest.importorskip("transformers")

PROMPT = "def main():\n    print('héllo')<|im_end|>"


def quiet(line: str) -> None:
    del line


def weights_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[key], sb[key]) for key in sa)


def data_bytes(path: Path) -> int:
    """Bytes of tensor data in a safetensors file: its size less the 8-byte length and the JSON header."""
    with open(path, "rb") as handle:
        header = int.from_bytes(handle.read(8), "little")
    return path.stat().st_size - 8 - header


def test_the_repository_has_every_file(exported: Path, tokenizer: Tokenizer):
    names = {path.name for path in exported.iterdir()}
    assert names == {
        "config.json",
        SINGLE_FILE,
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
    }
    config = json.loads((exported / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == (
        "<|bos|>",
        "<|eos|>",
        "<|pad|>",
    )
    assert config["unk_token"] is None and config["clean_up_tokenization_spaces"] is False
    decoder = config["added_tokens_decoder"]
    assert [decoder[str(i)]["content"] for i in range(len(SPECIAL_TOKENS))] == list(SPECIAL_TOKENS)
    assert all(entry["special"] for entry in decoder.values())
    assert set(config["additional_special_tokens"]) == set(SPECIAL_TOKENS) - {"<|bos|>", "<|eos|>", "<|pad|>"}
    generation = json.loads((exported / "generation_config.json").read_text())
    end_of_turn = tokenizer.special_tokens["<|im_end|>"]
    assert generation == {
        "bos_token_id": tokenizer.bos_id,
        "eos_token_id": [tokenizer.eos_id, end_of_turn],
        "pad_token_id": tokenizer.pad_id,
        "do_sample": False,
    }


def test_from_hf_reads_back_the_same_weights(exported: Path, model_dir: Path):
    assert weights_equal(from_hf(exported), load_model(model_dir))


def test_transformers_runs_the_export_like_k2lab(exported: Path, model_dir: Path, tokenizer: Tokenizer):
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(exported))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    ours = load_model(model_dir).eval()
    assert len(hf_tokenizer) == tokenizer.vocab_size
    assert set(hf_tokenizer.all_special_tokens) == set(SPECIAL_TOKENS) and hf_tokenizer.unk_token is None
    roles = (hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id, hf_tokenizer.pad_token_id)
    assert roles == (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id)
    ids = hf_tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == tokenizer.encode(PROMPT)
    with torch.no_grad():
        torch.testing.assert_close(hf_model(ids).logits, ours(ids).logits, rtol=1e-4, atol=1e-4)
        hf_tokens = hf_model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)[
            0, ids.shape[1] :
        ]
    k2lab_tokens = generate(ours, [ids[0].tolist()], GenerationConfig(max_new_tokens=12))[0]
    assert hf_tokens.tolist() == k2lab_tokens


def test_shards_past_max_shard_size(tmp_path: Path, model_dir: Path):
    out = export(ExportConfig(out=tmp_path / "hf", max_shard_size="60KB"), model_dir, log=quiet)
    index = json.loads((out / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and not (out / SINGLE_FILE).exists()
    for shard in shards:
        count = sum(1 for name in index["weight_map"].values() if name == shard)
        assert data_bytes(out / shard) <= 60_000 or count == 1, shard  # a tensor over the limit stands alone
    assert index["metadata"]["total_size"] == sum(data_bytes(out / shard) for shard in shards)
    assert weights_equal(from_hf(out), load_model(model_dir))
    transformers.AutoModelForCausalLM.from_pretrained(str(out))  # loads the sharded form without complaint


def test_dtype_casts_the_weights(tmp_path: Path, model_dir: Path):
    out = export(ExportConfig(out=tmp_path / "hf", dtype="bf16"), model_dir, log=quiet)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize(
    ("text", "size"),
    [("5GB", 5 * 10**9), ("2GiB", 2 * 2**30), ("100KB", 100_000), ("512", 512), ("1.5MB", 1_500_000)],
)
def test_parse_size(text: str, size: int):
    assert parse_size(text) == size


# ---- runs and checkpoints --------------------------------------------------------------------------------
def make_run(
    root: Path, tokenizer: Tokenizer, losses: dict[int, float], train_config: dict | None = None
) -> dict[int, torch.nn.Module]:
    """A run directory with one checkpoint per step (different weights) and ``val_loss`` per step; the
    run's ``train_config`` names a tokenizer file unless given."""
    tokenizer_file = root / "tok" / "tokenizer.json"
    tokenizer.save(tokenizer_file)
    train_config = {"tokenizer": str(tokenizer_file)} if train_config is None else train_config
    run = root / "run"
    models = {}
    for step in losses:
        model = randomize(nano_for(tokenizer), seed=step)
        state = {
            "step": step,
            "model": model.state_dict(),
            "optimizer": {},
            "train_config": train_config,
            "model_config": model.config.model_dump(mode="json"),
        }
        save_training_checkpoint(run, step, state, keep_last=None)
        models[step] = model
    lines = [json.dumps({"step": step, "loss": 1.0, "val_loss": loss}) for step, loss in losses.items()]
    (run / "metrics.jsonl").write_text("\n".join([*lines, '{"step": 9, "lo']) + "\n")  # last line cut short
    return models


def test_a_run_gives_its_latest_or_best_checkpoint(tmp_path: Path, tokenizer: Tokenizer):
    models = make_run(tmp_path, tokenizer, {1: 3.0, 2: 2.5, 3: 2.7})
    run = tmp_path / "run"
    lines: list[str] = []
    out = export(ExportConfig(out=tmp_path / "latest"), run, log=lines.append)
    assert "latest checkpoint step_00000003 (step 3)" in lines[0]
    assert weights_equal(from_hf(out), models[3])
    out = export(ExportConfig(out=tmp_path / "best", checkpoint="best"), run, log=lines.append)
    assert "best checkpoint (val_loss 2.5000) step_00000002" in lines[-2]
    assert weights_equal(from_hf(out), models[2])
    state = checkpoint_directory(run, 3) / "state.pt"
    state.write_bytes(state.read_bytes()[:100])  # truncated: skipped with a line, the next one taken
    lines.clear()
    out = export(ExportConfig(out=tmp_path / "latest"), run, log=lines.append)
    assert lines[0].startswith("checkpoint step_00000003 skipped") and "step_00000002" in lines[1]
    assert weights_equal(from_hf(out), models[2])
    out = export(ExportConfig(out=tmp_path / "one"), checkpoint_directory(run, 1), log=quiet)
    assert weights_equal(from_hf(out), models[1])
    assert (out / "tokenizer.json").read_text() == tokenizer.backend.to_str()


def test_a_finished_run_gives_its_final_model(tmp_path: Path, tokenizer: Tokenizer):
    make_run(tmp_path, tokenizer, {1: 3.0, 2: 2.0})
    run = tmp_path / "run"
    final = randomize(nano_for(tokenizer), seed=99)
    save_model(final, run / "model")
    tokenizer.save(run / "model" / "tokenizer.json")
    (run / "summary.json").write_text(json.dumps({"steps": 2, "val_loss": 2.0}))
    lines: list[str] = []
    out = export(ExportConfig(out=tmp_path / "hf"), run, log=lines.append)
    assert lines[0] == f"exporting run {run}: final model (step 2)"
    assert weights_equal(from_hf(out), final)


def test_a_run_that_trained_its_tokenizer_gets_it_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tokenizer: Tokenizer
):
    monkeypatch.setenv("K2LAB_CACHE_DIR", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for index, text in enumerate(TEXTS[:3]):
        (corpus / f"{index}.txt").write_text(text * 5)
    config = TrainConfig(preset="k2-nano", data=str(corpus), vocab_size=VOCAB, out=str(tmp_path / "run"))
    run_tokenizer = train_tokenizer(load_corpus(config.data), VOCAB)  # what the run trained (and cached)
    make_run(tmp_path, tokenizer, {1: 1.0}, config.model_dump(mode="json"))
    (tmp_path / "cache").rename(tmp_path / "gone")  # not cached any more: trained again, the same
    lines: list[str] = []
    out = export(ExportConfig(out=tmp_path / "hf"), tmp_path / "run", log=lines.append)
    assert any("BPE tokenizer for corpus corpus (trained again)" in line for line in lines)
    assert (out / "tokenizer.json").read_text() == run_tokenizer.backend.to_str()


def test_an_unfinished_sft_run_gets_its_starting_checkpoints_tokenizer(tmp_path: Path, tokenizer: Tokenizer):
    """The SFT branch read train_config["sft"]["checkpoint"], a key SFT configs do not have (it is
    init_checkpoint): the export fell through to training a BPE on the run's corpus setting instead."""
    base = tmp_path / "base"
    tokenizer.save(base / "tokenizer.json")
    config = TrainConfig(
        preset="k2-nano",
        out=str(tmp_path / "run"),
        sft={"init_checkpoint": str(base), "data": str(tmp_path / "sft.jsonl")},
    )
    make_run(tmp_path, tokenizer, {1: 1.0}, config.model_dump(mode="json"))
    lines: list[str] = []
    out = export(ExportConfig(out=tmp_path / "hf"), tmp_path / "run", log=lines.append)
    assert not any("BPE tokenizer for corpus" in line for line in lines)
    assert (out / "tokenizer.json").read_text() == tokenizer.backend.to_str()


# ---- errors ----------------------------------------------------------------------------------------------
def test_bad_sources_are_clear_errors(tmp_path: Path, model_dir: Path, tokenizer: Tokenizer):
    (tmp_path / "empty").mkdir()
    cases = [
        (tmp_path / "missing", {}, "does not exist"),
        (tmp_path / "empty", {}, "is not a run directory"),
        (model_dir, {"quantize": "fp8", "format": "gguf"}, "--quantize applies to --format hf"),
        (model_dir, {"tokenizer": tmp_path / "none.json"}, "tokenizer file"),
    ]
    for source, options, message in cases:
        with pytest.raises(K2LabError, match=message):
            export(ExportConfig(out=tmp_path / "out", **options), source, log=quiet)
    with pytest.raises(ValidationError, match="a size like 5GB"):
        ExportConfig(out=tmp_path / "out", max_shard_size="5XB")
    bare = save_model(nano_for(tokenizer), tmp_path / "bare")  # no tokenizer.json beside it
    with pytest.raises(K2LabError, match="pass --tokenizer FILE"):
        export(ExportConfig(out=tmp_path / "out"), bare, log=quiet)
    small = save_model(build_model(load_preset("k2-nano")), tmp_path / "small")  # 128 ids < the tokenizer's
    with pytest.raises(K2LabError, match="model's vocabulary is 128"):
        export(ExportConfig(out=tmp_path / "out", tokenizer=model_dir / "tokenizer.json"), small, log=quiet)
    make_run(tmp_path / "r", tokenizer, {1: 1.0})
    state = checkpoint_directory(tmp_path / "r" / "run", 1) / "state.pt"
    state.write_bytes(state.read_bytes()[:-1])
    with pytest.raises(K2LabError, match="no checkpoint that verifies"):
        export(ExportConfig(out=tmp_path / "out"), tmp_path / "r" / "run", log=quiet)
    assert not (tmp_path / "out").exists()


def test_a_model_the_format_cannot_hold_writes_nothing(tmp_path: Path, model_dir: Path):
    # K3 with RoPE MLA: kimi_k3 (K3's features) has NoPE MLA only
    k3 = save_model(build_model(load_preset("k3-nano", vocab_size=400, mla_rope=True)), tmp_path / "k3")
    out = tmp_path / "out"  # an earlier export, which a successful one would replace
    out.mkdir()
    (out / "config.json").write_text('{"model_type": "deepseek_v3"}')
    (out / "keep.txt").write_text("old")
    with pytest.raises(K2LabError, match="no equivalent for: mla_rope=True"):
        export(ExportConfig(out=out, tokenizer=model_dir / "tokenizer.json"), k3, log=quiet)
    assert [path.name for path in tmp_path.iterdir() if path.name.startswith(".")] == []
    assert sorted(path.name for path in out.iterdir()) == ["config.json", "keep.txt"]


def test_another_model_directory_is_refused_and_left_as_it_is(tmp_path: Path, model_dir: Path):
    llama = tmp_path / "llama"  # someone else's model: refused, untouched
    (llama / "notes").mkdir(parents=True)
    (llama / "config.json").write_text('{"model_type": "llama"}')
    (llama / "README.md").write_text("card")
    with pytest.raises(K2LabError, match="holds a 'llama' model .*not an earlier k2lab export"):
        export(ExportConfig(out=llama), model_dir, log=quiet)
    assert sorted(path.name for path in llama.iterdir()) == ["README.md", "config.json", "notes"]
    other = save_model(load_model(model_dir), tmp_path / "other")  # another k2lab model directory
    with pytest.raises(K2LabError, match="is a k2lab model directory"):
        export(ExportConfig(out=other), model_dir, log=quiet)
    assert load_model(other) is not None


def test_a_re_export_keeps_the_files_added_to_the_earlier_one(tmp_path: Path, model_dir: Path):
    out = export(ExportConfig(out=tmp_path / "hf", max_shard_size="100KB"), model_dir, log=quiet)
    (out / "README.md").write_text("card")  # what the user adds to an export stays through a re-export
    (out / "eval").mkdir()
    (out / "eval" / "scores.json").write_text("{}")
    export(ExportConfig(out=out), model_dir, log=quiet)  # now one model.safetensors: the shards go
    assert (out / "README.md").read_text() == "card" and (out / "eval" / "scores.json").is_file()
    assert sorted(path.name for path in out.glob("model*")) == [SINGLE_FILE]


def test_a_checkpoint_is_not_exported_into_its_run(tmp_path: Path, tokenizer: Tokenizer):
    make_run(tmp_path, tokenizer, {1: 1.0, 2: 0.5})
    run = tmp_path / "run"
    final = save_model(nano_for(tokenizer), run / "model")
    before = (final / "model.safetensors").read_bytes()
    step = checkpoint_directory(run, 2)
    for out, message in ((run / "model", "lies inside the run"), (run, "holds the run"), (tmp_path, "holds")):
        with pytest.raises(K2LabError, match=message):
            export(ExportConfig(out=out), step, log=quiet)
    with pytest.raises(K2LabError, match="lies inside the source"):
        export(ExportConfig(out=run / "hf"), run, log=quiet)  # the run as the source: the same
    assert (final / "model.safetensors").read_bytes() == before and (final / "k2lab.json").is_file()
    assert export(ExportConfig(out=tmp_path / "hf"), step, log=quiet).is_dir()


def test_an_out_under_a_file_is_refused_before_anything_is_loaded(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    (tmp_path / "afile").write_text("x")

    def no_loading(*args: object, **kwargs: object) -> None:
        raise AssertionError("the source was looked at")

    monkeypatch.setattr("k2lab.hf.export.find_source", no_loading)
    for format, out in (("hf", tmp_path / "afile" / "sub"), ("gguf", tmp_path / "afile" / "m.gguf")):
        with pytest.raises(K2LabError, match="afile is not a directory"):
            export(ExportConfig(out=out, format=format), model_dir, log=quiet)


@pytest.mark.parametrize("format", ["hf", "gguf"])
def test_a_full_disk_is_one_line_and_leaves_nothing(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch, format: str
):
    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("k2lab.hf.io._write_safetensors", full)
    monkeypatch.setattr("gguf.GGUFWriter.write_tensors_to_file", full)
    out = tmp_path / ("model.gguf" if format == "gguf" else "hf")
    with pytest.raises(K2LabError, match=f"cannot write the .* to {out}: No space left on device") as raised:
        export(ExportConfig(out=out, format=format), model_dir, log=quiet)
    assert "\n" not in str(raised.value)
    assert list(tmp_path.iterdir()) == []


def test_a_load_puts_back_an_export_a_killed_re_export_left_hidden(tmp_path: Path, model_dir: Path):
    out = export(ExportConfig(out=tmp_path / "hf"), model_dir, log=quiet)
    (tmp_path / ".hf.old.abcd1234").mkdir()
    out.rename(tmp_path / ".hf.old.abcd1234" / "hf")  # killed between replace_directory's two renames
    assert weights_equal(from_hf(out), load_model(model_dir))
    assert sorted(path.name for path in tmp_path.iterdir()) == [".hf.old.abcd1234", "hf"]


@pytest.mark.parametrize(
    ("format", "name"), [("hf", "model.embed_tokens.weight"), ("gguf", "token_embd.weight")]
)
def test_weights_past_fp16s_range_are_refused_not_written_as_inf(
    tmp_path: Path, model_dir: Path, format: str, name: str
):
    model = load_model(model_dir)
    with torch.no_grad():
        model.embed.weight[3, 5] = -1e5  # fp16's largest is 65504
    source = save_model(model, tmp_path / "big")
    (source / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    out = tmp_path / ("big.gguf" if format == "gguf" else "hf")
    with pytest.raises(K2LabError, match=rf"float16 cannot hold .*{name} \(max \|value\| 100000\)"):
        export(ExportConfig(out=out, format=format, dtype="fp16"), source, log=quiet)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["big"]
    assert export(ExportConfig(out=out, format=format, dtype="bf16"), source, log=quiet).exists()


def test_the_command(tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as done:
        main(["export", str(model_dir), "--out", str(tmp_path / "hf"), "--max-shard-size", "100KB"])
    assert done.value.code == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert f"exporting model directory {model_dir}" in printed and "model.safetensors.index.json" in printed
    with pytest.raises(SystemExit) as done:
        main(["export", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")])
    assert done.value.code == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_k3_family_export_ends_turns_at_end_of_msg(tmp_path: Path, tokenizer: Tokenizer) -> None:
    """A K3-family model with the XTML tokens exports K3's template and stops at ``<|end_of_msg|>``."""
    k3_tokenizer = with_k3_tokens(tokenizer)
    config = load_preset("k3-nano", vocab_size=k3_tokenizer.vocab_size, eos_token_id=k3_tokenizer.eos_id)
    directory = save_model(randomize(build_model(config)), tmp_path / "k3")
    k3_tokenizer.save(directory / "tokenizer.json")
    out = export(ExportConfig(out=tmp_path / "k3-hf"), directory, log=quiet)
    generation = json.loads((out / "generation_config.json").read_text())
    end_of_msg = k3_tokenizer.special_tokens["<|end_of_msg|>"]
    assert generation["eos_token_id"] == [k3_tokenizer.eos_id, end_of_msg]
    assert "<|open|>message" in (out / "chat_template.jinja").read_text()
    assert json.loads((out / "config.json").read_text())["model_type"] == "kimi_k3"


def test_a_k3_model_without_the_xtml_tokens_warns_once(tmp_path: Path, tokenizer: Tokenizer) -> None:
    """The chat format is chosen once per export: one warning, and K2's template and turn end follow it."""
    directory = save_model(nano_for(tokenizer, "k3-nano"), tmp_path / "k3")
    tokenizer.save(directory / "tokenizer.json")
    with pytest.warns(UserWarning, match="lacks <|open|>") as caught:
        out = export(ExportConfig(out=tmp_path / "k3-hf"), directory, log=quiet)
    assert len([w for w in caught if "K3-family" in str(w.message)]) == 1
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tokenizer.eos_id, tokenizer.special_tokens["<|im_end|>"]]
    assert "<|open|>" not in (out / "chat_template.jinja").read_text()
