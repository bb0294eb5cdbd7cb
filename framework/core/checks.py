"""Type and range checks of configured arguments: one message shape for data sets and trainer.

A gin binding can hold any Python value, and a wrong one fails far from its cause or not at all:
`train_steps = 'ten'` ends in "'<' not supported between 'str' and 'int'", `train_steps = 4.5`
trains and logs "step 5/4", `learning_rate = -1` trains uphill. Checked where the value enters, each
becomes one message naming the parameter to fix: "Trainer.train_steps must be a positive integer,
got 'ten'". A wrong type raises TypeError, a value out of range ValueError. Only the standard
library is imported, so library modules can check their arguments and stay free of gin.
"""

from __future__ import annotations

import math
import numbers


def integer(name: str, value: object, *, minimum: int = 1, optional: bool = False) -> None:
    """Checks that `value` is an int of at least `minimum` (None too, when `optional`).

    A bool or a float is refused even when it equals an integer: `True` or `4.0` steps is a typo.
    """
    if optional and value is None:
        return
    wanted = {0: "a non-negative integer", 1: "a positive integer"}.get(
        minimum, f"an integer >= {minimum}"
    )
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(_message(name, value, wanted, optional))
    if value < minimum:
        raise ValueError(_message(name, value, wanted, optional))


def number(
    name: str,
    value: object,
    *,
    minimum: float = 0.0,
    maximum: float | None = None,
    inclusive: bool = False,
    optional: bool = False,
) -> None:
    """Checks that `value` is a finite real number above `minimum` (at least it, `inclusive`)
    and below `maximum`, or None when `optional`. Ints count: `learning_rate = 1` is a number."""
    if optional and value is None:
        return
    if minimum == 0 and maximum is None:
        wanted = "a non-negative number" if inclusive else "a positive number"
    else:
        wanted = f"a number {'>=' if inclusive else '>'} {minimum:g}"
        wanted += f" and < {maximum:g}" if maximum is not None else ""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(_message(name, value, wanted, optional))
    below = value < minimum if inclusive else value <= minimum
    if not math.isfinite(value) or below or (maximum is not None and value >= maximum):
        raise ValueError(_message(name, value, wanted, optional))


def boolean(name: str, value: object) -> None:
    """Checks that `value` is True or False: the string 'False' would count as true."""
    if not isinstance(value, bool):
        raise TypeError(_message(name, value, "True or False", optional=False))


def choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    """Checks that `value` is one of `choices` (strings)."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def _message(name: str, value: object, wanted: str, optional: bool) -> str:
    return f"{name} must be {wanted}{' or None' if optional else ''}, got {value!r}"
