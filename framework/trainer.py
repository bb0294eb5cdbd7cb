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
    flops,
    losses,
    memory,
    optim,
    remat,
    run_lock,
    step,
    warm_start,
)
from framework.data.sharding import DatasetFn
from framework.errors import TrainerError
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
      init_checkpoint: a checkpoint (or a run's model_dir) whose model weights initialise a
        run that starts afresh (`warm_start`): fine-tuning. Ignored once the run has
        checkpoints of its own, which it resumes from.
      runtime: strategy, devices, compiler flags, precision; `Runtime()` (gin-bound) if None.
      actions: more callables `action(trainer, metrics)` run after the built-in ones.
      count_flops: count the model FLOPs of a step at the start of training, for TFLOP/s and
        MFU (lowers the forward pass to XLA once; off saves that time).
      profile_steps: (first, last): a TensorBoard profile of the loops between these steps,
        in `model_dir/train` (see `actions.Profile`).
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
        init_checkpoint: str | None = None,
        runtime: Runtime | None = None,
        actions: Sequence[actions_lib.Action] = (),
        count_flops: bool = True,
        profile_steps: Sequence[int] | None = None,
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
        checks.boolean("Trainer.count_flops", count_flops)
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
        self.count_flops = count_flops
        self.traces: collections.Counter[str] = collections.Counter()
        self._flops: tuple[float, float | None] | None = None  # per step, peak of all devices
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
            "run: model %s (%s parameters), data %s, global batch %d, remat %s, precision %s, %s",
            self.model.name,
            f"{self.model.count_params():,}",
            getattr(getattr(dataset_fn, "func", dataset_fn), "__name__", "?"),
            global_batch_size,
            remat_policy or "none",
            self.runtime.precision,
            type(self.optimizer).__name__.removeprefix("ReducedGradient"),
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

        self.run_state = None
        if model_dir is not None:
            self.run_state = RunState(
                model_dir,
                model=self.model,
                optimizer=self.optimizer,
                learning_rate_scale=self.learning_rate_scale,
                is_finite=self.state_is_finite,
                strategy=self.strategy,
                keep=keep_checkpoints,
                lease_seconds=lock_lease_seconds,
            )
        if init_checkpoint and (self.run_state is None or self.run_state.restored is None):
            with self.strategy.scope():
                warm_start.warm_start(self.model, init_checkpoint)
        elif init_checkpoint:
            logging.info("init_checkpoint not used: resuming from the run's own checkpoint")
        self.actions = [
            *actions_lib.built_in(
                model_dir,
                checkpoint_every=checkpoint_every or steps_per_loop,
                eval_every=eval_every,
                profile_steps=profile_steps,
                divergence_rollbacks=divergence_rollbacks,
                rollback_learning_rate_factor=rollback_learning_rate_factor,
            ),
            *actions,
        ]
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
        actions: `train` adds them, and measurements (`framework.planner`) call this directly."""
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
        """Runs one host loop of `num_steps` steps; returns its metrics (`step.loop_metrics`)."""
        start = time.perf_counter()
        tracker = memory.PeakTracker(self._memory_device, strict=False)
        with tracker if self._memory_device else contextlib.nullcontext():
            sums = self.run_steps(iterator, num_steps)
        return step.loop_metrics(
            sums,
            num_steps,
            time.perf_counter() - start,
            global_batch_size=self.global_batch_size,
            learning_rate=float(self.optimizer.learning_rate.numpy()),
            peak_bytes=tracker.result.peak_bytes if tracker.result else None,
            flops=self._flops,
        )

    def _count_flops(self) -> None:
        """Model FLOPs of a step (see `flops`) and the peak of the devices, once per trainer."""
        if self._flops is not None:
            return
        replicas = self.strategy.num_replicas_in_sync
        inputs = self.compiled_step()[1][0]
        per_replica, exact = flops.model_flops_per_step(self.model, inputs)
        peak, source = self.runtime.peak_flops_per_device(self.strategy)
        self._flops = (per_replica * replicas, peak and peak * replicas)
        logging.info(
            "model FLOPs per step: %.3g%s (3 x the forward pass's matmuls, counted in XLA's "
            "program); peak %s per device (%s)",
            per_replica * replicas,
            "" if exact else " or more (a loop's trip count is unknown)",
            f"{peak / 1e12:.3g} TFLOP/s" if peak else "unknown",
            source,
        )

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
        logging.info(
            "training from step %d to %d, %d steps per loop (the first loop compiles the step)",
            self.step,
            stop,
            self.steps_per_loop,
        )
        if self.count_flops:
            self._count_flops()
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
        """After SIGTERM, saves at a step all workers agree on and stops (`PreemptedError`)."""
        if self.run_state is not None:
            self.run_state.save_if_preempted()

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

    def write_text(self, name: str, text: str) -> None:
        """`text` as a TensorBoard text summary under `model_dir/train`, shown verbatim."""
        with self._writers["train"].as_default(step=self.step):
            tf.summary.text(name, "\n".join("    " + line for line in text.splitlines()))
        self._writers["train"].flush()

    def write_summaries(self, split: str, metrics: dict[str, float]) -> None:
        with self._writers[split].as_default(step=self.step):
            for name, value in metrics.items():
                tf.summary.scalar(name, value)
        self._writers[split].flush()
