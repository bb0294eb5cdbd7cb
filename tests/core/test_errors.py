"""One error family: every exception class the framework defines derives from `FrameworkError`,
and those users catch as built-in classes today still are those."""

import importlib
import inspect
import pkgutil

import framework
from framework.core.errors import FrameworkError, RematError
from framework.models.weights.files import WeightsError
from framework.remat import RecomputationMismatchError
from framework.runtime.xla import XlaMemoryLimitError
from framework.trainer.warm_start import WarmStartError


def _framework_exceptions() -> list[type]:
    found = []
    for module in pkgutil.walk_packages(framework.__path__, "framework."):
        if ".configs" in module.name:
            continue
        loaded = importlib.import_module(module.name)
        for _, cls in inspect.getmembers(loaded, inspect.isclass):
            own = cls.__module__ == module.name
            if own and issubclass(cls, BaseException) and not issubclass(cls, Warning):
                found.append(cls)
    return found


def test_every_framework_exception_is_a_framework_error():
    exceptions = _framework_exceptions()
    assert len(exceptions) >= 15, exceptions
    outside = [
        f"{c.__module__}.{c.__name__}" for c in exceptions if not issubclass(c, FrameworkError)
    ]
    assert not outside, outside


def test_the_built_in_classes_users_catch_are_kept():
    for error, builtin in [
        (WarmStartError, ValueError),
        (WeightsError, ValueError),
        (XlaMemoryLimitError, ValueError),
    ]:
        assert issubclass(error, builtin) and issubclass(error, FrameworkError)
    assert issubclass(RecomputationMismatchError, RematError)
