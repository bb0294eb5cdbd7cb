"""What runs after each host loop: small callables `action(loop, metrics)`, as Orbit's actions.

The trainer's loop runs `steps_per_loop` compiled steps, then each action in order with the
loop's metrics (loss, accuracy, grad_norm, learning_rate, steps_per_sec, ...). The built-in ones
check for divergence, write summaries, log progress, save checkpoints, save on preemption and
evaluate; a user adds their own through `Trainer.actions` (in Python, or by gin after registering
the callable). An action sees the loop, not the trainer: where it is (`Loop.step`, the settings,
the model directory) and the few things it may ask for (save, evaluate, roll back, stop). The
step and the weights change only inside the loop.

`StopDivergence` comes first: a loop whose state is not finite never reaches the others (it is
never logged as progress, and never saved).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import tensorflow as tf

from framework.core.errors import TrainerError

if TYPE_CHECKING:
    from framework.trainer.settings import TrainerSettings


class Loop(Protocol):
    """What an action sees of the training loop after a host loop ends."""

    @property
    def step(self) -> int:
        """The global step the loop reached."""

    @property
    def settings(self) -> TrainerSettings:
        """The run's settings (`Trainer.*`)."""

    @property
    def model_dir(self) -> str | None:
        """The run's directory; None for a run in memory only."""

    def save(self) -> str | None:
        """Saves the current step (once); the checkpoint's path, None without a model_dir."""

    def save_if_preempted(self) -> None:
        """After SIGTERM, saves at a step all workers agree on and stops (`PreemptedError`)."""

    def evaluate(self) -> dict[str, float]:
        """Loss and accuracy on the held-out split (also written to the eval summaries)."""

    def write_scalars(self, split: str, metrics: dict[str, float]) -> None:
        """TensorBoard scalars of the current step under `model_dir/split`."""

    def state_is_finite(self) -> bool:
        """Whether every floating-point variable of the model and the optimizer is finite."""

    @property
    def learning_rate_scale(self) -> float:
        """The factor on the learning-rate schedule (1 until a rollback lowers it)."""

    def newest_finite_checkpoint(self) -> str | None:
        """The newest checkpoint whose weights are finite, or None."""

    def roll_back(self, learning_rate_factor: float) -> str | None:
        """Restores the newest finite checkpoint and scales the learning rate by the factor
        (from the lower of the rates before and after the restore); the checkpoint restored, or
        None when there is none. The loop then skips the remaining actions and reads its data
        again from the restored step."""

    def stop(self, reason: str) -> None:
        """Ends training once this loop's actions have run; the run saves its last step."""


Action = Callable[[Loop, dict[str, float]], None]


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

    def __call__(self, loop: Loop, metrics: dict[str, float]) -> None:
        loss = metrics["loss"]
        if math.isfinite(loss) and loop.state_is_finite():
            return
        what = (
            f"the loss became {loss}"
            if not math.isfinite(loss)
            else "the weights became non-finite"
        )
        diverged_at = loop.step
        if self.rollbacks_left > 0:
            restored = loop.roll_back(self.factor)
            if restored is not None:
                self.rollbacks_left -= 1
                logging.warning(
                    "%s before step %d: rolled back to %s with the learning rate scaled by %g "
                    "(now %g of the schedule); %d rollback(s) left",
                    what,
                    diverged_at,
                    restored,
                    self.factor,
                    loop.learning_rate_scale,
                    self.rollbacks_left,
                )
                return
        latest = loop.newest_finite_checkpoint()
        kept = (
            f"the last good checkpoint {latest} is kept"
            if latest
            else "no finite checkpoint exists"
        )
        # No finite checkpoint yet: the loss may never have been finite, which bad data gives
        # at any learning rate (XLA computes a nan loss for a label outside the classes).
        data = (
            ""
            if latest
            else " If it was never finite, check the data first: labels outside the model's "
            "classes (its number of outputs) or non-finite inputs give a nan loss."
        )
        raise TrainerError(
            f"{what} before step {diverged_at}: training diverged and this state was not saved; "
            f"{kept}. Lower Trainer.learning_rate, raise Trainer.warmup_steps or set "
            "Trainer.clip_norm (or Trainer.divergence_rollbacks), and run again to resume from "
            f"it.{data}"
        )


def write_summaries(loop: Loop, metrics: dict[str, float]) -> None:
    """The loop's metrics as TensorBoard scalars under `model_dir/train`."""
    loop.write_scalars("train", metrics)


def _format_duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class LogProgress:
    """One line per loop: step, loss, accuracy, speed, peak memory and the time left, from the
    speed since the first loop it saw (whose time includes compiling) or, at first, that loop's."""

    def __init__(self):
        self._since: tuple[float, int] | None = None

    def __call__(self, loop: Loop, metrics: dict[str, float]) -> None:
        now, step = time.perf_counter(), loop.step
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
            loop.settings.train_steps,
            metrics["loss"],
            metrics["accuracy"],
            metrics["steps_per_sec"],
            metrics["examples_per_sec"],
            speed or "TFLOP/s n/a",
            "n/a" if peak is None else f"{peak:.0f} MiB",
            _format_duration((loop.settings.train_steps - step) / max(rate, 1e-9)),
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

    def __call__(self, loop: Loop, metrics: dict[str, float]) -> None:
        peak = metrics.get("peak_memory_mib")
        if peak is None or peak <= self._highest:
            return
        self._highest = peak
        budget = self.budget_bytes / 2**20
        line = (
            f"step {loop.step}: measured peak {peak:.0f} MiB, {peak / budget:.0%} of the "
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

    def __call__(self, loop: Loop, metrics: dict[str, float]) -> None:
        if _every(loop.step, self.interval):
            loop.save()


def save_if_preempted(loop: Loop, metrics: dict[str, float]) -> None:
    """After SIGTERM, saves at a step all workers agree on and stops (`PreemptedError`)."""
    loop.save_if_preempted()


class Evaluate:
    """Evaluates every `interval` steps, except at the last step (`train_and_evaluate` does)."""

    def __init__(self, interval: int):
        self.interval = interval

    def __call__(self, loop: Loop, metrics: dict[str, float]) -> None:
        if _every(loop.step, self.interval) and loop.step < loop.settings.train_steps:
            loop.evaluate()


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

    def __call__(self, loop: Loop, metrics: dict[str, float]) -> None:
        end = min(self.last, loop.settings.train_steps)
        if self.running and loop.step >= end:
            tf.profiler.experimental.stop()
            self.running = False
            logging.info("wrote a profile of the steps before %d to %s", loop.step, self.logdir)
        elif not self.running and self.first <= loop.step < end:
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
