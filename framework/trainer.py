"""The gin-configured trainer: strategy, XLA-compiled step, host loop, evaluation, checkpoints.

The same program runs on one CPU, on N logical CPUs, on a multi-GPU host and (with the strategy set)
on a TPU pod. Per replica, the forward and backward pass are one XLA program (`jit_compile=True`),
traced inside `strategy.run` so each replica compiles against its own variables (one trace shared by
the replicas reads replica 0's variables from the other devices, and fails).
Gradients are then summed across replicas once, clipped by their global norm and applied. A host
loop runs `steps_per_loop` steps in one `tf.function` over `tf.range`, so Python is entered once per
loop.

Gin touches only `Trainer`'s arguments: models, data sets and optimizers stay plain functions.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence

import gin
import keras
import numpy as np
import tensorflow as tf

from framework import checkpoints, checks, distribute, memory, optim, remat, run_lock, xla

PRECISIONS = {"float32": "float32", "bfloat16": "mixed_bfloat16"}


class TrainerError(RuntimeError):
    """A problem the user can fix (bad data, divergence, an unreadable checkpoint): no traceback."""


class PreemptedError(Exception):
    """SIGTERM arrived (a preempted TPU VM or GPU node): a checkpoint was saved at `step`."""

    def __init__(self, step: int):
        super().__init__(f"preempted: saved a checkpoint at step {step}; run again to resume")
        self.step = step


def _format_duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


@gin.configurable
class Trainer:
    """Builds a run from its configuration and trains, evaluates and checkpoints it in `model_dir`.

    `model_fn()` returns a Keras model mapping inputs to logits. `dataset_fn(split, batch_size, *,
    start_step, pipeline_id, num_pipelines, replicas_per_pipeline)` returns batches of the
    per-replica `batch_size`, each (inputs, integer labels) or (inputs, labels, weights): an endless
    stream for "train" that starts at global step `start_step`, and a finite held-out set for
    "eval". The loss is the weighted mean cross-entropy over the global batch. `remat_policy`
    (a name from `remat.policy_names()` or a policy) checkpoints the model's repeated blocks.
    """

    def __init__(
        self,
        model_dir: str,
        *,
        model_fn: Callable[[], keras.Model] = gin.REQUIRED,
        dataset_fn: Callable[..., tf.data.Dataset] = gin.REQUIRED,
        global_batch_size: int = 128,
        train_steps: int = 1000,
        steps_per_loop: int = 100,
        eval_every: int | None = None,
        checkpoint_every: int | None = None,
        keep_checkpoints: int = 3,
        lock_lease_seconds: float = run_lock.DEFAULT_LEASE_SECONDS,
        learning_rate: float = 1e-3,
        warmup_steps: int = 0,
        weight_decay: float = 0.05,
        clip_norm: float | None = 1.0,
        divergence_rollbacks: int = 0,
        rollback_learning_rate_factor: float = 0.5,
        precision: str = "float32",
        remat_policy: str | remat.policies.Policy | None = None,
        strategy: str = "one_device",
        cpu_devices: int | None = None,
        collectives: str = "auto",
        tpu: str | None = None,
        tpu_node: bool = False,
        xla_flags: Sequence[str] = (),
        tf_xla_flags: Sequence[str] = (),
        libtpu_flags: Sequence[str] = (),
        seed: int = 0,
    ):
        if precision not in PRECISIONS:
            raise ValueError(
                f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}"
            )
        # Gin passes any value: check types and ranges before anything is built.
        checks.integer("Trainer.global_batch_size", global_batch_size)
        checks.integer("Trainer.train_steps", train_steps)
        checks.integer("Trainer.steps_per_loop", steps_per_loop)
        checks.integer("Trainer.eval_every", eval_every, optional=True)
        checks.integer("Trainer.checkpoint_every", checkpoint_every, optional=True)
        checks.integer("Trainer.keep_checkpoints", keep_checkpoints, optional=True)
        checks.integer("Trainer.warmup_steps", warmup_steps, minimum=0)
        checks.integer("Trainer.cpu_devices", cpu_devices, optional=True)
        checks.integer("Trainer.seed", seed, minimum=0)
        checks.number("Trainer.learning_rate", learning_rate)
        checks.number("Trainer.weight_decay", weight_decay, inclusive=True)
        checks.number("Trainer.clip_norm", clip_norm, optional=True)
        checks.integer("Trainer.divergence_rollbacks", divergence_rollbacks, minimum=0)
        checks.number(
            "Trainer.rollback_learning_rate_factor", rollback_learning_rate_factor, maximum=1.0
        )
        checks.boolean("Trainer.tpu_node", tpu_node)
        checks.number("Trainer.lock_lease_seconds", lock_lease_seconds)
        xla.set_xla_flags(xla_flags, tf_xla_flags, libtpu_flags)
        self.strategy = distribute.create_strategy(
            strategy, cpu_devices, collectives=collectives, tpu=tpu, tpu_node=tpu_node
        )
        self.is_chief = distribute.is_chief(self.strategy)
        # One writer per model_dir, taken before anything is built or written.
        self._lock = run_lock.RunLock(model_dir, lease_seconds=lock_lease_seconds)
        if self.is_chief:
            try:
                self._lock.acquire()
            except run_lock.LockError as error:
                raise TrainerError(str(error)) from None
        replicas = self.strategy.num_replicas_in_sync
        if global_batch_size % replicas:
            raise ValueError(
                f"global_batch_size {global_batch_size} does not split over {replicas} replicas"
            )
        self.model_dir = model_dir
        self.dataset_fn = dataset_fn
        self.global_batch_size = global_batch_size
        self.train_steps = train_steps
        self.steps_per_loop = steps_per_loop
        self.eval_every = eval_every
        self.checkpoint_every = checkpoint_every or steps_per_loop
        self.clip_norm = clip_norm
        self._rollbacks_left = divergence_rollbacks
        self._rollback_factor = rollback_learning_rate_factor
        self.traces: collections.Counter[str] = collections.Counter()
        # Peak memory is logged per loop for the first replica's device, if its allocator counts.
        self._memory_device = distribute.first_device(self.strategy)
        if not memory.keeps_statistics(self._memory_device):
            logging.info("peak memory not logged: %s keeps no statistics", self._memory_device)
            self._memory_device = None

        keras.config.set_dtype_policy(PRECISIONS[precision])
        keras.utils.set_random_seed(seed)
        with self.strategy.scope():
            self.model = model_fn()
            if remat_policy is not None:
                blocks = remat.set_grad_checkpointing(self.model, policy=remat_policy)
                logging.info("remat policy %s on %d blocks", remat_policy, len(blocks))
            # Lowered by a divergence rollback; saved with the checkpoints so a restart keeps it.
            self.learning_rate_scale = tf.Variable(1.0, trainable=False, name="lr_scale")
            self.optimizer = optim.adamw(
                learning_rate,
                train_steps,
                warmup_steps=warmup_steps,
                weight_decay=weight_decay,
                scale=self.learning_rate_scale,
            )
            self.optimizer.build(self.model.trainable_variables)
        logging.info(
            "model %s: %s parameters, precision %s",
            self.model.name,
            f"{self.model.count_params():,}",
            precision,
        )

        # Every worker restores from model_dir and saves (saving is collective), but only the
        # chief writes into model_dir: the others write to a temporary directory of their own.
        self._finite_state: Callable | None = None
        self.checkpoint_dir = os.path.join(model_dir, "checkpoints")
        self._restore(at_start=True)  # first: it repairs the index the manager reads
        write_dir = self.checkpoint_dir if self.is_chief else tempfile.mkdtemp(prefix="ckpt-")
        self.checkpoints = tf.train.CheckpointManager(
            tf.train.Checkpoint(
                model=self.model,
                optimizer=self.optimizer,
                learning_rate_scale=self.learning_rate_scale,
            ),
            write_dir,
            max_to_keep=keep_checkpoints,
            step_counter=self.optimizer.iterations,
        )
        # TensorFlow's handler makes all workers agree on the step to save at after a SIGTERM.
        self._preemption = tf.distribute.experimental.PreemptionCheckpointHandler(
            self.strategy.cluster_resolver,
            self.checkpoints,
            termination_config=tf.distribute.experimental.TerminationConfig(
                exit_fn=self._preempted
            ),
        )
        # Built now, so a bad data configuration fails before training and gin records it.
        self._eval_dataset = self._distributed_dataset("eval")
        self._train_loop = tf.function(self._train_loop_fn)
        self._eval_loop = tf.function(self._eval_loop_fn)
        self._writers = {
            split: tf.summary.create_file_writer(os.path.join(model_dir, split))
            if self.is_chief
            else tf.summary.create_noop_writer()
            for split in ("train", "eval")
        }

    @property
    def step(self) -> int:
        return int(self.optimizer.iterations.numpy())

    def _restore(self, at_start: bool) -> str | None:
        """Restores the newest checkpoint in model_dir that restores and is finite; returns it.

        Checkpoints are found from their files, not only from the index file, so a lost index
        is not a fresh start; a damaged checkpoint (TensorFlow checks each tensor's checksum)
        or a non-finite one is skipped for the one before it; and a model_dir whose checkpoints
        all fail stops the run (TrainerError) instead of starting over them.
        """
        listing = checkpoints.list_checkpoints(self.checkpoint_dir)
        if at_start and self.is_chief:  # the lock is held: no save is running
            for path in checkpoints.remove_temporary(listing):
                logging.info("removed %s, left by an interrupted save", path)

        def restore(prefix: str) -> None:
            tf.train.Checkpoint(model=self.model, optimizer=self.optimizer).restore(
                prefix
            ).assert_existing_objects_matched().expect_partial()  # (the rest: below, TF's own)
            # Apart, as checkpoints written before it existed lack it (they mean a scale of 1).
            self.learning_rate_scale.assign(1.0)
            tf.train.Checkpoint(learning_rate_scale=self.learning_rate_scale).restore(
                prefix
            ).expect_partial()
            if not self._state_is_finite():
                raise ValueError("it holds non-finite values (saved by a diverged run)")

        try:
            restored = checkpoints.restore_newest(listing, restore)
        except checkpoints.CheckpointError as error:
            raise TrainerError(str(error)) from None
        if restored is None:
            logging.info("no checkpoint in %s: starting from scratch", self.checkpoint_dir)
            return None
        if at_start and self.is_chief and checkpoints.repair_index(listing, restored):
            logging.warning("rewrote %s/checkpoint to name %s", self.checkpoint_dir, restored)
        logging.info("restored step %d from %s", self.step, restored)
        if at_start and float(self.learning_rate_scale.numpy()) != 1.0:
            logging.warning(
                "the learning rate is scaled by %g, as divergence rollbacks left it (saved with "
                "the checkpoints): it multiplies Trainer.learning_rate's schedule",
                float(self.learning_rate_scale.numpy()),
            )
        return restored

    def _distributed_dataset(self, split: str, start_step: int = 0):
        def dataset_for_pipeline(context: tf.distribute.InputContext) -> tf.data.Dataset:
            return self.dataset_fn(
                split,
                context.get_per_replica_batch_size(self.global_batch_size),
                start_step=start_step,
                pipeline_id=context.input_pipeline_id,
                num_pipelines=context.num_input_pipelines,
                replicas_per_pipeline=context.num_replicas_in_sync // context.num_input_pipelines,
            )

        return self.strategy.distribute_datasets_from_function(dataset_for_pipeline)

    def _sums(self, batch, training: bool):
        """Weighted sums of the loss, of correct predictions and of the weights over one batch.

        A batch is (inputs, labels) or (inputs, labels, weights): labels of any rank (one per
        image, or one per token), weights 0 where a label does not count (padding).
        """
        inputs, labels, weights = batch if len(batch) == 3 else (*batch, None)
        weights = tf.ones(tf.shape(labels)) if weights is None else tf.cast(weights, tf.float32)
        logits = tf.cast(self.model(inputs, training=training), tf.float32)
        losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        hits = tf.equal(tf.argmax(logits, -1, output_type=labels.dtype), labels)
        return (
            tf.reduce_sum(losses * weights),
            tf.reduce_sum(tf.cast(hits, tf.float32) * weights),
            tf.reduce_sum(weights),
        )

    def _gradients(self, batch):
        """Forward and backward pass of one replica: the part XLA compiles."""
        self.traces["train_step"] += 1
        variables = self.model.trainable_variables
        with tf.GradientTape() as tape:
            loss_sum, correct, count = self._sums(batch, training=True)
        return loss_sum, correct, count, tape.gradient(loss_sum, variables)

    def _replica_train_step(self, batch):
        # Created here, inside the replica function, so each replica traces its own program.
        loss_sum, correct, count, grads = tf.function(self._gradients, jit_compile=True)(batch)
        # One all-reduce: the summed gradients and the global count that turns them into a mean.
        grads, total = tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, (grads, count)
        )
        grads = [g / tf.maximum(total, 1.0) for g in grads]
        norm = tf.linalg.global_norm(grads)
        if self.clip_norm:
            grads, _ = tf.clip_by_global_norm(grads, self.clip_norm, use_norm=norm)
        self.optimizer.apply(grads, self.model.trainable_variables)
        return loss_sum, correct, count, norm

    def _replica_eval_step(self, batch):
        return tf.function(lambda b: self._sums(b, training=False), jit_compile=True)(batch)

    def _sum(self, per_replica):
        return self.strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    def _train_loop_fn(self, iterator, num_steps):
        """Runs `num_steps` steps; returns the sums of loss, correct, count and gradient norm."""
        totals = tf.zeros([4])
        for _ in tf.range(num_steps):
            *sums, norm = self.strategy.run(self._replica_train_step, args=(next(iterator),))
            norm = self.strategy.experimental_local_results(norm)[0]  # the same on every replica
            totals += tf.stack([*(self._sum(x) for x in sums), norm])
        return totals

    def _eval_loop_fn(self, dataset):
        totals = tf.zeros([3])
        for batch in dataset:
            totals += tf.stack(
                [self._sum(x) for x in self.strategy.run(self._replica_eval_step, args=(batch,))]
            )
        return totals

    def evaluate(self) -> dict[str, float]:
        """Loss and accuracy on the whole held-out split; written to the eval summaries."""
        loss_sum, correct, count = self._eval_loop(self._eval_dataset).numpy()
        if count == 0:
            raise TrainerError("the eval data set is empty: give it at least one global batch")
        metrics = {"loss": loss_sum / count, "accuracy": correct / count}
        self._write_summaries("eval", metrics)
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
        """Runs `num_steps` compiled train steps; returns the sums of loss, correct, count and
        gradient norm. No logging, checkpoints or summaries: `train` adds those, and memory
        and speed measurements (`framework.plan`) call this directly."""
        try:
            return self._train_loop(iterator, tf.constant(num_steps)).numpy()
        except tf.errors.OutOfRangeError:
            raise TrainerError(
                f"the training data ran out at step {self.step}: dataset_fn('train', ...) "
                "must repeat forever (or hold at least train_steps batches)"
            ) from None

    def compiled_step(self):
        """The per-replica forward and backward pass as XLA compiles it, and a batch to call it
        with: what `memory.compiled_bytes` reads XLA's buffer assignment of."""
        batch_size = self.global_batch_size // self.strategy.num_replicas_in_sync
        dataset = self.dataset_fn(
            "train",
            batch_size,
            start_step=0,
            pipeline_id=0,
            num_pipelines=1,
            replicas_per_pipeline=1,
        )
        batch = next(iter(dataset))
        return tf.function(self._gradients, jit_compile=True), batch

    def train(self, max_steps: int | None = None) -> dict[str, float]:
        """Trains from the current step to `train_steps` and returns the last loop's metrics.

        `max_steps` stops earlier, after that many steps, as an interrupted run would: the learning
        rate schedule still follows `train_steps`, and a later run resumes from the checkpoint.
        """
        start = self.step
        stop = self.train_steps if max_steps is None else min(self.train_steps, start + max_steps)
        if start >= stop:
            logging.info("at step %d of %d: nothing to train", start, self.train_steps)
            return {}
        iterator = self.train_iterator()
        metrics: dict[str, float] = {}
        run_start = time.perf_counter()
        while self.step < stop:
            steps = min(self.steps_per_loop, stop - self.step)
            loop_start = time.perf_counter()
            tracker = memory.PeakTracker(self._memory_device, strict=False)
            with tracker if self._memory_device else contextlib.nullcontext():
                loss_sum, correct, count, norm_sum = self.run_steps(iterator, steps)
            seconds = time.perf_counter() - loop_start
            examples = steps * self.global_batch_size
            metrics = {
                "loss": loss_sum / count,
                "accuracy": correct / count,
                "grad_norm": norm_sum / steps,
                "learning_rate": float(self.optimizer.learning_rate.numpy()),
                "steps_per_sec": steps / seconds,
                "examples_per_sec": examples / seconds,
                "targets_per_sec": count / seconds,
            }
            if tracker.result is not None:
                metrics["peak_memory_mib"] = tracker.result.peak_bytes / 2**20
            if not (math.isfinite(metrics["loss"]) and self._state_is_finite()):
                self._roll_back(metrics["loss"])  # or raises
                start, run_start = self.step, time.perf_counter()
                iterator = self.train_iterator()
                continue
            self._write_summaries("train", metrics)
            remaining = (stop - self.step) / max(
                (self.step - start) / (time.perf_counter() - run_start), 1e-9
            )
            logging.info(
                "step %d/%d: loss %.4f, accuracy %.3f, %.2f steps/s, %.0f examples/s, "
                "peak memory %s, ETA %s",
                self.step,
                self.train_steps,
                metrics["loss"],
                metrics["accuracy"],
                metrics["steps_per_sec"],
                metrics["examples_per_sec"],
                f"{metrics['peak_memory_mib']:.0f} MiB" if "peak_memory_mib" in metrics else "n/a",
                _format_duration(remaining),
            )
            if self.step % self.checkpoint_every == 0 or self.step >= stop:
                self._check_lock()  # (on gs:// a read: only when a save is due)
                self.checkpoints.save(checkpoint_number=self.step)
            self._preemption.save_checkpoint_if_preempted(checkpoint_number=self.step)
            if (
                self.eval_every
                and self.step % self.eval_every == 0
                and self.step < self.train_steps
            ):
                self.evaluate()
        return metrics

    def train_and_evaluate(self) -> dict[str, float]:
        """Trains to `train_steps` (evaluating every `eval_every` steps), then evaluates."""
        self.train()
        return self.evaluate()

    def save_interrupted(self) -> str | None:
        """Saves the current step after Ctrl-C, so that the same command resumes there rather
        than at the last periodic checkpoint; returns the checkpoint holding this step, or None.

        The step counter and the weights change together, only inside a compiled loop, so a built
        trainer is always at a loop boundary. Not saved: step 0 (nothing trained), a non-finite
        state (never saved, see `_roll_back`), and a run of several workers, whose saving is
        collective (one worker alone would wait for the others forever; they save on SIGTERM).
        """
        resolver = self.strategy.cluster_resolver
        tasks = resolver.cluster_spec().as_dict() if resolver else {}
        if sum(map(len, tasks.values())) > 1 or self.step == 0 or not self._state_is_finite():
            return None
        self._check_lock()
        latest = self.checkpoints.latest_checkpoint
        if latest is not None and latest.endswith(f"-{self.step}"):
            return latest
        return self.checkpoints.save(checkpoint_number=self.step)

    def _preempted(self) -> None:
        raise PreemptedError(self.step)

    def _roll_back(self, loss: float) -> None:
        """Handles a diverged loop, whose state is never saved: a finite loss is not enough, as
        the loop's last update may already have made the weights or the optimizer state
        non-finite. With `divergence_rollbacks` left, restores the newest finite checkpoint and
        scales the learning rate by `rollback_learning_rate_factor`, as large-scale trainers
        do; otherwise stops with a TrainerError that names the checkpoint to resume from."""
        what = (
            f"the loss became {loss}"
            if not math.isfinite(loss)
            else "the weights became non-finite"
        )
        if self._rollbacks_left > 0:
            diverged_at, scale = self.step, float(self.learning_rate_scale.numpy())
            restored = self._restore(at_start=False)
            if restored is not None:
                self._rollbacks_left -= 1
                # Lower than before the rollback, not only than the checkpoint's: a run that
                # diverges again before its next save rolls back to the same checkpoint.
                restored_scale = float(self.learning_rate_scale.numpy())
                self.learning_rate_scale.assign(min(scale, restored_scale) * self._rollback_factor)
                logging.warning(
                    "%s before step %d: rolled back to %s with the learning rate scaled by "
                    "%g (now %g of the schedule); %d rollback(s) left",
                    what,
                    diverged_at,
                    restored,
                    self._rollback_factor,
                    float(self.learning_rate_scale.numpy()),
                    self._rollbacks_left,
                )
                return
        latest = self._newest_finite_checkpoint()
        kept = (
            f"the last good checkpoint {latest} is kept"
            if latest
            else "no finite checkpoint exists"
        )
        raise TrainerError(
            f"{what} before step {self.step}: training diverged and this state was not saved; "
            f"{kept}. Lower Trainer.learning_rate, raise Trainer.warmup_steps or set "
            "Trainer.clip_norm (or Trainer.divergence_rollbacks), and run again to resume from it."
        )

    def _state_is_finite(self) -> bool:
        """Whether every floating-point variable of the model and the optimizer is finite: one
        reduction on the device, cheap next to a step."""
        if self._finite_state is None:
            variables = [
                v
                for v in self.model.variables + self.optimizer.variables
                if tf.as_dtype(v.dtype).is_floating
            ]

            def finite():
                return tf.reduce_all(
                    tf.stack([tf.reduce_all(tf.math.is_finite(v)) for v in variables])
                )

            self._finite_state = tf.function(finite)
        return bool(self._finite_state())

    def _check_lock(self) -> None:
        """Stops before a save if another run took model_dir over (see `run_lock`)."""
        if self.is_chief:
            try:
                self._lock.check()
            except run_lock.LockError as error:
                raise TrainerError(str(error)) from None

    def _newest_finite_checkpoint(self) -> str | None:
        """The newest checkpoint in model_dir whose floating-point values are all finite (one
        written before this check existed may not be)."""
        for path in reversed(checkpoints.list_checkpoints(self.checkpoint_dir).committed):
            try:
                reader = tf.train.load_checkpoint(path)
                values = (reader.get_tensor(name) for name in reader.get_variable_to_shape_map())
                if all(
                    np.isfinite(v).all()
                    for v in values
                    if np.issubdtype(np.asarray(v).dtype, np.floating)
                ):
                    return path
            except (tf.errors.OpError, ValueError) as error:
                logging.warning("cannot read checkpoint %s: %s", path, error)
        return None

    def _write_summaries(self, split: str, metrics: dict[str, float]) -> None:
        with self._writers[split].as_default(step=self.step):
            for name, value in metrics.items():
                tf.summary.scalar(name, value)
        self._writers[split].flush()
