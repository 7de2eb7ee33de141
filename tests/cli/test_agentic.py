"""The agentic commands build the config they run from named options (the config's names and the older
spellings), a TOML recipe and ``--set`` overrides; nothing is trained here (the runners are replaced)."""

from pathlib import Path

import pytest

from k2lab.agentic.distill.mopd import MOPDConfig
from k2lab.agentic.factory.pipeline import FactoryConfig
from k2lab.agentic.recipe import mini as recipe_mini
from k2lab.agentic.rl.trainer import RLConfig
from k2lab.cli import agentic, main


def run(args: list) -> int:
    """Exit code of ``k2lab ARGS`` in this process."""
    with pytest.raises(SystemExit) as exit_info:
        main([str(arg) for arg in args])
    return exit_info.value.code or 0


def test_rl_takes_the_config_names_the_old_spellings_a_recipe_and_set(tmp_path, monkeypatch):
    seen: list[RLConfig] = []
    monkeypatch.setattr(agentic, "run_rl", lambda checkpoint, out, config, **_: seen.append(config) or [])
    base = ["rl", "-c", tmp_path, "--out", tmp_path / "run"]
    assert run(base) == 0 and seen[-1] == RLConfig()
    old = ["--group", 3, "--prompts", 5, "--updates", 1, "--temperature", 0.7, "--lr", 0.01]
    assert run([*base, *old, "--envs", "arithmetic, coding", "--env-weights", "1,3"]) == 0
    config = seen[-1]
    assert (config.group_size, config.groups_per_iteration, config.updates_per_iteration) == (3, 5, 1)
    assert (config.temperature_start, config.optimizer.lr) == (0.7, 0.01)
    assert config.envs == ["arithmetic", "coding"] and config.env_weights == [1.0, 3.0]
    assert run([*base, "--group-size", 6, "--groups-per-iteration", 2, "--updates-per-iteration", 3]) == 0
    assert (seen[-1].group_size, seen[-1].groups_per_iteration, seen[-1].updates_per_iteration) == (6, 2, 3)
    recipe = tmp_path / "rl.toml"
    recipe.write_text("tau = 0.25\ngroup_size = 8\n[optimizer]\nlr = 0.002\n")
    assert run([*base, "--recipe", recipe, "--set", "group_size=5"]) == 0
    assert (seen[-1].tau, seen[-1].group_size, seen[-1].optimizer.lr) == (0.25, 5, 0.002)
    assert run([*base, "--group", 1]) == 2 and len(seen) == 4  # K ≥ 2: refused before the run


def test_mopd_experts_keep_two_checkpoints_unless_told_otherwise(tmp_path, monkeypatch):
    seen: list = []
    monkeypatch.setattr(
        agentic, "train_experts", lambda checkpoint, out, config, specs, log: seen.append((config, specs))
    )
    base = ["mopd", "experts", "-c", tmp_path, "--out", tmp_path / "x", "--domains", "arithmetic"]
    assert run([*base, "--budgets", "1,2,3", "--group", 2, "--prompts", 1]) == 0
    config, specs = seen[-1]
    assert config == RLConfig(keep_checkpoints=2, group_size=2, groups_per_iteration=1)
    assert [(s.domain, s.effort, s.budget) for s in specs] == [
        ("arithmetic", "low", 1),
        ("arithmetic", "high", 2),
        ("arithmetic", "max", 3),
    ]
    recipe = tmp_path / "experts.toml"
    recipe.write_text("keep_checkpoints = 4\n")
    assert run([*base, "--recipe", recipe]) == 0 and seen[-1][0].keep_checkpoints == 4
    assert (
        run([*base, "--recipe", recipe, "--keep-checkpoints", 1]) == 0 and seen[-1][0].keep_checkpoints == 1
    )
    assert [s.budget for s in seen[-1][1]] == [16, 48, 128]


def test_mopd_experts_refuse_bad_budgets_and_domains_before_training(tmp_path, monkeypatch, capsys):
    """--budgets a,b,c was a ValueError traceback, -1,0,5 and 8,6,4 were accepted, --domains foo failed after
    earlier experts had trained and --domains , trained all defaults: each is now one line, nothing trained."""
    monkeypatch.setattr(agentic, "train_experts", lambda *args, **kwargs: pytest.fail("trained"))
    base = ["mopd", "experts", "-c", tmp_path, "--out", tmp_path / "x"]
    for args, fragment in [
        (["--budgets", "a,b,c"], "--budgets needs 3 comma-separated whole token budgets"),
        (["--budgets", "-1,0,5"], "must be positive"),
        (["--budgets", "8,6,4"], "must increase with the effort, low < high < max"),
        (["--domains", "arithmetic,foo"], "unknown environment 'foo'"),
        (["--domains", ","], "no domains"),
    ]:
        assert run([*base, *args]) == 2
        err = capsys.readouterr().err
        assert fragment in " ".join(err.split()) and "Traceback" not in err


def test_mopd_distill_prompts_alias_and_objective(tmp_path, monkeypatch):
    seen: list[MOPDConfig] = []
    monkeypatch.setattr(
        agentic, "run_mopd", lambda experts, student, out, config, on_step: seen.append(config)
    )
    base = ["mopd", "distill", "--experts", tmp_path, "--student", tmp_path, "--out", tmp_path / "d"]
    assert run(base) == 0 and seen[-1] == MOPDConfig()
    assert run([*base, "--prompts", 3, "--objective", "sampled", "--lr", 1e-3]) == 0
    assert (seen[-1].prompts_per_step, seen[-1].objective, seen[-1].optimizer.lr) == (3, "sampled", 1e-3)
    assert run([*base, "--prompts-per-step", 4, "--set", "steps=2"]) == 0
    assert (seen[-1].prompts_per_step, seen[-1].steps) == (4, 2)


class _Result:
    kept: list = []
    summary: dict = {}

    def write(self, out: Path) -> Path:
        return out


def test_factory_generate_reads_a_recipe_and_checks_the_tools_file(tmp_path, monkeypatch):
    seen: list[FactoryConfig] = []
    monkeypatch.setattr(agentic, "generate", lambda config: seen.append(config) or _Result())
    monkeypatch.setattr(agentic, "print_summary", lambda summary, console: None)
    recipe = tmp_path / "factory.toml"
    recipe.write_text("n = 7\nfailure_rate = 0.5\n")
    assert run(["factory", "generate", "--recipe", recipe, "--n", 9, "--out", tmp_path / "t.jsonl"]) == 0
    assert seen[-1] == FactoryConfig(n=9, failure_rate=0.5)
    assert run(["factory", "generate", "--tools", tmp_path / "missing.jsonl"]) == 2
    assert run(["factory", "generate", "--set", "imperfection=1.5"]) == 2 and len(seen) == 1


def test_recipe_agentic_mini_reads_a_recipe(tmp_path, monkeypatch):
    seen: list = []
    monkeypatch.setattr(recipe_mini, "run_recipe", lambda config, log: seen.append(config) or {})
    monkeypatch.setattr(recipe_mini, "print_report", lambda report, console: None)
    recipe = tmp_path / "mini.toml"
    recipe.write_text(f'out = "{tmp_path / "run"}"\nrl_groups = 2\n')
    assert run(["recipe", "agentic-mini", "--recipe", recipe, "--rl-group-size", 3]) == 0
    assert (seen[-1].out, seen[-1].rl_groups, seen[-1].rl_group_size) == (tmp_path / "run", 2, 3)
    assert (
        run(["recipe", "agentic-mini", "-o", tmp_path / "other"]) == 0 and seen[-1].out == tmp_path / "other"
    )
