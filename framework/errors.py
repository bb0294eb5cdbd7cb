"""The errors a run ends with that the user can act on: reported in one line, no traceback."""

from __future__ import annotations


class TrainerError(RuntimeError):
    """A problem the user can fix (bad data, divergence, an unreadable checkpoint)."""


class PreemptedError(Exception):
    """SIGTERM arrived (a preempted TPU VM or GPU node): a checkpoint was saved at `step`."""

    def __init__(self, step: int):
        super().__init__(f"preempted: saved a checkpoint at step {step}; run again to resume")
        self.step = step
