"""Does a run give the same numbers twice? Two copies of it, step by step, compared to the bit.

A run is reproducible when the same config and seed give the same weights: what a resumed run,
a replayed loss spike and an A/B comparison rely on. `first_difference` builds the run twice in
this process (no model directory: nothing is read or written), trains both copies one step at
a time on their own data pipelines, and after every step compares every variable of the model
and the optimizer, seed states included. It reports the first step and variable that differ.

On CPU every kernel is deterministic: expect none. On GPUs some kernels are not (atomic adds in
reductions and scatters, cuDNN's algorithm choice): expect differences in the last bits from
the first step, unless `tf.config.experimental.enable_op_determinism()` is on. On TPUs, XLA
runs the same program the same way: expect none, which only a run on a TPU confirms.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class Difference:
    """Where two copies of a run first differ: after `step`, in `variable`, by `max_abs`."""

    step: int
    variable: str
    max_abs: float

    def __str__(self) -> str:
        return f"step {self.step}: {self.variable} (max |difference| {self.max_abs:.3g})"


def _state(trainer) -> list[tuple[str, np.ndarray]]:
    """Every variable's value; sharded ones whole, as a checkpoint saves them."""
    whole = trainer.sharded.checkpoint_replacements() if trainer.sharded else {}
    variables = trainer.model.variables + trainer.optimizer.variables
    return [
        (
            getattr(v, "path", None) or v.name,
            np.asarray(whole[id(v)].read() if id(v) in whole else v.numpy()),
        )
        for v in variables
    ]


def first_difference(build: Callable[[], object], num_steps: int) -> Difference | None:
    """Builds the run twice with `build()` (a `Trainer` without a model directory each time),
    trains both `num_steps` steps in lockstep and returns where they first differ, or None."""
    copies = [build(), build()]
    iterators = [copy.train_iterator() for copy in copies]
    for _ in range(num_steps):
        for copy, iterator in zip(copies, iterators, strict=True):
            copy.run_steps(iterator, 1)
        states = [_state(copy) for copy in copies]
        for (name, a), (_, b) in zip(*states, strict=True):
            if a.tobytes() != b.tobytes():
                diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
                return Difference(copies[0].step, name, float(np.max(diff)))
    return None
