"""The framework's errors, one family: every exception class the framework defines derives from
`FrameworkError` (and, where callers catch it today, from the built-in class too: a
`WarmStartError` is a `ValueError`). The errors a run ends with that the user can act on are
`UserError`s: `cli.run` prints one as one `error:` line, no traceback, and exits with its
`exit_status`.
"""

from __future__ import annotations

# Begins the message of a check on the data that runs inside tf.data (a malformed JSON line, a
# token id out of range, a label out of range): TensorFlow raises it as an InvalidArgumentError,
# which `framework.train` reports as this one line.
BAD_DATA = "bad data: "


class FrameworkError(Exception):
    """Base class of every error the framework raises: `except FrameworkError` catches the
    framework's own errors and nothing else. Subclasses keep `Exception.__init__` (one message
    argument), which AutoGraph needs to re-raise them as the same class out of a `tf.function`.
    """


class UserError(FrameworkError):
    """A problem the user can fix; reported in one line."""

    exit_status = 2


class UsageError(UserError):
    """Bad input on the command line or in a config."""


class MissingDependency(UserError, ImportError):
    """An optional package a setting needs is not installed; the message says how to get it."""


class TrainerError(UserError, RuntimeError):
    """A problem of the run (bad data, divergence, an unreadable checkpoint, a taken lock)."""


class Interrupted(UserError):
    """Ctrl-C during training: the line says whether the step was saved; status 130."""

    exit_status = 130


class PreemptedError(FrameworkError):
    """SIGTERM arrived (a preempted TPU VM or GPU node): a checkpoint was saved at `step`."""

    exit_status = 42  # what TensorFlow's own preemption handling uses for "restart me"

    def __init__(self, step: int):
        super().__init__(f"preempted: saved a checkpoint at step {step}; run again to resume")
        self.step = step


class RematError(FrameworkError):
    """Base class of the errors a checkpointed region raises instead of a wrong gradient
    (`framework.remat`)."""


class RecomputationMismatchError(RematError):
    """The recomputation of a region created different ops than its forward pass."""


class UnreplayableRandomOpError(RematError):
    """A stateful random op inside a region: its recomputation would draw different numbers."""
