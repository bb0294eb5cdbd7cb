"""What runs after each host loop: small callables `action(trainer, metrics)`, as Orbit's actions.

The trainer's loop runs `steps_per_loop` compiled steps, then each action in order with the
loop's metrics (loss, accuracy, grad_norm, learning_rate, steps_per_sec, ...). The built-in ones
check for divergence, write summaries, log progress, save checkpoints, save on preemption and
evaluate; a user adds their own through `Trainer.actions` (in Python, or by gin after registering
the callable). An action may read the trainer (`step`, `model`, `model_dir`, `evaluate()`), but
the step and the weights change only inside the loop.

`StopDivergence` comes first: a loop whose state is not finite never reaches the others (it is
never logged as progress, and never saved).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import tensorflow as tf

from framework.errors import TrainerError

if TYPE_CHECKING:
    from framework.settings import TrainerSettings
    from framework.trainer import Trainer

Action = Callable[["Trainer", dict[str, float]], None]


class RolledBack(Exception):
    """Raised by `StopDivergence` after a rollback: the loop skips the remaining actions and
    restarts its data stream at the restored step."""


def _every(step: int, interval: int | None) -> bool:
    return bool(interval) and step % interval == 0


class StopDivergence:
    """Handles a diverged loop, whose state is never saved: a finite loss is not enough, as
    the loop's last update may already have made the weights or the optimizer state
    non-finite (one reduction on the device checks them all). With `rollbacks` left, restores
    the newest finite checkpoint and scales the learning rate by `factor`, as large-scale
    trainers do; otherwise stops with a TrainerError that names the checkpoint to resume from."""

    def __init__(self, rollbacks: int = 0, factor: float = 0.5):
        self.rollbacks_left = rollbacks
        self.factor = factor

    def __call__(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        loss = metrics["loss"]
        if math.isfinite(loss) and trainer.state_is_finite():
            return
        what = (
            f"the loss became {loss}"
            if not math.isfinite(loss)
            else "the weights became non-finite"
        )
        state = trainer.run_state
        if self.rollbacks_left > 0 and state is not None:
            diverged_at, scale = trainer.step, float(trainer.learning_rate_scale.numpy())
            restored = state.restore()
            if restored is not None:
                self.rollbacks_left -= 1
                # Lower than before the rollback, not only than the checkpoint's: a run that
                # diverges again before its next save rolls back to the same checkpoint.
                restored_scale = float(trainer.learning_rate_scale.numpy())
                trainer.learning_rate_scale.assign(min(scale, restored_scale) * self.factor)
                logging.warning(
                    "%s before step %d: rolled back to %s with the learning rate scaled by "
                    "%g (now %g of the schedule); %d rollback(s) left",
                    what,
                    diverged_at,
                    restored,
                    self.factor,
                    float(trainer.learning_rate_scale.numpy()),
                    self.rollbacks_left,
                )
                raise RolledBack
        latest = state.newest_finite() if state is not None else None
        kept = (
            f"the last good checkpoint {latest} is kept"
            if latest
            else "no finite checkpoint exists"
        )
        raise TrainerError(
            f"{what} before step {trainer.step}: training diverged and this state was not saved; "
            f"{kept}. Lower Trainer.learning_rate, raise Trainer.warmup_steps or set "
            "Trainer.clip_norm (or Trainer.divergence_rollbacks), and run again to resume from it."
        )


def write_summaries(trainer: Trainer, metrics: dict[str, float]) -> None:
    """The loop's metrics as TensorBoard scalars under `model_dir/train`."""
    trainer.summaries.scalars("train", trainer.step, metrics)


def _format_duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class LogProgress:
    """One line per loop: step, loss, accuracy, speed, peak memory and the time left, from the
    speed since the first loop it saw (whose time includes compiling) or, at first, that loop's."""

    def __init__(self):
        self._since: tuple[float, int] | None = None

    def __call__(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        now, step = time.perf_counter(), trainer.step
        if self._since is None or step <= self._since[1]:  # the first loop, or after a rollback
            self._since = (now, step)
            rate = metrics["steps_per_sec"]
        else:
            rate = (step - self._since[1]) / max(now - self._since[0], 1e-9)
        peak = metrics.get("peak_memory_mib")
        speed = f"{metrics['tflops_per_sec']:.3g} TFLOP/s" if "tflops_per_sec" in metrics else ""
        if "mfu" in metrics:
            speed += f", MFU {metrics['mfu']:.1%}"
        logging.info(
            "step %d/%d: loss %.4f, accuracy %.3f, %.2f steps/s, %.0f examples/s, %s, "
            "peak memory %s, ETA %s",
            step,
            trainer.settings.train_steps,
            metrics["loss"],
            metrics["accuracy"],
            metrics["steps_per_sec"],
            metrics["examples_per_sec"],
            speed or "TFLOP/s n/a",
            "n/a" if peak is None else f"{peak:.0f} MiB",
            _format_duration((trainer.settings.train_steps - step) / max(rate, 1e-9)),
        )


class WatchMemoryBudget:
    """Puts the measured peak beside the budget the remat policy was picked for (`Trainer.
    remat_policy = "auto"`): logged at the first loop and whenever the peak grows, and a warning
    when a loop's peak is over the budget, since the plan then did not hold on this device (it
    was read from XLA's plan, or memory outside the step was in use)."""

    def __init__(self, budget_bytes: int, planned: str):
        self.budget_bytes = budget_bytes
        self.planned = planned
        self._highest = 0.0

    def __call__(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        peak = metrics.get("peak_memory_mib")
        if peak is None or peak <= self._highest:
            return
        self._highest = peak
        budget = self.budget_bytes / 2**20
        line = (
            f"step {trainer.step}: measured peak {peak:.0f} MiB, {peak / budget:.0%} of the "
            f"{budget:.0f} MiB budget (the plan: {self.planned})"
        )
        if peak > budget:
            logging.warning("%s: OVER the budget; plan again with a larger --safety_margin", line)
        else:
            logging.info("%s", line)


class SaveCheckpoints:
    """Saves a checkpoint every `interval` steps (the loop also saves when it ends)."""

    def __init__(self, interval: int):
        self.interval = interval

    def __call__(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        if _every(trainer.step, self.interval):
            trainer.save()


def save_if_preempted(trainer: Trainer, metrics: dict[str, float]) -> None:
    """After SIGTERM, saves at a step all workers agree on and stops (`PreemptedError`)."""
    if trainer.run_state is not None:
        trainer.run_state.save_if_preempted()


class Evaluate:
    """Evaluates every `interval` steps, except at the last step (`train_and_evaluate` does)."""

    def __init__(self, interval: int):
        self.interval = interval

    def __call__(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        if _every(trainer.step, self.interval) and trainer.step < trainer.settings.train_steps:
            trainer.evaluate()


class Profile:
    """A TensorBoard profile (trace viewer, op statistics) of the loops from step `first` to
    step `last`, written under `logdir/plugins/profile/`.

    Actions run between loops, so the window starts at the first loop boundary at or after
    `first` and ends at the first at or after `last` (or at `train_steps`): with 100 steps per
    loop, (150, 250) profiles steps 200 to 300. Start after the first loop, whose time is mostly
    compilation.
    """

    def __init__(self, first: int, last: int, logdir: str):
        if not 0 <= first < last:
            raise ValueError(
                f"Trainer.profile_steps must be (first, last) with 0 <= first < last, got "
                f"({first}, {last})"
            )
        self.first, self.last, self.logdir = first, last, logdir
        self.running = False

    def __call__(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        end = min(self.last, trainer.settings.train_steps)
        if self.running and trainer.step >= end:
            tf.profiler.experimental.stop()
            self.running = False
            logging.info("wrote a profile of the steps before %d to %s", trainer.step, self.logdir)
        elif not self.running and self.first <= trainer.step < end:
            tf.profiler.experimental.start(self.logdir)
            self.running = True


def built_in(model_dir: str | None, settings: TrainerSettings) -> list[Action]:
    """The trainer's own actions, in the order they run (see the module docstring). Without a
    model_dir nothing is saved or profiled."""
    s = settings
    actions: list[Action] = [
        StopDivergence(s.divergence_rollbacks, s.rollback_learning_rate_factor),
        write_summaries,
        LogProgress(),
    ]
    if model_dir is not None:
        actions += [SaveCheckpoints(s.checkpoint_every or s.steps_per_loop), save_if_preempted]
    if s.eval_every:
        actions.append(Evaluate(s.eval_every))
    if s.profile_steps and model_dir is not None:
        actions.append(Profile(*s.profile_steps, os.path.join(model_dir, "train")))
    return actions
