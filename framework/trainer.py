"""The gin-configured trainer: the composition of a runtime, a model, a step, data and actions.

The same program runs on one CPU, on N logical CPUs, on a multi-GPU host and (with the runtime
set) on a TPU pod. The step (`step.py`) is one XLA program per replica; the host loop runs
`steps_per_loop` steps in one `tf.function`, then the actions (`actions.py`: divergence check,
summaries, progress, checkpoints, preemption, evaluation, and the user's own). The run's
directory (lock, checkpoints, restore) is `run_state.py`.

Gin touches only `Trainer`'s and `Runtime`'s arguments: models, data sets, losses and optimizers
stay plain functions.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence

import gin
import keras
import numpy as np
import tensorflow as tf

from framework import actions as actions_lib
from framework import (
    checks,
    configurables,
    distribute,
    losses,
    memory,
    optim,
    remat,
    run_lock,
    step,
)
from framework.data.sharding import DatasetFn
from framework.errors import PreemptedError, TrainerError
from framework.run_state import RunState
from framework.runtime import Runtime


@gin.configurable
class Trainer:
    """Builds a run from its configuration and trains, evaluates and checkpoints it.

    Args:
      model_dir: where checkpoints, summaries and the lock live; None trains in memory only
        (nothing restored or written: what the planner and benchmarks use).
      model_fn: returns a Keras model mapping inputs to logits.
      dataset_fn: a data set function (`data.sharding.DatasetFn`).
      global_batch_size: examples per step over all replicas.
      train_steps: the step training ends at (and the learning rate schedule's length).
      steps_per_loop: compiled steps per host loop; actions run after each loop.
      eval_every, checkpoint_every: in steps (`checkpoint_every` defaults to each loop).
      keep_checkpoints: how many checkpoints to keep (None keeps all).
      lock_lease_seconds: the model_dir lock's lease on filesystems without flock (`run_lock`).
      learning_rate, warmup_steps: peak of the linear warm-up + cosine schedule.
      weight_decay: decoupled weight decay, passed to `optimizer_fn`.
      optimizer_fn: `optim.adamw` (default), `optim.sgd`, `optim.adafactor`, or one alike.
      loss_fn: per-target loss of (logits, labels) (`losses.cross_entropy` by default).
      clip_norm: clips the all-reduced gradients by their global norm (None: no clipping).
      microbatches: splits each replica's batch and sums the gradients in the step.
      divergence_rollbacks, rollback_learning_rate_factor: see `actions.StopDivergence`.
      remat_policy: a name from `remat.policy_names()` or a policy, applied to the model's
        repeated blocks.
      runtime: strategy, devices, compiler flags, precision; `Runtime()` (gin-bound) if None.
      actions: more callables `action(trainer, metrics)` run after the built-in ones.
      seed: seeds Python, NumPy, TensorFlow and Keras.
    """

    def __init__(
        self,
        model_dir: str | None,
        *,
        model_fn: Callable[[], keras.Model] = gin.REQUIRED,
        dataset_fn: DatasetFn = gin.REQUIRED,
        global_batch_size: int = 128,
        train_steps: int = 1000,
        steps_per_loop: int = 100,
        eval_every: int | None = None,
        checkpoint_every: int | None = None,
        keep_checkpoints: int | None = 3,
        lock_lease_seconds: float = run_lock.DEFAULT_LEASE_SECONDS,
        learning_rate: float = 1e-3,
        warmup_steps: int = 0,
        weight_decay: float = 0.05,
        optimizer_fn: optim.OptimizerFn = configurables.adamw,
        loss_fn: losses.LossFn = configurables.cross_entropy,
        clip_norm: float | None = 1.0,
        microbatches: int = 1,
        divergence_rollbacks: int = 0,
        rollback_learning_rate_factor: float = 0.5,
        remat_policy: str | remat.policies.Policy | None = None,
        runtime: Runtime | None = None,
        actions: Sequence[actions_lib.Action] = (),
        seed: int = 0,
    ):
        # Gin passes any value: check types and ranges before anything is built.
        for name, value in dict(
            global_batch_size=global_batch_size,
            train_steps=train_steps,
            steps_per_loop=steps_per_loop,
            microbatches=microbatches,
        ).items():
            checks.integer(f"Trainer.{name}", value)
        for name, value in dict(
            eval_every=eval_every,
            checkpoint_every=checkpoint_every,
            keep_checkpoints=keep_checkpoints,
        ).items():
            checks.integer(f"Trainer.{name}", value, optional=True)
        for name, value in dict(
            warmup_steps=warmup_steps, seed=seed, divergence_rollbacks=divergence_rollbacks
        ).items():
            checks.integer(f"Trainer.{name}", value, minimum=0)
        checks.number("Trainer.learning_rate", learning_rate)
        checks.number("Trainer.weight_decay", weight_decay, inclusive=True)
        checks.number("Trainer.clip_norm", clip_norm, optional=True)
        checks.number(
            "Trainer.rollback_learning_rate_factor", rollback_learning_rate_factor, maximum=1.0
        )
        checks.number("Trainer.lock_lease_seconds", lock_lease_seconds)
        self.runtime = runtime or Runtime()
        self.strategy = self.runtime.start()
        self.is_chief = distribute.is_chief(self.strategy)
        replicas = self.strategy.num_replicas_in_sync
        if global_batch_size % (replicas * microbatches):
            raise ValueError(
                f"global_batch_size {global_batch_size} does not split over {replicas} "
                f"replica(s) x {microbatches} micro-batch(es)"
            )
        self.model_dir = model_dir
        self.dataset_fn = dataset_fn
        self.global_batch_size = global_batch_size
        self.train_steps = train_steps
        self.steps_per_loop = steps_per_loop
        self.loss_fn = loss_fn
        self.microbatches = microbatches
        self.traces: collections.Counter[str] = collections.Counter()
        # Peak memory is logged per loop for the first replica's device, if its allocator counts.
        self._memory_device = distribute.first_device(self.strategy)
        if not memory.keeps_statistics(self._memory_device):
            logging.info("peak memory not logged: %s keeps no statistics", self._memory_device)
            self._memory_device = None

        keras.utils.set_random_seed(seed)
        with self.strategy.scope():
            self.model = model_fn()
            if remat_policy is not None:
                blocks = remat.set_grad_checkpointing(self.model, policy=remat_policy)
                logging.info("remat policy %s on %d blocks", remat_policy, len(blocks))
            # Lowered by a divergence rollback; saved with the checkpoints so a restart keeps it.
            self.learning_rate_scale = tf.Variable(1.0, trainable=False, name="lr_scale")
            schedule = optim.warmup_cosine(learning_rate, warmup_steps, train_steps)
            self.optimizer = optimizer_fn(
                optim.ScaledSchedule(schedule, self.learning_rate_scale), weight_decay
            )
            self.optimizer.build(self.model.trainable_variables)
        logging.info(
            "model %s: %s parameters, precision %s, %s",
            self.model.name,
            f"{self.model.count_params():,}",
            self.runtime.precision,
            type(self.optimizer).__name__,
        )
        self._is_finite = step.make_finite_check(self.model.variables + self.optimizer.variables)
        self._train_loop = step.make_train_loop(
            self.strategy,
            self.model,
            self.optimizer,
            loss_fn=loss_fn,
            clip_norm=clip_norm,
            microbatches=microbatches,
            traces=self.traces,
        )
        self._eval_loop = step.make_eval_loop(self.strategy, self.model, loss_fn=loss_fn)

        self.run_state: RunState | None = None
        self._preemption = None
        builtin: list[actions_lib.Action] = [
            actions_lib.StopDivergence(divergence_rollbacks, rollback_learning_rate_factor),
            actions_lib.write_summaries,
            actions_lib.LogProgress(),
        ]
        if model_dir is not None:
            self.run_state = RunState(
                model_dir,
                model=self.model,
                optimizer=self.optimizer,
                learning_rate_scale=self.learning_rate_scale,
                is_finite=self.state_is_finite,
                is_chief=self.is_chief,
                keep=keep_checkpoints,
                lease_seconds=lock_lease_seconds,
            )
            # TensorFlow's handler makes all workers agree on the step to save at after SIGTERM.
            self._preemption = tf.distribute.experimental.PreemptionCheckpointHandler(
                self.strategy.cluster_resolver,
                self.run_state.manager,
                termination_config=tf.distribute.experimental.TerminationConfig(
                    exit_fn=self._preempted
                ),
            )
            builtin += [
                actions_lib.SaveCheckpoints(checkpoint_every or steps_per_loop),
                actions_lib.save_if_preempted,
            ]
        if eval_every:
            builtin.append(actions_lib.Evaluate(eval_every))
        self.actions = [*builtin, *actions]
        # Built now, so a bad data configuration fails before training and gin records it.
        self._eval_dataset = self._distributed_dataset("eval")
        self._writers = {
            split: tf.summary.create_file_writer(os.path.join(model_dir, split))
            if model_dir is not None and self.is_chief
            else tf.summary.create_noop_writer()
            for split in ("train", "eval")
        }

    @property
    def step(self) -> int:
        return int(self.optimizer.iterations.numpy())

    def state_is_finite(self) -> bool:
        """Whether every floating-point variable of the model and the optimizer is finite."""
        return bool(self._is_finite())

    def _distributed_dataset(self, split: str, start_step: int = 0):
        def dataset_for_pipeline(context: tf.distribute.InputContext) -> tf.data.Dataset:
            return self.dataset_fn(
                split, context, global_batch_size=self.global_batch_size, start_step=start_step
            )

        return self.strategy.distribute_datasets_from_function(dataset_for_pipeline)

    def evaluate(self) -> dict[str, float]:
        """Loss and accuracy on the whole held-out split; written to the eval summaries."""
        loss_sum, correct, count = self._eval_loop(self._eval_dataset).numpy()
        if count == 0:
            raise TrainerError("the eval data set is empty: give it at least one global batch")
        metrics = {"loss": loss_sum / count, "accuracy": correct / count}
        self.write_summaries("eval", metrics)
        logging.info(
            "eval at step %d: loss %.4f, accuracy %.4f on %d targets",
            self.step,
            metrics["loss"],
            metrics["accuracy"],
            count,
        )
        return metrics

    def train_iterator(self):
        """An iterator over the distributed training data, from the current step on."""
        return iter(self._distributed_dataset("train", start_step=self.step))

    def run_steps(self, iterator, num_steps: int) -> np.ndarray:
        """Runs `num_steps` compiled train steps; returns the sums of `step.TRAIN_SUMS`. No
        actions: `train` adds them, and measurements (`framework.plan`) call this directly."""
        try:
            return self._train_loop(iterator, tf.constant(num_steps)).numpy()
        except tf.errors.OutOfRangeError:
            raise TrainerError(
                f"the training data ran out at step {self.step}: dataset_fn('train', ...) "
                "must repeat forever (or hold at least train_steps batches)"
            ) from None

    def compiled_step(self):
        """One replica's forward and backward pass as XLA compiles it, and a batch to call it
        with: what `memory.compiled_bytes` reads XLA's buffer assignment of."""
        per_replica = self.global_batch_size // self.strategy.num_replicas_in_sync
        batch = next(iter(self.dataset_fn("train", global_batch_size=per_replica)))
        return step.compiled_gradients(self.model, self.loss_fn, self.microbatches), batch

    def run_loop(self, iterator, num_steps: int) -> dict[str, float]:
        """Runs one host loop of `num_steps` steps; returns its metrics."""
        start = time.perf_counter()
        tracker = memory.PeakTracker(self._memory_device, strict=False)
        with tracker if self._memory_device else contextlib.nullcontext():
            loss_sum, correct, count, norm_sum = self.run_steps(iterator, num_steps)
        seconds = time.perf_counter() - start
        metrics = {
            "loss": loss_sum / count,
            "accuracy": correct / count,
            "grad_norm": norm_sum / num_steps,
            "learning_rate": float(self.optimizer.learning_rate.numpy()),
            "steps_per_sec": num_steps / seconds,
            "examples_per_sec": num_steps * self.global_batch_size / seconds,
            "targets_per_sec": count / seconds,
        }
        if tracker.result is not None:
            metrics["peak_memory_mib"] = tracker.result.peak_bytes / 2**20
        return metrics

    def train(self, max_steps: int | None = None) -> dict[str, float]:
        """Trains from the current step to `train_steps` and returns the last loop's metrics.

        `max_steps` stops earlier, after that many steps, as an interrupted run would: the learning
        rate schedule still follows `train_steps`, and a later run resumes from the checkpoint.
        """
        stop = (
            self.train_steps if max_steps is None else min(self.train_steps, self.step + max_steps)
        )
        if self.step >= stop:
            logging.info("at step %d of %d: nothing to train", self.step, self.train_steps)
            return {}
        iterator = self.train_iterator()
        metrics: dict[str, float] = {}
        while self.step < stop:
            metrics = self.run_loop(iterator, min(self.steps_per_loop, stop - self.step))
            try:
                for action in self.actions:
                    action(self, metrics)
            except actions_lib.RolledBack:
                iterator = self.train_iterator()
        self.save()  # the last step, whatever the checkpoint interval
        return metrics

    def train_and_evaluate(self) -> dict[str, float]:
        """Trains to `train_steps` (evaluating every `eval_every` steps), then evaluates."""
        self.train()
        return self.evaluate()

    def save(self) -> str | None:
        """Saves the current step to model_dir (once); None without a model_dir."""
        return self.run_state.save() if self.run_state else None

    def save_if_preempted(self) -> None:
        if self._preemption is not None:
            self._preemption.save_checkpoint_if_preempted(checkpoint_number=self.step)

    def save_interrupted(self) -> str | None:
        """Saves the current step after Ctrl-C, so that the same command resumes there rather
        than at the last periodic checkpoint; returns the checkpoint holding this step, or None.

        The step counter and the weights change together, only inside a compiled loop, so a built
        trainer is always at a loop boundary. Not saved: step 0 (nothing trained), a non-finite
        state (never saved), and a run of several workers, whose saving is collective (one
        worker alone would wait for the others forever; they save on SIGTERM).
        """
        resolver = self.strategy.cluster_resolver
        tasks = resolver.cluster_spec().as_dict() if resolver else {}
        if sum(map(len, tasks.values())) > 1 or self.step == 0 or not self.state_is_finite():
            return None
        return self.save()

    def _preempted(self) -> None:
        raise PreemptedError(self.step)

    def write_summaries(self, split: str, metrics: dict[str, float]) -> None:
        with self._writers[split].as_default(step=self.step):
            for name, value in metrics.items():
                tf.summary.scalar(name, value)
        self._writers[split].flush()
