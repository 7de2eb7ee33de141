"""Recipe loading: TOML plus dotted overrides, validated as the config, with no boolean read as a number."""

from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, Field

from k2lab.errors import K2LabError
from k2lab.recipes import RecipeError, booleans_for_numbers, load_config, read_recipe, set_dotted
from k2lab.train.config import load_train_config


class Stage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seq_len: int = 8


class Numbers(BaseModel):
    model_config = ConfigDict(extra="forbid")
    steps: int = Field(default=3, gt=1)
    lr: float = 1e-3
    limit: int | None = None
    sizes: list[int] = Field(default_factory=list)
    stages: list[Stage] = Field(default_factory=list)
    stage: Stage = Field(default_factory=Stage)
    counts: dict[str, float] = Field(default_factory=dict)
    loud: bool = False
    extra: dict[str, Any] = Field(default_factory=dict)


def test_booleans_for_number_fields_are_found_wherever_they_sit():
    data = {
        "steps": True,
        "lr": False,
        "limit": True,
        "sizes": [1, True],
        "stages": [{"seq_len": 4}, {"seq_len": False}],
        "stage": {"seq_len": True},
        "counts": {"a": True},
        "loud": True,  # a bool field takes booleans
        "extra": {"x": True},  # so does Any
    }
    found = {".".join(problem["loc"]): problem["msg"] for problem in booleans_for_numbers(Numbers, data)}
    assert found == {
        "steps": "takes an integer, not true",
        "lr": "takes a number, not false",
        "limit": "takes an integer, not true",
        "sizes.1": "takes an integer, not true",
        "stages.1.seq_len": "takes an integer, not false",
        "stage.seq_len": "takes an integer, not true",
        "counts.a": "takes a number, not true",
    }


def test_a_boolean_is_not_taken_for_a_number(tmp_path):
    """`steps = true` was read as 1; `steps = false` as 0, which said "should be greater than 1"."""
    recipe = tmp_path / "r.toml"
    recipe.write_text("steps = true\n")
    with pytest.raises(RecipeError, match=r"^invalid Numbers: steps: takes an integer, not true$"):
        load_config(Numbers, recipe)
    with pytest.raises(K2LabError, match=r"^invalid Numbers: stage.seq_len: takes an integer, not false$"):
        load_config(Numbers, None, **{"stage.seq_len": False})
    assert load_config(Numbers, None, lr=1, steps=4, loud=True) == Numbers(lr=1.0, steps=4, loud=True)


def test_training_recipes_refuse_booleans_for_numbers(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text("save_every = true\n[optimizer]\nlr = 1\n")
    with pytest.raises(K2LabError, match=r"save_every: takes an integer, not true"):
        load_train_config(recipe)
    with pytest.raises(K2LabError, match=r"seq_len: takes an integer, not true"):
        load_train_config(None, seq_len=True)
    assert load_train_config(recipe, save_every=5).optimizer.lr == 1.0  # a TOML integer is a number


def test_a_dotted_key_through_a_plain_value_is_a_clear_error():
    """`--set steps=3 --set steps.x=1` raised TypeError ('int' object does not support item assignment)."""
    with pytest.raises(K2LabError, match=r"steps.x: steps is 3, not a table, so it has no field 'x'"):
        set_dotted({"steps": 3}, {"steps.x": 1})
    with pytest.raises(K2LabError, match=r"a.b.c: a.b is 'v', not a table"):
        set_dotted({}, {"a.b": "v", "a.b.c": 1})
    assert set_dotted({"a": {"b": 1}}, {"a.c": 2, "d.e": 3}) == {"a": {"b": 1, "c": 2}, "d": {"e": 3}}


def test_a_recipe_opening_with_a_byte_order_mark_is_read(tmp_path):
    """Windows editors write one; tomllib called it an "Invalid statement (at line 1, column 1)"."""
    recipe = tmp_path / "bom.toml"
    recipe.write_bytes(b"\xef\xbb\xbfsteps = 3\n")
    assert read_recipe(recipe) == {"steps": 3}
