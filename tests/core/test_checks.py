"""framework.core.checks: gin settings checked with errors that name the setting and the value."""

import numpy as np
import pytest

from framework.core import checks


@pytest.mark.parametrize(
    "check, value, error, message",
    [
        (checks.integer, "ten", TypeError, "x.n must be a positive integer, got 'ten'"),
        (checks.integer, 4.5, TypeError, "a positive integer, got 4.5"),
        (checks.integer, True, TypeError, "a positive integer, got True"),
        (checks.integer, 0, ValueError, "a positive integer, got 0"),
        (checks.number, -1, ValueError, "x.n must be a positive number, got -1"),
        (checks.number, float("nan"), ValueError, "a positive number, got nan"),
        (checks.number, "fast", TypeError, "a positive number, got 'fast'"),
        (checks.boolean, "False", TypeError, "x.n must be True or False, got 'False'"),
    ],
)
def test_checks_name_the_parameter_and_the_value(check, value, error, message):
    with pytest.raises(error, match=message):
        check("x.n", value)


def test_checks_accept_good_values_and_describe_ranges():
    checks.integer("x.n", np.int64(3))
    checks.integer("x.n", 0, minimum=0)
    checks.integer("x.n", None, optional=True)
    checks.number("x.n", 1)
    checks.number("x.n", 0.0, inclusive=True)
    checks.boolean("x.n", False)
    with pytest.raises(ValueError, match="x.n must be a non-negative integer or None, got -1"):
        checks.integer("x.n", -1, minimum=0, optional=True)
    with pytest.raises(ValueError, match="x.n must be a number > 0 and < 1, got 1"):
        checks.number("x.n", 1, maximum=1.0)
