"""K3's multi-effort RL + MOPD: the per-token loss and gradient on a hand-computed 2-token case, teacher
routing by (domain, effort), the effort wrapper (system prompt, budget), a tiny end-to-end run (nine
experts, distillation, baseline, report) through the CLI, and exact resume of distillation."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k2lab import build_model, load_preset
from k2lab.agentic.distill.effort import EffortEnv, ExpertSpec, expert_specs, load_manifest, train_experts
from k2lab.agentic.distill.mopd import (
    MOPDConfig,
    MOPDTrainer,
    TeacherRouter,
    dense_reverse_kl,
    mopd_advantages,
    mopd_dense_loss,
    mopd_loss,
    run_mopd,
    sft_loss,
)
from k2lab.agentic.episodes.rollout import LocalPolicy
from k2lab.agentic.rl.trainer import RLConfig, run_rl
from k2lab.cli import main
from k2lab.errors import K2LabError
from k2lab.model_dir import load_model, save_model
from k2lab.train.persistence import capture_rng_state
from k2lab.train.run_checkpoints import save_training_checkpoint
from k2lab.train.run_directory import claim_run_directory
from tests.conftest import randomize

TINY_BUDGETS = {"low": 2, "high": 4, "max": 6}


def cli(*args) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([str(arg) for arg in args])
    assert exit_info.value.code == 0


def nano_model(seed: int = 0):
    model = build_model(load_preset("k2-nano", vocab_size=300, max_position_embeddings=2048))
    return randomize(model, seed=seed)


# ---- the math


def test_mopd_loss_and_gradient_hand_computed():
    # position 1: student p_S = [1/4, 3/4], teacher p_T = [1/2, 1/2], sampled y = 1
    # position 2: student p_S = [1/2, 1/2], teacher p_T = [0.8, 0.2], sampled y = 0
    student_logits = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]], requires_grad=True)
    teacher_logits = torch.tensor([[0.0, 0.0], [math.log(0.8), math.log(0.2)]], requires_grad=True)
    y = torch.tensor([1, 0])
    logp_s = student_logits.log_softmax(-1).gather(-1, y[:, None]).squeeze(-1)
    logp_t = teacher_logits.log_softmax(-1).gather(-1, y[:, None]).squeeze(-1)
    a1, a2 = math.log(0.5 / 0.75), math.log(0.8 / 0.5)  # A_t = log π_T(y_t) − log π_S(y_t)
    assert mopd_advantages(logp_t, logp_s).tolist() == pytest.approx([a1, a2])
    loss = mopd_loss(logp_s, logp_t)
    # L = −(1/2) [A_1 · log(3/4) + A_2 · log(1/2)]
    assert float(loss.detach()) == pytest.approx(-(a1 * math.log(0.75) + a2 * math.log(0.5)) / 2)
    loss.backward()
    # ∂L/∂z_t = −(A_t / N) (onehot(y_t) − p_S,t)
    expected = [[-a1 / 2 * (0 - 0.25), -a1 / 2 * (1 - 0.75)], [-a2 / 2 * (1 - 0.5), -a2 / 2 * (0 - 0.5)]]
    assert student_logits.grad.tolist()[0] == pytest.approx(expected[0])
    assert student_logits.grad.tolist()[1] == pytest.approx(expected[1])
    assert teacher_logits.grad is None  # the teacher only scores (sg)
    # over-weighted token 1 at position 1 is pushed down, under-weighted token 0 at position 2 up
    assert student_logits.grad[0, 1] > 0 and student_logits.grad[1, 0] < 0


def test_dense_reverse_kl_hand_computed_with_ruled_out_tokens():
    # position 1: p_S = [1/4, 3/4], p_T = [1/2, 1/2]; position 2: token 2 ruled out, p_S = p_T = [1/2, 1/2]
    inf = float("inf")
    student = torch.tensor([[math.log(0.25), math.log(0.75), -inf], [math.log(0.5), math.log(0.5), -inf]])
    teacher = torch.tensor([[math.log(0.5), math.log(0.5), -inf], [math.log(0.5), math.log(0.5), -inf]])
    kl_1 = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert dense_reverse_kl(student, teacher).tolist() == pytest.approx([kl_1, 0.0])
    assert float(mopd_dense_loss(student, teacher)) == pytest.approx(kl_1 / 2)
    assert float(mopd_dense_loss(torch.zeros(0, 3), torch.zeros(0, 3))) == 0.0


def test_dense_gradient_is_the_expected_sampled_gradient():
    """∇ KL(π_S ‖ π_T) = E_{y∼π_S}[∇ L_sampled(y)]: enumerate y with its probability (3 positions, a ruled-out
    token at one of them) and compare with the dense loss's gradient; no NaN flows from the −inf entries."""
    generator = torch.Generator().manual_seed(0)
    logits_s = torch.randn(3, 5, generator=generator)
    logits_t = torch.randn(3, 5, generator=generator)
    ruled_out = torch.zeros(3, 5, dtype=torch.bool)
    ruled_out[1, 3:] = True
    bias = torch.zeros(3, 5).masked_fill(ruled_out, float("-inf"))
    teacher = (logits_t + bias).log_softmax(-1)

    dense_logits = logits_s.clone().requires_grad_(True)
    mopd_dense_loss((dense_logits + bias).log_softmax(-1), teacher).backward()

    expected = torch.zeros(3, 5)
    probs = (logits_s + bias).softmax(-1)
    for t in range(3):
        for y in range(5):
            if ruled_out[t, y]:
                continue
            z = logits_s[t : t + 1].clone().requires_grad_(True)
            logp = (z + bias[t : t + 1]).log_softmax(-1)[:, y]
            mopd_loss(logp, teacher[t : t + 1, y]).backward()  # one sampled token at one position (N = 1)
            expected[t] += probs[t, y] * z.grad[0] / 3  # the dense loss averages over the N = 3 positions
    assert torch.isfinite(dense_logits.grad).all()
    assert torch.allclose(dense_logits.grad, expected, atol=1e-6)


def test_sft_baseline_loss_is_mean_negative_logprob():
    logp = torch.tensor([-1.0, -3.0])
    assert float(sft_loss(logp)) == pytest.approx(2.0)
    assert float(mopd_loss(torch.zeros(0), torch.zeros(0))) == 0.0


# ---- effort and routing


def test_effort_env_sets_system_prompt_budget_and_cell(small_tokenizer):
    spec = ExpertSpec("arithmetic", "high", 48)
    env = EffortEnv(spec)
    episode = env.reset(3)
    assert episode.messages[0] == {"role": "system", "content": "Reasoning effort: high"}
    assert episode.messages[1]["role"] == "system" and episode.messages[-1]["role"] == "user"
    assert episode.token_budget == 48 and spec.max_new_tokens == 96
    assert episode.state["domain"] == "arithmetic" and episode.state["effort"] == "high"
    assert episode.env == "arithmetic-high"
    env.step(episode, {"role": "assistant", "content": str(episode.state["answer"])})
    assert episode.done and episode.reward == 1.0 and episode.env == "arithmetic-high"
    policy = LocalPolicy(nano_model(), small_tokenizer)
    prompt = small_tokenizer.decode(policy.encode_prompt(env.reset(3).messages, []))
    assert "Reasoning effort: high" in prompt
    specs = expert_specs()
    assert len(specs) == 9 and {s.effort for s in specs} == {"low", "high", "max"}
    assert [s.budget for s in specs[:3]] == [16, 48, 128]


def test_teacher_routing_by_domain_and_effort():
    specs = expert_specs(budgets=TINY_BUDGETS)
    teachers = {(s.domain, s.effort): torch.nn.Linear(1, 1) for s in specs}
    router = TeacherRouter(teachers)
    for spec in specs:
        episode = EffortEnv(spec).reset(7)
        assert router.route(episode) is teachers[(spec.domain, spec.effort)]
    partial = TeacherRouter({("arithmetic", "low"): torch.nn.Linear(1, 1)})
    with pytest.raises(KeyError):
        partial.route(EffortEnv(ExpertSpec("arithmetic", "max", 6)).reset(1))


# ---- end to end


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory, small_tokenizer):
    directory = tmp_path_factory.mktemp("sft")
    save_model(nano_model(), directory)
    small_tokenizer.save(directory / "tokenizer.json")
    return directory


def test_nine_experts_distill_and_report_through_the_cli(sft_dir, tmp_path, capsys, monkeypatch):
    # 9 matplotlib figures: slow
    monkeypatch.setattr("k2lab.agentic.rl.trainer.plot_metrics", lambda *args: None)
    experts, distill = tmp_path / "experts", tmp_path / "distill"
    common = ["--iterations", "1", "--group", "2", "--prompts", "1", "--updates", "1", "--budgets", "1,2,3"]
    cli("mopd", "experts", "--checkpoint", str(sft_dir), "--out", str(experts), *common)
    manifest = json.loads((experts / "experts.json").read_text())
    assert len(manifest["experts"]) == 9
    for spec in manifest["experts"]:
        key = f"{spec['domain']}-{spec['effort']}"
        assert (experts / key / "model" / "model.safetensors").is_file()
        assert (experts / key / "metrics.jsonl").is_file()
    capsys.readouterr()
    cli("mopd", "experts", "--checkpoint", str(sft_dir), "--out", str(experts), *common)
    assert capsys.readouterr().out.count("skipped") == 9
    cli("mopd", "distill", "--experts", str(experts), "--student", str(sft_dir), "--out", str(distill),
          "--steps", "1")  # fmt: skip
    lines = [json.loads(x) for x in (distill / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0] and all(x["mode"] == "mopd" for x in lines)
    assert len(lines[0]["per_cell"]) == 9 and lines[0]["trained_tokens"] > 0
    cli("mopd", "report", "--experts", str(experts), "--distill", str(distill), "--episodes", "1",
          "--baseline-steps", "1")  # fmt: skip
    report = json.loads((distill / "report" / "report.json").read_text())
    assert len(report["cells"]) == 9 and set(report["scores"]) == {"teacher", "student", "baseline", "start"}
    assert all(row["start"] is not None for row in report["cells"])
    assert all(isinstance(row["goal_met"], bool) for row in report["cells"])
    assert (distill / "report" / "report.png").stat().st_size > 0
    assert "| cell |" in (distill / "report" / "report.md").read_text()
    assert (distill / "baseline" / "model" / "model.safetensors").is_file()


def test_train_experts_subset_and_resume_skips(sft_dir, tmp_path):
    specs = [ExpertSpec("instruction", "low", 2)]
    config = RLConfig(iterations=1, group_size=2, groups_per_iteration=1, updates_per_iteration=1)
    logs: list[str] = []
    train_experts(sft_dir, tmp_path, config, specs, log=logs.append)
    train_experts(sft_dir, tmp_path, config, specs, log=logs.append)
    assert "RL" in logs[0] and logs[1].startswith(f"{specs[0].key}: iteration 1/1: mean reward ")
    assert logs[2].endswith("skipped")
    with pytest.raises(K2LabError, match="other domains or budgets"):
        train_experts(sft_dir, tmp_path, config, [ExpertSpec("instruction", "low", 3)])


def test_a_rerun_of_experts_with_other_settings_is_refused_before_the_manifest_is_written(sft_dir, tmp_path):
    """A rerun from another checkpoint, or with another learning rate or more iterations, reused the finished
    experts ("done, skipped") and rewrote experts.json to claim the new settings; now it is refused, naming
    the change, and the manifest is left as it was. Checkpointing may change (the experts are skipped)."""
    specs = [ExpertSpec("instruction", "low", 2)]
    config = RLConfig(iterations=1, group_size=2, groups_per_iteration=1, updates_per_iteration=1)
    out = tmp_path / "experts"
    train_experts(sft_dir, out, config, specs, log=lambda _: None)
    before = (out / "experts.json").read_text()
    assert json.loads(before)["checkpoint"] == str(sft_dir.resolve())
    other = tmp_path / "other-sft"
    shutil.copytree(sft_dir, other)
    changes = [
        (other, {}, "checkpoint: "),
        (
            sft_dir,
            {"optimizer": config.optimizer.model_copy(update={"lr": 0.5})},
            "optimizer.lr: 0.001 then, 0.5 now",
        ),
        (sft_dir, {"iterations": 5}, "iterations: 1 then, 5 now"),
    ]
    for checkpoint, update, fragment in changes:
        with pytest.raises(K2LabError, match=f"started with other settings \\({fragment}"):
            train_experts(checkpoint, out, config.model_copy(update=update), specs, log=lambda _: None)
        assert (out / "experts.json").read_text() == before
    logs: list[str] = []
    train_experts(sft_dir, out, config.model_copy(update={"keep_checkpoints": 5}), specs, log=logs.append)
    assert logs == [f"{specs[0].key}: done, skipped"]
    assert json.loads((out / "experts.json").read_text())["rl"]["keep_checkpoints"] == 5


@pytest.mark.parametrize("objective", ["sampled", "dense"])
def test_distillation_resumes_exactly(small_tokenizer, tmp_path, objective):
    specs = [ExpertSpec("arithmetic", "low", 3), ExpertSpec("instruction", "max", 5)]
    teachers = {(s.domain, s.effort): nano_model(seed=10 + i) for i, s in enumerate(specs)}
    config = MOPDConfig(steps=3, prompts_per_step=2, objective=objective)

    def trainer(out):
        return MOPDTrainer(nano_model(), small_tokenizer, TeacherRouter(teachers), specs, config, out)

    straight = trainer(tmp_path / "a")
    straight.run()
    interrupted = trainer(tmp_path / "b")
    interrupted.run(steps=1)
    resumed = trainer(tmp_path / "b")  # fresh weights: everything comes from the step-1 checkpoint
    assert resumed.step == 1
    resumed.run()

    def metrics(path):
        rows = [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in row.items() if k != "seconds"} for row in rows]

    assert metrics(tmp_path / "a") == metrics(tmp_path / "b")
    assert metrics(tmp_path / "a")[0]["trained_tokens"] > 0
    for name, value in straight.student.state_dict().items():
        assert torch.equal(value, resumed.student.state_dict()[name]), name


def test_resuming_with_another_objective_is_refused_and_loses_nothing(small_tokenizer, tmp_path):
    specs = [ExpertSpec("arithmetic", "low", 3)]
    teachers = {("arithmetic", "low"): nano_model(seed=10)}

    def trainer(**settings):
        config = MOPDConfig(prompts_per_step=1, **settings)
        return MOPDTrainer(nano_model(), small_tokenizer, TeacherRouter(teachers), specs, config, tmp_path)

    trainer(steps=1, objective="sampled").run()
    before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(K2LabError, match="objective: 'sampled' then, 'dense' now"):
        trainer(steps=2, objective="dense")
    assert (tmp_path / "metrics.jsonl").read_text() == before
    assert trainer(steps=2, objective="sampled").step == 1  # a longer run of the same settings resumes


def test_resuming_distillation_from_another_student_or_experts_is_refused(sft_dir, small_tokenizer, tmp_path):
    """A resumed run ignored a changed --experts (later steps distilled from other teachers) or --student (the
    checkpoint's weights were used) while mopd.json claimed the new inputs; now either change is refused,
    naming it, and mopd.json is left as it was."""
    specs = [ExpertSpec("arithmetic", "low", 3)]
    experts, others = tmp_path / "experts", tmp_path / "others"
    write_experts(experts, small_tokenizer, specs)
    write_experts(others, small_tokenizer, specs)
    student = tmp_path / "student"
    shutil.copytree(sft_dir, student)
    out, config = tmp_path / "run", MOPDConfig(steps=1, prompts_per_step=1)
    run_mopd(experts, sft_dir, out, config)
    before = (out / "mopd.json").read_text()
    longer = config.model_copy(update={"steps": 2})
    with pytest.raises(K2LabError, match=f"experts: '{experts}' then, '{others}' now"):
        run_mopd(others, sft_dir, out, longer)
    shutil.rmtree(out / "model")
    with pytest.raises(K2LabError, match=f"student: '{sft_dir}' then, '{student}' now"):
        run_mopd(experts, student, out, config)
    assert (out / "mopd.json").read_text() == before
    assert len(run_mopd(experts, sft_dir, out, longer)) == 1  # the same inputs resume


@pytest.mark.parametrize("marked", [True, False])
def test_a_train_run_as_the_out_of_distill_or_rl_is_refused_untouched(
    sft_dir, small_tokenizer, tmp_path, marked
):
    """``mopd distill --out`` a ``k2lab train`` run dropped its last metrics line (the train checkpoint's step
    taken for its own) and wrote mopd.json there; ``rl --out`` it failed with a KeyError traceback. Now both
    are refused: by run.json's command, or (a run from before run.json) by the checkpoint's kind."""
    specs = [ExpertSpec("arithmetic", "low", 3)]
    experts, run = tmp_path / "experts", tmp_path / "train-run"
    write_experts(experts, small_tokenizer, specs)
    claim_run_directory(run, "train")
    save_training_checkpoint(run, 6, {"step": 6, "train_config": {"steps": 6}, "rng": capture_rng_state()})
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 7)))
    if not marked:
        (run / "run.json").unlink()
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    refusal = "`k2lab train` run; .* pick a new --out" if marked else "is a `k2lab train`/`sft` run's"
    with pytest.raises(K2LabError, match=refusal):
        run_mopd(experts, sft_dir, run, MOPDConfig(steps=8, prompts_per_step=1))
    with pytest.raises(K2LabError, match=refusal):
        run_rl(sft_dir, run, RLConfig(iterations=8))
    assert {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_teachers_of_another_tokenizer_or_vocabulary_are_refused_before_any_work(
    sft_dir, small_tokenizer, tmp_path
):
    """A student of another tokenizer than its teachers failed with a tensor-size traceback (dense) or
    trained on ids that mean other text to the teachers (sampled, exit 0); now a one-line error, before
    the run directory is made (tokenizer) or any step runs (vocabulary)."""
    from k2lab.data.corpus import load_corpus
    from k2lab.data.tokenizer import train_tokenizer

    specs = [ExpertSpec("arithmetic", "low", 3)]
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "d.txt").write_text("an entirely different corpus of words, 12 + 30 = 42 " * 30)
    other = train_tokenizer(load_corpus(str(tmp_path / "corpus")), vocab_size=290, use_cache=False)
    write_experts(tmp_path / "foreign", other, specs)
    for objective in ("dense", "sampled"):
        config = MOPDConfig(steps=1, prompts_per_step=1, objective=objective)
        with pytest.raises(K2LabError, match="have different tokenizers"):
            run_mopd(tmp_path / "foreign", sft_dir, tmp_path / "out", config)
        assert not (tmp_path / "out").exists()
    wide = tmp_path / "wide"
    write_experts(wide, small_tokenizer, specs)
    model = build_model(load_preset("k2-nano", vocab_size=320, max_position_embeddings=2048))
    save_model(randomize(model, seed=1), wide / specs[0].key / "model")
    small_tokenizer.save(wide / specs[0].key / "model" / "tokenizer.json")
    with pytest.raises(K2LabError, match="vocabulary of 300 tokens, the teacher .* one of 320"):
        run_mopd(wide, sft_dir, tmp_path / "out", MOPDConfig(steps=1, prompts_per_step=1))
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_a_distillation_that_trains_nothing_is_an_error_naming_the_cause(small_tokenizer, tmp_path):
    """A student whose context every prompt overflows logged "loss None ... tokens 0" each step and exited 0
    with its starting weights saved as the distilled model; now a one-line error naming the failures, and no
    model is saved (a rerun says the same)."""
    specs = [ExpertSpec("arithmetic", "low", 3)]
    write_experts(tmp_path / "experts", small_tokenizer, specs)
    short = build_model(load_preset("k2-nano", vocab_size=300, max_position_embeddings=16))
    save_model(randomize(short, seed=0), tmp_path / "student")
    small_tokenizer.save(tmp_path / "student" / "tokenizer.json")
    out, config = tmp_path / "run", MOPDConfig(steps=2, prompts_per_step=2)
    for _ in range(2):
        with pytest.raises(
            K2LabError, match=r"nothing trained in 2 steps: .*\(failures: context overflow 4\)"
        ):
            run_mopd(tmp_path / "experts", tmp_path / "student", out, config)
        assert not (out / "model").exists()


def test_dense_and_sampled_steps_play_the_same_first_step(small_tokenizer, tmp_path):
    """Both objectives sample step 0 from the same student with the same seeds: the same trained tokens
    (positions, not positions × vocabulary), and the dense loss is the exact KL the sampled one estimates."""
    specs = [ExpertSpec("arithmetic", "low", 3), ExpertSpec("instruction", "max", 5)]
    teachers = {(s.domain, s.effort): nano_model(seed=10 + i) for i, s in enumerate(specs)}
    first = {}
    for objective in ("sampled", "dense"):
        config = MOPDConfig(steps=1, prompts_per_step=2, objective=objective)
        trainer = MOPDTrainer(
            nano_model(), small_tokenizer, TeacherRouter(teachers), specs, config, tmp_path / objective
        )
        first[objective] = trainer.train_step()
    assert first["dense"]["trained_tokens"] == first["sampled"]["trained_tokens"] > 0
    assert first["dense"]["mean_reward"] == first["sampled"]["mean_reward"]
    assert first["dense"]["reverse_kl"] == first["dense"]["loss"] > 0


def test_an_unknown_objective_is_refused_before_anything_loads(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["mopd", "distill", "--experts", str(tmp_path / "none"), "--student", str(tmp_path / "none"),
              "--out", str(tmp_path / "out"), "--objective", "topk"])  # fmt: skip
    assert exit_info.value.code == 2
    assert "objective" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def write_experts(directory: Path, tokenizer, specs) -> None:
    """An experts directory as ``k2lab mopd experts`` leaves it: the manifest and one policy per cell (here
    distinct random nano models, so every cell has its own teacher)."""
    for i, spec in enumerate(specs):
        save_model(nano_model(seed=20 + i), directory / spec.key / "model")
        tokenizer.save(directory / spec.key / "model" / "tokenizer.json")
    manifest = {"checkpoint": "random", "experts": [vars(s) for s in specs], "rl": {}}
    (directory / "experts.json").write_text(json.dumps(manifest))


DISTILL_SCRIPT = """
import os, signal, sys
import torch
from k2lab.agentic.distill import mopd
from k2lab.cli import main
torch.set_num_threads(1)
original = mopd.MOPDTrainer.run
def run(self, steps=None, on_step=None):
    def kill(metrics):
        if metrics["step"] == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # after step 1's checkpoint, before step 2
    return original(self, steps, kill)
if sys.argv[1] == "kill":
    mopd.MOPDTrainer.run = run
main(sys.argv[2:])
"""


def test_sigkilled_distillation_resumes_to_the_uninterrupted_run(sft_dir, small_tokenizer, tmp_path):
    specs = [ExpertSpec("arithmetic", "low", 3), ExpertSpec("instruction", "high", 4)]
    experts = tmp_path / "experts"
    write_experts(experts, small_tokenizer, specs)
    killed = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3] / "src")}

    def distill(mode: str, out: Path) -> int:  # every run in a fresh process with the same thread count
        args = ["mopd", "distill", "--experts", experts, "--student", sft_dir, "--steps", 3, "--prompts", 2]
        command = [sys.executable, "-c", DISTILL_SCRIPT, mode, *map(str, args), "--out", str(out)]
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode in (0, -signal.SIGKILL), result.stderr[-2000:]
        return result.returncode

    assert distill("run", tmp_path / "straight") == 0
    assert distill("kill", killed) == -signal.SIGKILL
    assert not (killed / "model").exists()

    def metrics(path):
        rows = [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in row.items() if k != "seconds"} for row in rows]

    assert metrics(killed) == metrics(tmp_path / "straight")[:2]
    assert distill("run", killed) == 0
    assert metrics(killed) == metrics(tmp_path / "straight")
    assert sum(m["trained_tokens"] for m in metrics(killed)) > 0
    resumed, straight = load_model(killed / "model"), load_model(tmp_path / "straight" / "model")
    for (name, a), (_, b) in zip(resumed.state_dict().items(), straight.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_report_refuses_bad_inputs_in_one_line_before_any_work(sft_dir, small_tokenizer, tmp_path, capsys):
    """mopd report: a negative or NaN temperature reported every goal met (NaN wrote invalid JSON); a
    directory without mopd.json, a corrupt one, or --out naming a file were tracebacks; an unfinished
    distillation trained the baseline, then failed; other experts than the run's and a finished baseline
    of other steps were used in silence. Each is now a one-line error, before a baseline or report is made."""
    specs = [ExpertSpec("arithmetic", "low", 3)]
    experts, distill = tmp_path / "experts", tmp_path / "distill"
    write_experts(experts, small_tokenizer, specs)
    distill.mkdir()
    config = MOPDConfig(steps=2).model_dump(mode="json")
    record = {"experts": str(experts), "student": str(sft_dir), "mode": "mopd", "config": config}

    def report(*extra, with_experts=experts) -> str:
        with pytest.raises(SystemExit) as exit_info:
            main(["mopd", "report", "--experts", str(with_experts), "--distill", str(distill),
                  *map(str, extra)])  # fmt: skip
        err = " ".join(capsys.readouterr().err.split())
        assert exit_info.value.code == 2 and "Traceback" not in err
        return err

    assert "has no mopd.json" in report()
    (distill / "mopd.json").write_text("{not json")
    assert "mopd.json is not valid JSON" in report()
    (distill / "mopd.json").write_text(json.dumps(record))
    assert "has not finished (no model/)" in report()
    shutil.copytree(sft_dir, distill / "model")
    for value in ("-1", "nan", "inf"):
        assert "--temperature must be >= 0 and finite" in report("--temperature", value)
    assert "report with the experts the run used" in report(with_experts=tmp_path / "others")
    (tmp_path / "file").write_text("mine")
    assert "exists and is not a directory" in report("--out", tmp_path / "file")
    baseline = distill / "baseline"
    shutil.copytree(sft_dir, baseline / "model")
    one_step = MOPDConfig(steps=1).model_dump(mode="json")
    (baseline / "mopd.json").write_text(json.dumps(record | {"mode": "sft", "config": one_step}))
    assert "was trained for 1 steps, not 2" in report()
    assert "was trained for 1 steps, not 3" in report("--baseline-steps", 3)
    assert not (distill / "report").exists() and (tmp_path / "file").read_text() == "mine"
    assert not (baseline / "checkpoints").exists()


def test_greedy_cell_evaluation_is_batched_yet_equals_one_at_a_time(small_tokenizer):
    from k2lab.agentic.distill.mopd import evaluate_cells, trainable_turns
    from k2lab.agentic.episodes.rollout import run_episode
    from k2lab.posttrain.scoring import turn_logprobs
    from k2lab.train.persistence import derive_seed

    specs = [ExpertSpec("arithmetic", "low", 3), ExpertSpec("instruction", "max", 6)]
    teachers = {(s.domain, s.effort): nano_model(seed=30 + i) for i, s in enumerate(specs)}
    router, model = TeacherRouter(teachers), nano_model(seed=3).eval()
    batched = evaluate_cells(model, small_tokenizer, router, specs, episodes=3, seed=5, batch_size=2)
    for spec in specs:
        policy = LocalPolicy(model, small_tokenizer, 0.0, spec.max_new_tokens)
        rollouts = [
            run_episode(EffortEnv(spec), policy, derive_seed(5, "heldout", spec.key, i)) for i in range(3)
        ]
        tokens = [r.episode.completion_tokens for r in rollouts]
        assert batched[spec.key]["tokens"] == pytest.approx(sum(tokens) / 3)
        assert batched[spec.key]["score"] == pytest.approx(sum(r.episode.reward or 0 for r in rollouts) / 3)
        with torch.no_grad():
            turns = [t for r in rollouts for t in trainable_turns(r)]
            gap = torch.cat(turn_logprobs(model, turns)) - torch.cat(
                turn_logprobs(router.route(rollouts[0].episode), turns)
            )
        assert batched[spec.key]["kl"] == pytest.approx(float(gap.mean()), abs=1e-4)


@pytest.mark.parametrize("mode", ["mopd", "sft"])
def test_a_step_plays_its_prompts_together_as_each_would_alone(small_tokenizer, tmp_path, mode):
    from k2lab.agentic.episodes.rollout import run_episode
    from k2lab.train.persistence import derive_seed

    specs = [
        ExpertSpec("arithmetic", "low", 3),
        ExpertSpec("instruction", "low", 3),
        ExpertSpec("arithmetic", "max", 5),
    ]
    teachers = {(s.domain, s.effort): nano_model(seed=40 + i) for i, s in enumerate(specs)}
    config = MOPDConfig(prompts_per_step=6, seed=3)
    trainer = MOPDTrainer(
        nano_model(), small_tokenizer, TeacherRouter(teachers), specs, config, tmp_path, mode
    )
    played = trainer._sample_step(2)
    assert [spec for spec, _, _ in played] == [trainer.cell(2, i) for i in range(6)]
    for index, (spec, rollout, teacher) in enumerate(played):
        assert teacher is teachers[(spec.domain, spec.effort)]
        sampler = trainer.student if mode == "mopd" else teacher
        policy = LocalPolicy(sampler, small_tokenizer, config.temperature, spec.max_new_tokens)
        task, sample = derive_seed(3, "mopd-task", 2, index), derive_seed(3, "s", 2, index)
        alone = run_episode(EffortEnv(spec), policy, task, sample_seed=sample)
        assert [t.completion_ids for t in rollout.turns] == [t.completion_ids for t in alone.turns]
        assert rollout.episode.reward == alone.episode.reward
        assert rollout.episode.env == spec.key


def test_teacher_logprobs_scores_each_turn_with_its_own_model(small_tokenizer):
    from k2lab.agentic.distill.mopd import teacher_logprobs, trainable_turns
    from k2lab.agentic.episodes.rollout import run_episode
    from k2lab.posttrain.scoring import turn_logprobs

    spec = ExpertSpec("arithmetic", "max", 6)
    models = [nano_model(seed=50), nano_model(seed=51)]
    policy = LocalPolicy(nano_model(seed=52), small_tokenizer, 1.0, spec.max_new_tokens)
    turns = [t for seed in range(4) for t in trainable_turns(run_episode(EffortEnv(spec), policy, seed))]
    pairs = [(turn, models[i % 2]) for i, turn in enumerate(turns)]
    scored = teacher_logprobs(pairs, batch=3)
    assert len(scored) == len(pairs) > 2
    for (turn, model), logp in zip(pairs, scored, strict=True):
        with torch.no_grad():
            alone = turn_logprobs(model, [turn])[0]
        assert torch.allclose(logp, alone, atol=1e-5)
        assert not logp.requires_grad
    generator = torch.Generator().manual_seed(0)
    masks = [torch.rand(len(t.completion_ids), 300, generator=generator) < 0.5 for t in turns]
    for mask, turn in zip(masks, turns, strict=True):
        mask[torch.arange(len(turn.completion_ids)), torch.tensor(turn.completion_ids)] = True
    masks[0] = None
    restricted = teacher_logprobs(pairs, batch=3, allowed=masks)
    for (turn, model), mask, logp in zip(pairs, masks, restricted, strict=True):
        with torch.no_grad():
            alone = turn_logprobs(model, [turn], 1, [mask])[0]
        assert torch.allclose(logp, alone, atol=1e-5)


@pytest.mark.parametrize(
    ("domains", "budgets", "fragment"),
    [
        (["arithmetic"], {"low": -1, "high": 0, "max": 5}, "must be positive"),
        (["arithmetic"], {"low": 8, "high": 6, "max": 4}, "must increase with the effort"),
        (["arithmetic"], {"low": 8, "high": 8, "max": 9}, "must increase with the effort"),
        (["arithmetic", "foo"], None, "unknown environment 'foo'"),
        ([], None, "no domains"),
        (["coding", "coding"], None, "named twice"),
    ],
)
def test_expert_specs_are_checked_before_any_expert_trains(domains, budgets, fragment):
    """Budgets low < high < max > 0, known and distinct domains: an unknown domain failed only when its
    expert's turn came, after the earlier experts had trained; no domains ran nothing (or all defaults)."""
    with pytest.raises(ValueError, match=fragment):
        expert_specs(domains, budgets)


def test_a_corrupt_experts_manifest_is_a_one_line_error_naming_it(tmp_path, capsys):
    (tmp_path / "experts.json").write_text("{not json")
    with pytest.raises(K2LabError, match="experts.json is not valid JSON"):
        load_manifest(tmp_path)
    (tmp_path / "experts.json").write_text('{"experts": [1]}')
    with pytest.raises(K2LabError, match="experts.json is not an experts manifest"):
        load_manifest(tmp_path)
    (tmp_path / "experts.json").write_text("{not json")
    with pytest.raises(SystemExit) as exit_info:
        main(["mopd", "distill", "--experts", str(tmp_path), "--student", str(tmp_path),
              "--out", str(tmp_path / "out"), "--steps", "1"])  # fmt: skip
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "experts.json is not valid JSON" in " ".join(err.split()) and "Traceback" not in err


def test_an_infinite_student_temperature_is_refused():
    from k2lab.agentic.distill.mopd import MOPDConfig

    with pytest.raises(ValueError, match="finite number"):
        MOPDConfig(temperature=float("inf"))
