"""The PARL ablation's settings: arms, seeds and the shared config are checked before any run."""

import math

import pytest
from pydantic import ValidationError

from k2lab.ablations.parl import ParlAblationSettings


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"seeds": []}, "one or more distinct seeds"),  # was min() of an empty sequence after training
        ({"seeds": [0, 0]}, "one or more distinct seeds"),  # one run counted twice
        ({"arms": ["bogus"]}, "non-empty subset of"),  # was a traceback
        ({"base": {"solo_prior": math.nan}}, "finite number"),
        ({"base": {"lr": math.inf}}, "finite number"),
    ],
)
def test_bad_settings_are_refused(settings: dict, message: str):
    with pytest.raises(ValidationError, match=message):
        ParlAblationSettings(**settings)


def test_arms_keep_the_studys_order():
    assert ParlAblationSettings(arms=["single_agent", "full"]).arms == ["full", "single_agent"]
