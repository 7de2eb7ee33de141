"""`k2lab recipe agentic-mini`: the batched evaluator, the Wilson interval, a tiny end-to-end run, reuse."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from k2lab import build_model, load_preset
from k2lab.agentic.episodes.evaluate import (
    episode_summary,
    evaluate_policy,
    paired_comparison,
    play_greedy,
    wilson_interval,
)
from k2lab.agentic.episodes.rollout import LocalPolicy, run_episode
from k2lab.agentic.recipe.mini import (
    RecipeConfig,
    RecipeToolTasks,
    eval_seeds,
    no_tool_eval_seeds,
    run_recipe,
)
from k2lab.errors import CheckpointError
from k2lab.model_dir import save_model
from tests.conftest import randomize


def biased_nano(tokenizer) -> torch.nn.Module:
    """A random k2-nano whose <|im_end|> logit is boosted, so greedy turns end early (a wrong answer, a
    malformed reply) or run out of tokens: a mix of outcomes for the evaluator to reproduce."""
    model = randomize(build_model(load_preset("k2-nano", vocab_size=300, max_position_embeddings=8192)))
    with torch.no_grad():
        model.lm_head.weight[tokenizer.special_tokens["<|im_end|>"]] *= 3.0
    return model


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, small_tokenizer):
    directory = tmp_path_factory.mktemp("base")
    save_model(biased_nano(small_tokenizer), directory)
    small_tokenizer.save(directory / "tokenizer.json")
    return directory


# ---- statistics


def test_wilson_interval_hand_computed():
    # 8/10, z = 1.96: centre (0.8 + z²/20) / (1 + z²/10) = 0.71674, half-width 0.22658
    low, high = wilson_interval(8, 10)
    assert low == pytest.approx(0.49016, abs=1e-4)
    assert high == pytest.approx(0.94332, abs=1e-4)
    # 0/20: [0, z² / (n + z²)]
    assert wilson_interval(0, 20) == pytest.approx((0.0, 3.84146 / 23.84146), abs=1e-4)
    # 5/10 is symmetric around 0.5
    low, high = wilson_interval(5, 10)
    assert 0.5 - low == pytest.approx(high - 0.5) and low == pytest.approx(0.23659, abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_paired_comparison_hand_computed():
    def rows(successes):
        return [{"seed": i, "success": ok} for i, ok in enumerate(successes)]

    # 8 tasks only the later model solves, 2 only the earlier, 5 both, 5 neither: discordant n = 10,
    # p = 2 · (C(10,0) + C(10,1) + C(10,2)) / 2^10 = 2 · 56 / 1024
    before = rows([False] * 8 + [True] * 2 + [True] * 5 + [False] * 5)
    after = rows([True] * 8 + [False] * 2 + [True] * 5 + [False] * 5)
    pair = paired_comparison(before, after)
    assert (pair["only_after"], pair["only_before"], pair["tasks"]) == (8, 2, 20)
    assert pair["p_value"] == pytest.approx(0.109375)
    assert paired_comparison(after, after)["p_value"] == 1.0  # no discordant task
    assert paired_comparison(rows([True] * 6), rows([False] * 6))["p_value"] == pytest.approx(2 / 64)
    with pytest.raises(ValueError, match="same task seeds"):
        paired_comparison(before, after[:-1])


# ---- the batched evaluator


def test_batched_evaluation_matches_one_at_a_time(small_tokenizer):
    model = biased_nano(small_tokenizer).eval()
    env = RecipeToolTasks(RecipeConfig(max_turns=4), no_tool_fraction=0.3)
    seeds = list(range(6))
    batched = [
        r.episode for r in play_greedy(model, small_tokenizer, env, seeds, batch_size=4, max_new_tokens=16)
    ]
    policy = LocalPolicy(model, small_tokenizer, temperature=0.0, max_new_tokens=16)
    single = [run_episode(env, policy, seed).episode for seed in seeds]
    assert [episode_summary(e) for e in batched] == [episode_summary(e) for e in single]
    assert [e.messages for e in batched] == [e.messages for e in single]
    assert len({episode_summary(e)["reason"] for e in single}) > 1  # a real mix of outcomes


def test_evaluate_policy_report(small_tokenizer):
    model = biased_nano(small_tokenizer).eval()
    env = RecipeToolTasks(RecipeConfig(max_turns=2, no_tool_budget=8), no_tool_fraction=0.5)
    report = evaluate_policy(model, small_tokenizer, env, range(8), batch_size=8, max_new_tokens=8)
    assert report["tasks"] == 8 and len(report["episodes"]) == 8
    assert report["ci95"] == pytest.approx(list(wilson_interval(report["successes"], 8)))
    assert report["no_tool_tasks"] == sum(not e["needs_tools"] for e in report["episodes"])
    assert sum(d["tasks"] for d in report["domains"].values()) == 8
    assert 0 < report["tokens_per_task"] <= 8 * 2


def test_recipe_env_caps_turns_and_budgets_no_tool_tasks():
    env = RecipeToolTasks(RecipeConfig(max_turns=3, no_tool_budget=11), no_tool_fraction=1.0)
    episode = env.reset(1)
    assert not episode.needs_tools and episode.token_budget == 11 and episode.max_turns <= 3
    with pytest.raises(ValueError):
        eval_seeds(RecipeConfig(eval_seed=0, factory_seed=0))
    assert env.credit == "progress" and RecipeToolTasks(RecipeConfig(credit="checks")).credit == "checks"


def test_an_unknown_credit_is_refused_before_any_stage(tmp_path, capsys):
    from k2lab.cli import main

    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        main(["recipe", "agentic-mini", "--out", str(out), "--credit", "vibes"])
    assert exit_.value.code != 0
    assert "credit must be one of checks, progress" in capsys.readouterr().err.replace("\n", " ")
    assert not out.exists()


def test_an_out_that_is_a_file_is_refused_in_one_line(tmp_path, capsys):
    from k2lab.cli import main

    (tmp_path / "taken").write_text("notes")
    with pytest.raises(SystemExit) as exit_:  # was: FileExistsError with a 16-frame traceback
        main(["recipe", "agentic-mini", "--out", str(tmp_path / "taken")])
    assert exit_.value.code == 2 and "exists and is not a directory" in capsys.readouterr().err
    assert (tmp_path / "taken").read_text() == "notes"


def test_reward_flags_reach_the_recipe_and_out_of_range_is_refused(tmp_path, monkeypatch):
    import k2lab.agentic.recipe.mini as recipe
    from k2lab.cli import main

    seen: list[RecipeConfig] = []
    monkeypatch.setattr(recipe, "run_recipe", lambda config, log: seen.append(config) or {})
    monkeypatch.setattr(recipe, "print_report", lambda report, console: None)
    command = ["recipe", "agentic-mini", "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--partial-credit", "0", "--rl-no-tool-fraction", "0.3"])
    assert exit_.value.code == 0
    assert (seen[0].partial_credit, seen[0].rl_no_tool_fraction) == (0.0, 0.3)
    assert RecipeConfig().partial_credit == 0.5 and RecipeConfig().rl_no_tool_fraction == 0.6
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--partial-credit", "1.5"])
    assert exit_.value.code == 2 and len(seen) == 1


def test_no_tool_probe_seeds_are_held_out_no_tool_tasks():
    config = RecipeConfig(eval_n=200, no_tool_eval_n=30)
    probe = no_tool_eval_seeds(config)
    assert len(probe) == 30 and not set(probe) & set(eval_seeds(config))
    env = RecipeToolTasks(config, no_tool_fraction=1.0)
    assert all(not env.reset(seed).needs_tools for seed in probe[:5])
    with pytest.raises(ValueError, match="eval_n"):
        no_tool_eval_seeds(RecipeConfig(eval_n=600_000))


# ---- end to end


TINY = {
    "factory_n": 12,
    "sft_steps": 2,
    "sft_batch_size": 1,
    "sft_seq_len": 3072,
    "rl_iterations": 1,
    "rl_groups": 1,
    "rl_group_size": 2,
    "max_new_tokens": 8,
    "max_turns": 2,
    "eval_n": 20,
    "no_tool_eval_n": 6,
    "eval_batch_size": 10,
}


def tiny_config(out, base, **changes) -> RecipeConfig:
    return RecipeConfig(out=out, base=base, **(TINY | changes))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, base_dir):
    out = tmp_path_factory.mktemp("recipe") / "run"
    messages: list[str] = []
    report = run_recipe(tiny_config(out, base_dir), log=messages.append)
    return out, report, messages


def test_tiny_end_to_end_run_writes_every_output(tiny_run):
    out, report, messages = tiny_run
    for name in (
        "report.json",
        "report.md",
        "agentic_mini.png",
        "rl/metrics.jsonl",
        "sft/model/tokenizer.json",
    ):
        assert (out / name).is_file(), name
    assert not any("reused" in line for line in messages)
    assert set(report["evaluation"]) == {"base", "sft", "rl"}
    assert all(r["tasks"] == 20 for r in report["evaluation"].values())
    assert all(r["no_tool_probe"]["tasks"] == 6 for r in report["evaluation"].values())
    assert set(report["paired"]) == {"sft_vs_base", "rl_vs_sft", "rl_vs_sft_no_tool_call"}
    assert report["paired"]["sft_vs_base"]["tasks"] == report["paired"]["rl_vs_sft"]["tasks"] == 20
    assert set(report["seconds"]) == {"base", "factory", "sft", "rl", "eval"}
    assert set(report["acceptance"]) == {"sft_above_base", "rl_above_sft", "rl_fewer_no_tool_calls_than_sft"}
    assert report["paired"]["rl_vs_sft_no_tool_call"]["tasks"] == 6
    assert all("quiet" not in r["no_tool_probe"] for r in report["evaluation"].values())
    text = (out / "report.md").read_text()
    assert "success [95% Wilson CI]" in text and "| rl |" in text and "| rl_vs_sft |" in text
    assert "| rl_vs_sft_no_tool_call |" in text
    assert json.loads((out / "report.json").read_text())["evaluation"]["rl"]["tasks"] == 20


def test_second_invocation_reuses_every_stage(tiny_run, base_dir):
    out, report, _ = tiny_run
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("*/done.json")}
    assert len(stamps) == 5
    again: list[str] = []
    second = run_recipe(tiny_config(out, base_dir), log=again.append)
    assert sum("reused" in line for line in again) == 5
    assert all(second["stages"][name]["reused"] for name in ("base", "factory", "sft", "rl", "eval"))
    assert {p: p.stat().st_mtime_ns for p in out.glob("*/done.json")} == stamps
    assert second["evaluation"] == report["evaluation"]


def test_cli_resumes_a_finished_run(tiny_run, base_dir, capsys):
    from k2lab.cli import main

    out, _, _ = tiny_run
    args = ["recipe", "agentic-mini", "--out", str(out), "--base", str(base_dir)]
    args += [item for key, value in TINY.items() for item in ("--set", f"{key}={value}")]
    try:
        main(args)
    except SystemExit as exit_:
        assert exit_.code in (0, None)
    printed = capsys.readouterr().out
    assert "reused" in printed and "agentic-mini" in printed and "tokens/task" in printed


def test_a_rerun_with_other_settings_is_refused_before_any_stage_reruns(tiny_run, base_dir):
    out, _, _ = tiny_run
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    # the factory stage (and so every later one) was made with factory_n = 12
    with pytest.raises(CheckpointError, match=r"factory_n: 12 then, 30 now"):
        run_recipe(tiny_config(out, base_dir, factory_n=30), log=lambda line: None)
    with pytest.raises(CheckpointError, match=r"eval_n: 20 then, 21 now"):
        run_recipe(tiny_config(out, base_dir, eval_n=21), log=lambda line: None)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == stamps
    assert json.loads((out / "stages.json").read_text())["eval"]["eval_n"] == 20


def test_a_stage_killed_after_its_training_finished_is_completed_from_its_results(
    tiny_run, base_dir, tmp_path, monkeypatch
):
    source, report, _ = tiny_run
    out = tmp_path / "run"
    shutil.copytree(source, out)
    for stage in ("sft", "rl", "eval"):  # killed after SFT wrote model/ and summary.json, before done.json
        (out / stage / "done.json").unlink()
    lines: list[str] = []
    second = run_recipe(tiny_config(out, base_dir), log=lines.append)  # was: "... is already complete"
    assert "[sft] running" in lines and "[rl] running" in lines
    assert json.loads((out / "sft" / "done.json").read_text())["val_loss"] == pytest.approx(
        json.loads((source / "sft" / "done.json").read_text())["val_loss"]
    )
    assert second["stages"]["rl"]["last_mean_reward"] == report["stages"]["rl"]["last_mean_reward"]
    assert second["evaluation"] == report["evaluation"]


def test_acceptance_needs_a_significant_paired_gain_not_a_higher_point_estimate():
    from k2lab.agentic.recipe.mini import acceptance

    def evaluation(success: float, calls: float) -> dict:
        return {"success": success, "no_tool_probe": {"tool_calls": calls}}

    evaluations = {"base": evaluation(0.0, 0.0), "sft": evaluation(0.225, 0.15), "rl": evaluation(0.24, 0.13)}
    paired = {
        "sft_vs_base": {"only_after": 45, "only_before": 0, "p_value": 5.7e-14},
        "rl_vs_sft": {"only_after": 6, "only_before": 3, "p_value": 0.51},  # higher, but within noise
    }
    assert acceptance(evaluations, paired) == {
        "sft_above_base": True,
        "rl_above_sft": False,
        "rl_fewer_no_tool_calls_than_sft": True,
    }
    paired["rl_vs_sft"] = {"only_after": 3, "only_before": 15, "p_value": 0.008}  # significant, the wrong way
    assert acceptance(evaluations, paired)["rl_above_sft"] is False
    paired["rl_vs_sft"] = {"only_after": 15, "only_before": 3, "p_value": 0.008}
    assert acceptance(evaluations, paired)["rl_above_sft"] is True
    # with the probe's pairs, fewer calls per task is not enough either
    paired["rl_vs_sft_no_tool_call"] = {"only_after": 11, "only_before": 6, "p_value": 0.33}
    assert acceptance(evaluations, paired)["rl_fewer_no_tool_calls_than_sft"] is False
    paired["rl_vs_sft_no_tool_call"] = {"only_after": 7, "only_before": 0, "p_value": 0.016}
    assert acceptance(evaluations, paired)["rl_fewer_no_tool_calls_than_sft"] is True
