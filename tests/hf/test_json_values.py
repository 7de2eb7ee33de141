"""k2lab.hf.json_values: JSON booleans never pass as integers or numbers."""

import pytest

from k2lab.hf.json_values import is_integer, is_number


@pytest.mark.parametrize(
    ("value", "integer", "number"),
    [(3, True, True), (0, True, True), (2.5, False, True), (True, False, False), (False, False, False),
     ("3", False, False), (None, False, False), ([3], False, False)],
)  # fmt: skip
def test_integer_and_number(value, integer, number):
    assert is_integer(value) is integer
    assert is_number(value) is number
