"""K2.5's visual RL on a k25-nano VLM: log π of completions with pixel inputs against the model's full logits,
K1.5's group loss by hand, joint updates of the language model and the tower, exact resume, the held-out text
loss before and after against the models' own cross-entropy, refusals."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from k2lab.cli import main
from k2lab.data.corpus import load_corpus
from k2lab.errors import K2LabError
from k2lab.model_dir import load_model, save_model
from k2lab.models import build_model
from k2lab.presets import load_preset
from k2lab.presets.vision_language import load_vlm_preset
from k2lab.vision import rl
from k2lab.vision.chat import visual_chat_prompt
from k2lab.vision.rl import VisualRLConfig, run_visual_rl
from k2lab.vision.rl_scoring import completion_logprobs, group_loss
from k2lab.vision.tasks import make_task
from k2lab.vision.text_loss import held_out_text
from k2lab.vision.vlm import build_vlm

SMALL = dict(
    iterations=2, prompts_per_iteration=2, group_size=2, max_new_tokens=4, eval_samples=0, logprob_batch=3
)


@pytest.fixture(scope="module")
def vlm_dir(small_tokenizer, tmp_path_factory):
    """A k25-nano VLM saved with its tokenizer (a run's input)."""
    config = load_vlm_preset("k25-nano", small_tokenizer.special_tokens, vocab_size=300)
    directory = save_model(build_vlm(config, seed=3), tmp_path_factory.mktemp("vlm") / "model")
    small_tokenizer.save(directory / "tokenizer.json")
    return directory


def varied_reward(kind, text, truth):
    """A deterministic reward that differs within groups (a random nano model never answers right)."""
    return (len(text) % 4) / 3


def test_completion_logprobs_are_the_models_full_logits_at_the_completion(vlm_dir, small_tokenizer):
    model = load_model(vlm_dir).eval()
    samples = [make_task("counting", 1), make_task("ocr", 2), make_task("counting", 5)]
    asked = [visual_chat_prompt(s, small_tokenizer, model.config.vision) for s in samples]
    prompts, media = [ids for ids, _ in asked], [m for _, m in asked]
    completions = [[40, 41, 42], [60], [70, 71, 72, 73, 74]]
    placeholders = [model.config.image_token_id, model.config.video_token_id]
    with torch.no_grad():
        got = completion_logprobs(model, prompts, completions, media, batch=2)  # padded, head masked
        for prompt, completion, pixels, logp in zip(prompts, completions, media, got, strict=True):
            logits = model(torch.tensor([prompt + completion]), **pixels).logits[0].double()
            logits[:, placeholders] = -torch.inf  # the sampler never draws an image / video placeholder
            expected = []
            for t, token in enumerate(completion):
                row = logits[len(prompt) - 1 + t]
                expected.append(row[token] - torch.logsumexp(row, 0))
            torch.testing.assert_close(logp.double(), torch.stack(expected), atol=2e-5, rtol=0)
    new = completion_logprobs(model, prompts, completions, media)
    assert all(x.requires_grad for x in new)  # π_θ carries a gradient


def test_group_loss_is_k15_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.5])
    new = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5]), torch.tensor([-3.0, -1.0, -0.2])]
    old = [torch.tensor([-1.5, -2.0]), torch.tensor([-0.1]), torch.tensor([-1.0, -1.1, -0.2])]
    tau, mean = 0.5, 0.5
    ratios = [0.5, -0.4, -2.0 + 0.1]
    by_hand = sum((r - mean - tau * x) ** 2 for r, x in zip([1.0, 0.0, 0.5], ratios, strict=True)) / 3
    loss, clipped = group_loss(rewards, new, old, tau)
    assert clipped == 0 and loss.item() == pytest.approx(by_hand)
    # δ = 1 masks the token that moved by 2 (|−3 − (−1)| > 1): the third ratio is 0.1
    ratios[2] = 0.1
    by_hand = sum((r - mean - tau * x) ** 2 for r, x in zip([1.0, 0.0, 0.5], ratios, strict=True)) / 3
    loss, clipped = group_loss(rewards, new, old, tau, clip=1.0)
    assert clipped == 1 and loss.item() == pytest.approx(by_hand)


def _weights(directory):
    return load_model(directory).state_dict()


def _changed(before, after, prefix):
    return [k for k in before if k.startswith(prefix) and not torch.equal(before[k], after[k])]


NO_DECAY = {"lr": 1e-2, "weight_decay": 0.0}  # weights move only by the RL gradient


def test_a_killed_run_resumes_to_the_uninterrupted_metrics_and_weights(vlm_dir, tmp_path, monkeypatch):
    """Two iterations train the language model and the tower (joint RL); killed after the first and
    restarted with the same arguments, the run logs the same metrics and ends with the same weights."""
    monkeypatch.setattr(rl, "visual_reward", varied_reward)
    config = VisualRLConfig(**(SMALL | {"eval_samples": 2}), optimizer=NO_DECAY)
    history = run_visual_rl(vlm_dir, tmp_path / "whole", config)
    assert [m["iteration"] for m in history] == [0, 1] and all(m["loss"] > 0 for m in history)
    assert set(history[0]["per_task"]) == {"counting", "ocr"} and history[0]["answers"] == 4
    source, whole = _weights(vlm_dir), _weights(tmp_path / "whole" / "model")
    assert _changed(source, whole, "language_model.") and _changed(source, whole, "vision.")
    assert (tmp_path / "whole" / "model" / "tokenizer.json").is_file()

    def kill(metrics):
        if metrics["iteration"] == 0:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_visual_rl(vlm_dir, tmp_path / "killed", config, on_iteration=kill)
    assert not (tmp_path / "killed" / "model").exists()
    run_visual_rl(vlm_dir, tmp_path / "killed", config)

    def lines(run):
        rows = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if "seconds" not in k} for x in rows]

    assert lines("killed") == lines("whole") and len(lines("whole")) == 2
    resumed = _weights(tmp_path / "killed" / "model")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    summary = json.loads((tmp_path / "killed" / "summary.json").read_text())
    assert summary == json.loads((tmp_path / "whole" / "summary.json").read_text()) | {
        "seconds_per_iteration": summary["seconds_per_iteration"]
    }
    assert set(summary["before"]) == {"chat", "blind", "text_loss"}  # the default 32 held-out text rows
    assert summary["text_eval"]["rows"] == 32 and summary["text_eval"]["corpus"].endswith("-stdlib")
    assert set(summary["after"]["chat"]) == {"counting", "ocr", "mean"}


def test_freeze_vision_trains_the_language_model_only(vlm_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(rl, "visual_reward", varied_reward)
    config = VisualRLConfig(
        **(SMALL | {"iterations": 1}), freeze_vision=True, optimizer=NO_DECAY, text_eval_rows=0
    )
    run_visual_rl(vlm_dir, tmp_path / "run", config)
    before, after = _weights(vlm_dir), _weights(tmp_path / "run" / "model")
    assert _changed(before, after, "language_model.") and not _changed(before, after, "vision.")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())  # no evaluation of any kind
    assert summary["before"] is None and summary["after"] is None and summary["text_eval"] is None
    assert rl.evaluation_report(summary) is None


def held_out_cross_entropy(directory, tokenizer, corpus, rows, seq_len):
    """By hand: the corpus's validation documents (each + EOS) concatenated, ``rows`` windows of seq_len + 1
    ids at stride seq_len, the whole VLM's logits on them (no image) -> mean next-token cross-entropy."""
    ids = [i for doc in load_corpus(corpus).val for i in [*tokenizer.encode(doc.text), tokenizer.eos_id]]
    windows = torch.tensor([ids[k * seq_len : k * seq_len + seq_len + 1] for k in range(rows)])
    with torch.no_grad():
        logits = load_model(directory).eval()(windows[:, :-1]).logits.double()
    return F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item()


def test_text_loss_is_each_models_own_cross_entropy_on_held_out_rows(
    vlm_dir, small_tokenizer, tmp_path, monkeypatch, capsys
):
    """Before: the source model's cross-entropy on the corpus's held-out rows; after: the trained model's on
    the same rows (the weights moved, so the two differ); in summary.json, eval_before.json and the report."""
    monkeypatch.setattr(rl, "visual_reward", varied_reward)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):  # one of the three files is the validation split
        (corpus / f"f{i}.txt").write_text(f"file {i}: the cat sat on the mat; " * (30 + i))
    out = tmp_path / "run"
    args = ["visual-rl", "-c", vlm_dir, "--out", out, "--iterations", 1, "--prompts", 2, "--group", 2,
            "--max-new-tokens", 4, "--eval-samples", 0, "--lr", 1e-2, "--text-eval-rows", 4,
            "--text-eval-seq-len", 16, "--text-eval-data", corpus]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    assert exit_info.value.code == 0
    summary = json.loads((out / "summary.json").read_text())
    before = held_out_cross_entropy(vlm_dir, small_tokenizer, corpus, 4, 16)
    after = held_out_cross_entropy(out / "model", small_tokenizer, corpus, 4, 16)
    assert abs(before - after) > 1e-4  # else the test could not tell the models apart
    assert summary["before"] == {"text_loss": pytest.approx(before, abs=1e-5)}
    assert summary["after"] == {"text_loss": pytest.approx(after, abs=1e-5)}
    assert json.loads((out / "eval_before.json").read_text()) == summary["before"]
    assert summary["text_eval"] == {"corpus": "corpus", "rows": 4, "seq_len": 16}
    printed = " ".join(capsys.readouterr().out.split())
    assert f"text loss {before:.4f} → {after:.4f} nats/token (4 rows × 16 tokens of corpus)" in printed


def test_held_out_text_asks_for_a_validation_file(small_tokenizer, tmp_path):
    (tmp_path / "only.txt").write_text("one file is all training text " * 10)
    with pytest.raises(K2LabError, match="no validation files"):
        held_out_text(small_tokenizer, 4, 16, str(tmp_path))


def test_equal_rewards_give_no_gradient(vlm_dir, tmp_path):
    """A random nano model scores 0 on every answer: r_j − r̄ = 0 and the ratio starts at 0, so nothing
    moves (without weight decay)."""
    config = VisualRLConfig(**(SMALL | {"iterations": 1}), optimizer=NO_DECAY)
    history = run_visual_rl(vlm_dir, tmp_path / "run", config)
    assert history[0]["mean_reward"] == 0 and history[0]["loss"] == 0
    before, after = _weights(vlm_dir), _weights(tmp_path / "run" / "model")
    assert not _changed(before, after, "")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["before"]["text_loss"] == summary["after"]["text_loss"] > 0  # same weights, same rows


def test_bad_configs_are_refused():
    with pytest.raises(ValidationError, match="subset"):
        VisualRLConfig(tasks=["reading"])
    with pytest.raises(ValidationError, match="subset"):
        VisualRLConfig(tasks=[])
    with pytest.raises(ValidationError, match="floor"):
        VisualRLConfig(temperature_start=0.5, temperature_floor=0.8)
    with pytest.raises(ValidationError):
        VisualRLConfig(group_size=1)
    assert VisualRLConfig(temperature_start=0.2).temperature_floor == 0.2


def test_a_text_checkpoint_is_refused_naming_k2lab_rl(small_tokenizer, tmp_path, capsys):
    text = save_model(build_model(load_preset("k2-nano", vocab_size=300)), tmp_path / "text")
    small_tokenizer.save(text / "tokenizer.json")
    with pytest.raises(K2LabError, match="k2lab rl"):
        run_visual_rl(text, tmp_path / "run", VisualRLConfig(**SMALL))
    assert not (tmp_path / "run").exists()  # refused before the run directory is claimed
    with pytest.raises(SystemExit) as exit_info:
        main(["visual-rl", "-c", str(text), "--out", str(tmp_path / "run"), "--iterations", "1"])
    assert exit_info.value.code != 0 and "k2lab rl" in capsys.readouterr().err.replace("\n", " ")
    (text / "tokenizer.json").unlink()
    with pytest.raises(K2LabError, match="tokenizer.json"):
        run_visual_rl(text, tmp_path / "run", VisualRLConfig(**SMALL))
