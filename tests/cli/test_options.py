"""Options derived from a command's config: one place for each default, recipe < --set < named options."""

from typing import Annotated

import pytest
import typer
from pydantic import BaseModel, ConfigDict, Field
from typer.testing import CliRunner

from k2lab.cli import app, main
from k2lab.cli.options import Opt, Profile, field_at, field_default, parse_set, runs_config
from k2lab.errors import K2LabError
from k2lab.recipes import read_recipe, set_dotted


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lr: float = Field(default=2e-3, description="Learning rate.")
    name: str = "muon"


class Demo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    steps: int = Field(default=300, description="Steps.")
    out: str = "runs/x"
    section: Section = Field(default_factory=Section)


def _demo_app(seen: list[Demo]) -> typer.Typer:
    demo = typer.Typer()

    @demo.command()
    @runs_config(Demo, options={"steps": Opt("steps"), "lr": Opt("section.lr", "-l")})
    def run(config: Demo, loud: Annotated[bool, typer.Option("--loud")] = False) -> None:
        seen.append(config)

    @demo.command()
    def other() -> None:  # a second command so typer keeps `run` as a subcommand
        pass

    return demo


def test_parse_set_reads_toml_values_and_falls_back_to_strings():
    assert parse_set("optimizer.lr=3e-3") == ("optimizer.lr", 0.003)
    assert parse_set("curriculum=[]") == ("curriculum", [])
    assert parse_set("preset=k2-nano") == ("preset", "k2-nano")
    assert parse_set("flag=true") == ("flag", True)
    with pytest.raises(K2LabError, match="key.path=value"):
        parse_set("no-equals")


def test_precedence_defaults_recipe_set_options(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('steps = 5\nout = "from-recipe"\n[section]\nlr = 0.5\nname = "adamw"\n')
    seen: list[Demo] = []
    runner = CliRunner()
    args = ["run", "--recipe", str(recipe), "--set", "steps=7", "--set", "section.lr=0.25", "-l", "0.125"]
    result = runner.invoke(_demo_app(seen), args)
    assert result.exit_code == 0, result.output
    assert seen[-1] == Demo(steps=7, out="from-recipe", section=Section(lr=0.125, name="adamw"))
    assert runner.invoke(_demo_app(seen), ["run"]).exit_code == 0
    assert seen[-1] == Demo()


def test_help_shows_the_config_default():
    result = CliRunner().invoke(_demo_app([]), ["run", "--help"])
    text = " ".join(result.output.replace("│", " ").split())
    assert "(default: 300; recipe key: steps)" in text
    assert "(default: 0.002; recipe key: section.lr)" in text


def test_a_field_without_help_or_description_is_refused():
    with pytest.raises(TypeError, match="needs help or a field description"):
        runs_config(Demo, options={"out": Opt("out")})(lambda config: None)


class Listed(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lrs: list[float] = Field(default_factory=lambda: [1e-3], description="Learning rates.")
    key: str | None = Field(default=None, description="API key.")
    section: Section = Field(default_factory=Section)


QUICK = {"lrs": [0.5], "section": {"lr": 0.25}}


def _load_listed(recipe, overlay=None, **overrides) -> Listed:
    """Profile overlay, then the recipe, then the overrides."""
    return Listed.model_validate(set_dotted({**(overlay or {}), **read_recipe(recipe)}, overrides))


def _listed_app(seen: list[Listed]) -> typer.Typer:
    demo = typer.Typer()

    @demo.command()
    @runs_config(
        Listed,
        load=_load_listed,
        profiles={"quick": Profile(QUICK, help="Smoke run.")},
        options={"lrs": Opt("lrs"), "key": Opt("key", envvar="DEMO_KEY"), "lr": Opt("section.lr", "-l")},
    )
    def run(config: Listed) -> None:
        seen.append(config)

    @demo.command()
    def other() -> None:
        pass

    return demo


def test_list_options_profiles_and_envvars(tmp_path):
    seen: list[Listed] = []
    runner = CliRunner()
    assert runner.invoke(_listed_app(seen), ["run", "--lrs", "0.1, 0.2 0.3"]).exit_code == 0
    assert seen[-1].lrs == [0.1, 0.2, 0.3] and seen[-1].section.lr == 2e-3
    assert runner.invoke(_listed_app(seen), ["run", "--quick"]).exit_code == 0
    assert seen[-1].lrs == [0.5] and seen[-1].section.lr == 0.25
    recipe = tmp_path / "r.toml"
    recipe.write_text("lrs = [0.75]\n")
    args = ["run", "--quick", "--recipe", str(recipe), "-l", "0.125"]  # recipe and options above the profile
    assert runner.invoke(_listed_app(seen), args).exit_code == 0
    assert seen[-1].lrs == [0.75] and seen[-1].section.lr == 0.125
    assert runner.invoke(_listed_app(seen), ["run"], env={"DEMO_KEY": "secret"}).exit_code == 0
    assert seen[-1].key == "secret" and seen[-1].lrs == [1e-3]
    bad = runner.invoke(_listed_app(seen), ["run", "--lrs", "fast"])
    assert isinstance(bad.exception, K2LabError) and "--lrs takes float values" in str(bad.exception)


def test_help_shows_list_defaults_and_profile_values():
    result = CliRunner().invoke(_listed_app([]), ["run", "--help"])
    text = " ".join(result.output.replace("│", " ").split())
    assert "Learning rates (comma-separated). (default: 0.001; --quick: 0.5; recipe key: lrs)" in text
    assert "(default: 0.002; --quick: 0.25; recipe key: section.lr)" in text
    assert "Smoke run." in text and "DEMO_KEY" in text


def test_profiles_need_a_loader_that_takes_the_overlay():
    with pytest.raises(TypeError, match="overlay"):
        runs_config(Listed, options={}, profiles={"quick": Profile(QUICK, help="x")})


def _config_commands(group: typer.Typer, prefix: str = ""):
    for info in group.registered_commands:
        name = prefix + (info.name or info.callback.__name__.replace("_", "-"))
        yield name, info.callback
    for sub in group.registered_groups:
        yield from _config_commands(sub.typer_instance, prefix + sub.name + " ")


CONFIG_COMMANDS = [(n, c) for n, c in _config_commands(app) if hasattr(c, "config_class")]


def test_some_commands_run_configs():
    assert {"train"} <= {name for name, _ in CONFIG_COMMANDS}


@pytest.mark.parametrize(("name", "command"), CONFIG_COMMANDS, ids=[n for n, _ in CONFIG_COMMANDS])
def test_every_named_option_is_a_field_of_the_config_it_runs(name, command):
    for option in command.config_options.values():
        field = field_at(command.config_class, option.path)  # KeyError if the option names no field
        assert field_default(field) is not None or field.default is None


def test_the_default_loader_applies_the_commands_defaults_below_the_recipe(tmp_path):
    seen: list[Demo] = []
    demo = typer.Typer()

    @demo.command()
    @runs_config(Demo, defaults={"steps": 5, "section.lr": 0.5}, options={"steps": Opt("steps")})
    def run(config: Demo) -> None:
        seen.append(config)

    @demo.command()
    def other() -> None:
        pass

    runner = CliRunner()
    assert runner.invoke(demo, ["run"]).exit_code == 0
    assert (seen[-1].steps, seen[-1].section.lr) == (5, 0.5)
    recipe = tmp_path / "r.toml"
    recipe.write_text("steps = 7\n[section]\nlr = 0.25\n")
    assert runner.invoke(demo, ["run", "--recipe", str(recipe)]).exit_code == 0
    assert (seen[-1].steps, seen[-1].section.lr) == (7, 0.25)
    assert runner.invoke(demo, ["run", "--set", "section.lr=0.125", "--steps", "9"]).exit_code == 0
    assert (seen[-1].steps, seen[-1].section.lr) == (9, 0.125)
    text = " ".join(runner.invoke(demo, ["run", "--help"]).output.replace("│", " ").split())
    assert "(default: 5; recipe key: steps)" in text


def test_the_agentic_commands_run_their_configs():
    names = {name for name, _ in CONFIG_COMMANDS}
    assert {"rl", "factory generate", "recipe agentic-mini", "mopd experts", "mopd distill"} <= names


class Styled(BaseModel):
    model_config = ConfigDict(extra="forbid")
    styles: tuple[str, ...] = Field(default=("qa", "plain"), description="Styles.")
    sizes: tuple[int, ...] = Field(default=(1,), description="Sizes.")


def test_tuple_fields_and_a_separator_of_their_own():
    """A ``tuple[X, ...]`` field is a list option; ``Opt(sep=",")`` splits at commas only (spaces kept)."""
    seen: list[Styled] = []
    demo = typer.Typer()

    @demo.command()
    @runs_config(Styled, options={"styles": Opt("styles", sep=","), "sizes": Opt("sizes")})
    def run(config: Styled) -> None:
        seen.append(config)

    @demo.command()
    def other() -> None:
        pass

    runner = CliRunner()
    assert runner.invoke(demo, ["run", "--styles", "qa, a limerick ,", "--sizes", "2 3,4"]).exit_code == 0
    assert seen[-1] == Styled(styles=("qa", "a limerick"), sizes=(2, 3, 4))
    assert runner.invoke(demo, ["run"]).exit_code == 0 and seen[-1] == Styled()
    text = " ".join(runner.invoke(demo, ["run", "--help"]).output.replace("│", " ").split())
    assert "(default: qa,plain; recipe key: styles)" in text


class Needs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    section: Section = Field(default_factory=Section)
    source: str = Field(description="Where from.")
    target: str = Field(description="Where to.")


def test_a_missing_required_field_is_named_by_its_option():
    """`k2lab sft` alone said "sft.init_checkpoint: Field required", a key the user never typed."""
    demo = typer.Typer()

    @demo.command()
    @runs_config(Needs, options={"source": Opt("source", "--from", "-f")})
    def run(config: Needs) -> None:
        pass

    @demo.command()
    def other() -> None:
        pass

    result = CliRunner().invoke(demo, ["run"])
    assert isinstance(result.exception, K2LabError)
    assert str(result.exception) == (
        "invalid Needs: --from/-f is required (recipe key source); target: Field required"
    )


def test_sft_without_arguments_names_its_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["sft"])
    assert exit_info.value.code == 2
    error = " ".join(capsys.readouterr().err.split())
    assert "--checkpoint/-c is required (recipe key sft.init_checkpoint)" in error
    assert "--data is required (recipe key sft.data)" in error
