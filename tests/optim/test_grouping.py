"""The optimizer recipe's validation."""

import math

import pytest
from pydantic import ValidationError

from k2lab.optim import OptimizerConfig


@pytest.mark.parametrize("field", ["lr", "weight_decay", "qk_clip_tau"])
@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_non_finite_numbers_are_refused(field: str, value: float):
    """An lr of inf passed gt=0, and every weight of the run became NaN with exit code 0."""
    with pytest.raises(ValidationError, match="finite number"):
        OptimizerConfig(**{field: value})
