"""The training loop end to end on a tiny corpus: metrics, checkpoints, and exact resume after SIGKILL."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k2lab.errors import CheckpointError, K2LabError
from k2lab.train.config import TrainConfig, load_train_config
from k2lab.train.metrics import read_metrics
from k2lab.train.trainer import run_training


@pytest.fixture
def corpus(tiny_corpus):
    return tiny_corpus


def recipe(tmp_path, corpus, out, steps=12):
    path = tmp_path / "recipe.toml"
    path.write_text(
        f"""
preset = "k2-nano"
vocab_size = 300
data = "{corpus}"
steps = {steps}
batch_size = 2
seq_len = 32
eval_every = 4
eval_batches = 2
save_every = 3
precision = "fp32"
sample_tokens = 4
out = "{out}"
[optimizer]
lr = 0.01
[schedule]
warmup_steps = 2
"""
    )
    return path


def losses(run_dir):
    return [(row["step"], row["loss"]) for row in read_metrics(run_dir)]


def test_short_run_writes_everything(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    summary = run_training(load_train_config(recipe(tmp_path, corpus, out, steps=6), device="cpu"))
    assert "device: cpu (device = 'cpu')" in capsys.readouterr().out
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 7))
    required = {"loss", "lr", "tokens_per_s", "max_logit", "qk_clipped_heads", "expert_load/layer1"}
    assert required <= set(rows[0])
    assert "val_loss" in rows[3] and "val_loss" in rows[5]
    for name in ("dashboard.png", "sample.txt", "summary.json", "model/k2lab.json", "tensorboard"):
        assert (out / name).exists(), name
    assert summary["steps"] == 6
    # the run records which precision the hardware module chose for each hot path, and why
    saved = json.loads((out / "summary.json").read_text())
    assert saved["precision"] == {"autocast": "fp32", "newton_schulz": summary["precision"]["newton_schulz"]}
    assert saved["precision_reason"]["autocast"] == "requested" and saved["compiled"] is False


def test_nano_presets_get_a_tokenizer_they_can_train_with():
    from k2lab.data.tokenizer import MIN_VOCAB_SIZE
    from k2lab.train.pretraining import tokenizer_family_for, tokenizer_vocab_for

    assert tokenizer_vocab_for("k2-nano") == MIN_VOCAB_SIZE == 274
    assert tokenizer_vocab_for("k3-nano") == MIN_VOCAB_SIZE + 4  # K3's XTML tokens on top
    assert tokenizer_vocab_for("k2-mini") == tokenizer_vocab_for("k3-mini") == 8192
    families = {name: tokenizer_family_for(name) for name in ("k2-mini", "k25-nano", "k3-nano", "k3-vl-nano")}
    assert families == {"k2-mini": "k2", "k25-nano": "k2", "k3-nano": "k3", "k3-vl-nano": "k3"}
    assert tokenizer_family_for("k2-nano", {"mlp_activation": "situ_glu"}) == "k3"  # overrides count


def test_a_k3_family_run_trains_a_tokenizer_that_speaks_k3(tmp_path, corpus):
    """k3-nano through the real training path: its BPE carries K3's XTML tokens within the nano minimum
    (278 ids), the checkpoint speaks K3's chat format, and ``k2lab export`` of a checkpoint of the run
    re-derives that tokenizer (not K2's) and writes K3's template."""
    import warnings

    from k2lab.data.tokenizer import SPECIAL_TOKENS, XTML_TOKENS, load_tokenizer
    from k2lab.hf.export import ExportConfig, export
    from k2lab.model_dir import load_model
    from k2lab.runtime.chat_format import chat_format_of
    from k2lab.train.run_checkpoints import checkpoint_directory

    out = tmp_path / "run"
    config = load_train_config(recipe(tmp_path, corpus, out, steps=2), preset="k3-nano", save_every=2)
    run_training(config.model_copy(update={"vocab_size": None}))  # the preset's default: the nano minimum
    tokenizer, model = load_tokenizer(out / "model"), load_model(out / "model")
    assert tokenizer.special_tokens == {t: i for i, t in enumerate((*SPECIAL_TOKENS, *XTML_TOKENS))}
    assert tokenizer.vocab_size == model.config.vocab_size == 278
    assert tokenizer.path is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lacks the XTML tokens" fallback
        assert chat_format_of(model, tokenizer=tokenizer).family == "k3"
    trained = (out / "model" / "tokenizer.json").read_text()
    (out / "model" / "tokenizer.json").unlink()  # the checkpoint's tokenizer is re-derived from the recipe
    (tmp_path / "cache").rename(tmp_path / "gone")  # not from the cache: trained again
    lines: list[str] = []
    hf = export(ExportConfig(out=tmp_path / "hf"), checkpoint_directory(out, 2), log=lines.append)
    assert any("(trained again)" in line for line in lines)
    assert (hf / "tokenizer.json").read_text() == trained
    assert "<|open|>message" in (hf / "chat_template.jinja").read_text()
    assert json.loads((hf / "generation_config.json").read_text())["eos_token_id"] == [2, 21]


def test_refuses_to_overwrite_a_run(tmp_path, corpus):
    from k2lab.errors import K2LabError

    config = load_train_config(recipe(tmp_path, corpus, tmp_path / "run", steps=3))
    run_training(config)
    with pytest.raises(K2LabError, match="--resume"):
        run_training(config)


def test_a_run_killed_while_writing_its_results_is_finished_by_resume(tmp_path, corpus):
    """Killed after its last checkpoint but before model/ and summary.json: --resume wrote nothing and said
    "already complete", for good. Now it writes the results from the final checkpoint and trains nothing."""
    out = tmp_path / "run"
    config = load_train_config(recipe(tmp_path, corpus, out, steps=3))
    run_training(config)
    lines = (out / "metrics.jsonl").read_bytes()
    shutil.rmtree(out / "model")
    (out / "summary.json").unlink()
    summary = run_training(config, resume=True)
    assert summary["steps"] == 3 and math.isfinite(summary["val_loss"])
    assert (out / "model" / "k2lab.json").is_file() and json.loads((out / "summary.json").read_text())[
        "steps"
    ] == 3
    assert (out / "metrics.jsonl").read_bytes() == lines  # no step trained again
    with pytest.raises(K2LabError, match="already complete at step 3"):
        run_training(config, resume=True)


def test_a_finished_run_without_checkpoints_is_not_trained_over(tmp_path, corpus, capsys):
    """--resume with no checkpoint started over in silence and replaced the run's model."""
    out = tmp_path / "run"
    config = load_train_config(recipe(tmp_path, corpus, out, steps=3))
    run_training(config)
    shutil.rmtree(out / "checkpoints")
    model = (out / "model" / "model.safetensors").read_bytes()
    for resume in (True, False):
        with pytest.raises(K2LabError, match="holds a finished run .* no checkpoint to continue from"):
            run_training(config, resume=resume)
    assert (out / "model" / "model.safetensors").read_bytes() == model
    fresh = load_train_config(recipe(tmp_path, corpus, tmp_path / "fresh", steps=1))
    run_training(fresh, resume=True)
    assert "no checkpoint in" in capsys.readouterr().out


def test_a_resume_with_another_learning_rate_is_refused(tmp_path, corpus):
    """The restored optimizer kept the old learning rate while the checkpoint recorded the new one."""
    out = tmp_path / "run"
    run_training(load_train_config(recipe(tmp_path, corpus, out, steps=3)))
    longer = {"steps": 6, "save_every": 2, "eval_every": 3}  # may change
    with pytest.raises(CheckpointError, match="optimizer.lr: 0.01 then, 0.05 now"):
        run_training(
            load_train_config(recipe(tmp_path, corpus, out, steps=3), **longer, **{"optimizer.lr": 0.05}),
            resume=True,
        )
    assert (
        run_training(load_train_config(recipe(tmp_path, corpus, out, steps=3), **longer), resume=True)[
            "steps"
        ]
        == 6
    )


def test_a_resume_compares_the_data_directory_not_its_spelling(tmp_path, corpus, monkeypatch):
    """`corpus`, `./corpus/` and the absolute path were refused as changed data, while `corpus` typed in
    another directory (another corpus of the same name) passed."""
    out = tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    run_training(load_train_config(recipe(tmp_path, corpus, out, steps=3), data="corpus"))
    for steps, spelling in ((4, "./corpus/"), (5, str(corpus))):
        resumed = load_train_config(recipe(tmp_path, corpus, out, steps=steps), data=spelling)
        assert run_training(resumed, resume=True)["steps"] == steps
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(corpus, elsewhere / "corpus")
    monkeypatch.chdir(elsewhere)
    with pytest.raises(CheckpointError, match=f"data: '{corpus}' then, '{elsewhere / 'corpus'}' now"):
        run_training(load_train_config(recipe(tmp_path, corpus, out, steps=6), data="corpus"), resume=True)


def edit_keeping_lengths(corpus: Path) -> None:
    """Upper-case one word in every file: each file keeps its length, its contents change."""
    for file in corpus.glob("*.txt"):
        file.write_text(file.read_text().replace("quick", "QUICK"))


def test_a_resume_on_an_edited_corpus_is_refused(tmp_path, corpus):
    """Documents were identified by path and length only: an edit keeping lengths passed, the BPE was trained
    again on the new text and the run went on with token ids that meant other text."""
    out = tmp_path / "run"
    run_training(load_train_config(recipe(tmp_path, corpus, out, steps=3)))
    edit_keeping_lengths(corpus)
    with pytest.raises(
        CheckpointError, match="trained on another corpus .* resume with the files it was started"
    ):
        run_training(load_train_config(recipe(tmp_path, corpus, out, steps=6)), resume=True)


def test_a_resume_with_another_tokenizer_file_is_refused(tmp_path, corpus):
    """The same `tokenizer` path holding another tokenizer.json: the settings match, the ids do not."""
    from k2lab.data import load_corpus, train_tokenizer

    out, named = tmp_path / "run", tmp_path / "tokenizer.json"
    train_tokenizer(load_corpus(corpus), 300, use_cache=False).save(named)
    run_training(load_train_config(recipe(tmp_path, corpus, out, steps=3), tokenizer=str(named)))
    other = shutil.copytree(corpus, tmp_path / "other")
    edit_keeping_lengths(other)
    train_tokenizer(load_corpus(other), 300, use_cache=False).save(named)
    with pytest.raises(CheckpointError, match="trained on another tokenizer .*the same `tokenizer` file"):
        run_training(
            load_train_config(recipe(tmp_path, corpus, out, steps=6), tokenizer=str(named)), resume=True
        )


def test_a_checkpoint_without_fingerprints_is_resumed_unchecked(tmp_path, corpus, monkeypatch, capsys):
    """Checkpoints written before the corpus and tokenizer were recorded stay resumable, and the log says so."""
    from k2lab.train import trainer

    recorded = trainer.training_state
    monkeypatch.setattr(
        trainer, "training_state", lambda *a: {k: v for k, v in recorded(*a).items() if k != "fingerprints"}
    )
    out = tmp_path / "run"
    run_training(load_train_config(recipe(tmp_path, corpus, out, steps=3)))
    assert run_training(load_train_config(recipe(tmp_path, corpus, out, steps=4)), resume=True)["steps"] == 4
    assert "predates recorded corpus and tokenizer fingerprints" in capsys.readouterr().out


def poison_step(monkeypatch, step: int, field: str) -> None:
    """Make the loss or gradient norm of 1-based ``step`` NaN, as a diverging run's would be."""
    from k2lab.train.trainer import Trainer

    original = Trainer.train_step

    def poisoned(self):
        result, loads = original(self)
        if self.step + 1 == step:
            setattr(result, field, math.nan)
        return result, loads

    monkeypatch.setattr(Trainer, "train_step", poisoned)


@pytest.mark.parametrize("field", ["loss", "grad_norm"])
def test_a_diverged_step_stops_the_run_and_a_resume_goes_on_from_the_last_good_checkpoint(
    tmp_path, corpus, monkeypatch, field
):
    from k2lab.train.divergence import TrainingDiverged
    from k2lab.train.run_checkpoints import list_checkpoints

    out = tmp_path / "run"
    config = load_train_config(recipe(tmp_path, corpus, out, steps=6))
    poison_step(monkeypatch, 5, field)
    with pytest.raises(
        TrainingDiverged, match="diverged at step 5: .*newest checkpoint is .*step_0+3: lower"
    ) as error:
        run_training(config)
    assert error.value.step == 5
    assert [step for step, _ in list_checkpoints(out)] == [3]  # nothing after step 4 was saved
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and math.isnan(rows[-1][field])
    assert not (out / "model").exists() and not (out / "summary.json").exists()
    monkeypatch.undo()
    assert run_training(config, resume=True)["steps"] == 6
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 7)) and all(math.isfinite(r["loss"]) for r in rows)


def test_a_study_records_a_diverged_run_as_its_result(tmp_path, corpus, monkeypatch):
    from k2lab.ablations.common import train_or_reuse

    config = load_train_config(recipe(tmp_path, corpus, tmp_path / "run", steps=4))
    poison_step(monkeypatch, 2, "loss")
    summary, reused = train_or_reuse(config, keep_weights=False)
    assert not reused and math.isnan(summary["val_loss"]) and summary["steps"] == 1
    assert "diverged at step 2" in summary["diverged"]
    again, reused = train_or_reuse(config, keep_weights=False)  # a finished result: not trained again
    assert reused and again["diverged"] == summary["diverged"]


@pytest.mark.timeout(300)
def test_sigkill_and_resume_reproduce_the_uninterrupted_losses(tmp_path, corpus):
    """The reference runs as a subprocess like the killed and resumed runs: in this process, settings earlier
    tests leave (thread count, the caches) could change CPU kernels' sums and so the losses' last bits."""
    steps = 30
    env = {**os.environ, "K2LAB_CACHE_DIR": str(tmp_path / "cache")}

    def train_command(out: Path) -> list[str]:
        return [sys.executable, "-m", "k2lab", "train", "--recipe", str(recipe(tmp_path, corpus, out, steps))]

    reference = tmp_path / "reference"
    done = subprocess.run(train_command(reference), env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]

    killed = tmp_path / "killed"
    command = train_command(killed)
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 200
    while time.time() < deadline and len(losses(killed) if (killed / "metrics.jsonl").exists() else []) < 8:
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    before = losses(killed)
    assert 8 <= len(before) < steps, "the kill should land mid-run"

    resumed = subprocess.run([*command, "--resume"], env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed" in resumed.stdout
    assert losses(killed) == losses(reference)  # every step, bit for bit


def test_generate_reads_text_prompts_with_the_runs_tokenizer(tmp_path, corpus):
    out = tmp_path / "run"
    run_training(load_train_config(recipe(tmp_path, corpus, out, steps=2)))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "k2lab",
            "generate",
            "-c",
            str(out / "model"),
            "--prompt",
            "def add",
            "--max-new-tokens",
            "5",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def add")


@pytest.mark.parametrize("preset", ["k2-nano", "k3-nano"])
def test_document_masking_run(tmp_path, corpus, preset):
    """Packed documents kept apart (MLA mask, KDA state restart) train end to end, K2- and K3-style."""
    rows = {}
    for masking in (False, True):
        out = tmp_path / f"run-{masking}"
        config = load_train_config(
            recipe(tmp_path, corpus, out, steps=3),
            preset=preset,
            document_masking=masking,
            save_every=100,
            seq_len=160,
        )
        run_training(config)
        rows[masking] = read_metrics(out)
    assert all(row["loss"] > 0 for row in rows[True])
    # the second batch crosses a document boundary, so masking changes the loss curve from there on
    assert [r["loss"] for r in rows[True]] != pytest.approx([r["loss"] for r in rows[False]], rel=1e-6)


def test_an_interrupted_run_says_what_its_caller_offers(tmp_path, monkeypatch, capsys):
    """Ctrl-C in a study's run told the user to pass --resume, an option no study has."""
    from k2lab.train import trainer

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "train", interrupted)
    monkeypatch.setattr("k2lab.train.sources.build_training_data", lambda config, log: None)
    config = TrainConfig(preset="k2-nano", out=str(tmp_path / "run"))
    with pytest.raises(KeyboardInterrupt):
        trainer.run_training(config, resume_hint="run the study again")
    captured = capsys.readouterr()
    err = " ".join(captured.err.split())  # the interrupt's line goes to stderr (k2lab.interrupt)
    assert "keeps no checkpoint yet" in err and err.endswith("run the study again") and "--resume" not in err
    assert "interrupted" not in captured.out


# ---- the step's mechanics on a nano model, without a run directory ---------------------------------------
class StaticData:
    """A ``TrainingData`` stand-in for ``training_state`` / ``restore_training_state``: no position to keep."""

    def state_dict(self) -> dict:
        return {}

    def fingerprints(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def train_batches(self):
        return iter(())

    def val_batches(self) -> list:
        return []


def nano_trainer(tmp_path, batches, **fields):
    from k2lab.train.trainer import Trainer
    from tests.conftest import nano_variant

    config = TrainConfig(preset="k2-nano", precision="fp32", **fields)
    return Trainer(config, nano_variant(), iter(batches), [], tmp_path)


def rows(count: int, seed: int = 0):
    import torch

    from k2lab.data.packing import Batch

    ids = torch.randint(0, 128, (count, 17), generator=torch.Generator().manual_seed(seed))
    return ids, lambda lo, hi: Batch(ids[lo:hi, :-1], ids[lo:hi, 1:])


def test_grad_accum_splits_one_batch_into_micro_batches_with_the_same_step(tmp_path):
    """grad_accum = 2 over two halves of a batch of full (packed) rows is the same step as grad_accum = 1
    over the whole batch: each micro-batch backpropagates loss / grad_accum, and the logged loss is their
    mean."""
    import torch

    _, batch = rows(4)
    whole = nano_trainer(tmp_path, [batch(0, 4)], grad_accum=1)
    halves = nano_trainer(tmp_path, [batch(0, 2), batch(2, 4)], grad_accum=2)
    one, _ = whole.train_step()
    two, _ = halves.train_step()
    assert two.loss == pytest.approx(one.loss, rel=1e-5)
    assert two.grad_norm == pytest.approx(one.grad_norm, rel=1e-5) and one.tokens == two.tokens
    for (name, a), b in zip(whole.model.named_parameters(), halves.model.parameters(), strict=True):
        assert torch.allclose(b.grad, a.grad, rtol=1e-4, atol=1e-6), name  # fp32 summation order


def test_each_group_takes_its_own_peak_times_the_schedule_at_this_step(tmp_path):
    """lr ← peak · schedule(step) at the 0-based step the update is for, with the AdamW groups' peak the
    ``adamw_lr``, not ``lr``."""
    from k2lab.train.schedule import lr_multiplier

    _, batch = rows(2)
    trainer = nano_trainer(
        tmp_path,
        [batch(0, 2)] * 3,
        steps=20,
        optimizer={"lr": 1e-2, "adamw_lr": 3e-4},
        schedule={"kind": "wsd", "warmup_steps": 4},
    )
    for step in (0, 2, 19):
        trainer.step = step
        trainer.train_step()
        factor = lr_multiplier(step, 20, trainer.config.schedule)
        peaks = {"adamw": 3e-4, "muon": 1e-2}
        assert {g["kind"] for g in trainer.muonclip.param_groups} == set(peaks)
        for group in trainer.muonclip.param_groups:
            assert group["lr"] == pytest.approx(peaks[group["kind"]] * factor), (step, group["kind"])
    assert lr_multiplier(0, 20, trainer.config.schedule) == pytest.approx(1 / 4)  # warmup's first step


def test_restoring_a_training_state_restores_the_rng(tmp_path):
    import random

    import numpy as np
    import torch

    from k2lab.train.trainer import restore_training_state, training_state

    _, batch = rows(2)
    trainer, data = nano_trainer(tmp_path, [batch(0, 2)]), StaticData()
    state = training_state(trainer, data)
    expected = (torch.rand(4), random.random(), np.random.random())
    restore_training_state(trainer, data, state)
    got = (torch.rand(4), random.random(), np.random.random())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]
