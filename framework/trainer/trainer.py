"""The trainer: the composition of a runtime, a model, a step, data and actions.

The same program runs on one CPU, on N logical CPUs, on a multi-GPU host and (with the runtime
set) on a TPU pod. The step (`train_step.py`) is one XLA program per replica; the host loop
runs `steps_per_loop` steps in one `tf.function`, then the actions (`actions.py`: divergence
check, summaries, progress, checkpoints, preemption, evaluation, and the user's own), which see
the loop through `actions.Loop` rather than the trainer. With `shard_state`, the weights'
shards and the optimizer's state are a `shard.ShardedState`'s, and the model's own trainable
weights are replicated copies (or, at the "weights" level, a copy on the host, written back
after training and restores). The run's directory (lock,
checkpoints, restore) is `framework.rundir`; what the run is told, checked and bound by gin as
`Trainer.*`, is `settings.TrainerSettings`.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Sequence

import keras
import numpy as np
import tensorflow as tf

import framework.configurables  # noqa: F401  (registers the library's gin names)
from framework import memory, remat, shard
from framework.core import tf_internals
from framework.core.errors import TrainerError
from framework.data import positions, sharding
from framework.remat.policies import MASK_BITS
from framework.rundir.run_state import RunState
from framework.runtime import Runtime, distribute, flops
from framework.trainer import actions as actions_lib
from framework.trainer import optim, train_step, warm_start
from framework.trainer.settings import TrainerSettings
from framework.trainer.summaries import Summaries


class Trainer:
    """Builds a run from its settings and trains, evaluates and checkpoints it.

    `model_dir` is where checkpoints, summaries and the lock live; None trains in memory only
    (nothing restored or written: what the planner and benchmarks use). The settings are
    `TrainerSettings`'s fields, as keywords or bound by gin (`Trainer.train_steps = 100`).
    `extra_actions` run after the configured ones: what a binary adds to the run it builds
    (`framework.train`'s memory watch for `remat_policy = "auto"`).
    """

    def __init__(
        self,
        model_dir: str | None,
        *,
        extra_actions: Sequence[actions_lib.Action] = (),
        **settings,
    ):
        self.settings = s = TrainerSettings(**settings)
        self.model_dir = model_dir
        self.runtime = s.runtime or Runtime()
        self.strategy = self.runtime.start()
        self.is_chief = distribute.is_chief(self.strategy)
        s.check_replicas(self.strategy.num_replicas_in_sync)
        self.traces: collections.Counter[str] = collections.Counter()
        self.flops: tuple[float, float | None] | None = None  # per step, peak of all devices
        # Peak memory is logged per loop for the first replica's device, if its allocator counts.
        self._memory_device = memory.counting_device(distribute.first_device(self.strategy))

        keras.utils.set_random_seed(s.seed)
        with self.strategy.scope():
            with self._weights_placement():
                self.model = s.model_fn()
                if not self.model.built:
                    _build(self.model, sharding.features_spec(s.dataset_fn, s.global_batch_size))
            _check_float32_weights(self.model)
            if s.remat_policy is not None:
                # A memory budget prices kept masks as this device's compiler stores them.
                bits = MASK_BITS.get(distribute.device_type(self.strategy), 1)
                policy = remat.get_policy(s.remat_policy, mask_bits=bits)
                blocks = remat.set_grad_checkpointing(self.model, policy=policy)
                if not blocks and policy is not remat.policies.everything_saveable:  # ('none')
                    raise ValueError(
                        f"remat_policy={s.remat_policy!r} found nothing to checkpoint in "
                        f"{self.model.name!r} (no repeated blocks, and no place to cut its "
                        "layer graph): train it with remat_policy=None"
                    )
                logging.info("remat policy %s on %d blocks", s.remat_policy, len(blocks))
            self.optimizer, self.learning_rate_scale = optim.scheduled_optimizer(
                s.optimizer_fn, s.learning_rate, s.warmup_steps, s.train_steps, s.weight_decay
            )
        # The optimizer is built on the weights, or on their shards (`shard.ShardedState`).
        self.sharded: shard.ShardedState | None = None
        if s.shard_state == "none":
            with self.strategy.scope():
                self.optimizer.build(self.model.trainable_variables)
        else:
            self.sharded = shard.ShardedState(
                s.shard_state, self.strategy, self.model, self.optimizer
            )
        data = getattr(getattr(s.dataset_fn, "func", s.dataset_fn), "__name__", "?")
        optimizer = type(self.optimizer).__name__.removeprefix("ReducedGradient")
        logging.info(
            f"run: model {self.model.name} ({self.model.count_params():,} parameters), data "
            f"{data}, global batch {s.global_batch_size}, remat {s.remat_policy or 'none'}, "
            f"sharded state {s.shard_state}, precision {self.runtime.precision}, {optimizer}"
        )
        state = self.model.variables + self.optimizer.variables
        if self.sharded is not None:
            state = self.sharded.state_variables()
        self._is_finite = train_step.make_finite_check(self.strategy, state)
        loop_settings = dict(
            loss_fn=s.loss_fn,
            clip_norm=s.clip_norm,
            microbatches=s.microbatches,
            sharded=self.sharded,
        )
        self._train_loop = train_step.make_train_loop(
            self.strategy, self.model, self.optimizer, **loop_settings, traces=self.traces
        )
        self._eval_loop = train_step.make_eval_loop(
            self.strategy, self.model, loss_fn=s.loss_fn, sharded=self.sharded
        )

        # Where each step's batch begins in the training stream, for a dataset_fn whose stream a
        # step cannot address (packed text): saved with the checkpoints, so that a resumed run
        # starts reading there. Created outside the strategy's scope: one plain variable.
        self._stream_positions = None
        if sharding.takes_stream_positions(s.dataset_fn) and distribute.pipelines_run_here(
            self.strategy
        ):
            self._stream_positions = positions.StreamPositions()
        self.run_state = None
        if model_dir is not None:
            self.run_state = RunState(
                model_dir,
                model=self.model,
                optimizer=self.optimizer,
                learning_rate_scale=self.learning_rate_scale,
                is_finite=self.state_is_finite,
                strategy=self.strategy,
                keep=s.keep_checkpoints,
                lease_seconds=s.lock_lease_seconds,
                replaced=self.sharded.checkpoint_replacements() if self.sharded else {},
                on_restore=self.sharded.write_model if self.sharded else None,
            )
        if s.init_checkpoint and not (self.run_state and self.run_state.restored):
            with self.strategy.scope():
                warm_start.warm_start(self.model, s.init_checkpoint)
            if self.sharded is not None:
                self.sharded.read_model()
        elif s.init_checkpoint:
            logging.info("init_checkpoint not used: resuming from the run's own checkpoint")
        self.actions = (*actions_lib.built_in(model_dir, s), *s.actions, *extra_actions)
        # Built now, so a bad data configuration fails before training (and before the summary
        # writers make directories in model_dir) and gin records it; the training split from
        # the step the run starts at, which the first `train_iterator` reads.
        self._eval_dataset = self._dataset("eval")
        self._first_train_dataset = (self.step, self._train_dataset())
        self.summaries = Summaries(model_dir if self.is_chief else None)

    def _weights_placement(self):
        """Where the model's trainable weights are made: at the "weights" shard level one copy
        on the host (each replica's device holds shards only), else the strategy's way."""
        if self.settings.shard_state != "weights":
            return contextlib.nullcontext()
        return tf_internals.trainable_variables_on(shard.host_of(self.strategy))

    @property
    def step(self) -> int:
        return int(self.optimizer.iterations.numpy())

    def state_is_finite(self) -> bool:
        """Whether every floating-point variable of the model and the optimizer is finite."""
        return bool(self._is_finite())

    def _dataset(
        self,
        split: str,
        start_step: int = 0,
        stream_positions: positions.StreamPositions | None = None,
    ) -> tf.distribute.DistributedDataset:
        batch, dataset_fn = self.settings.global_batch_size, self.settings.dataset_fn
        return sharding.distribute(
            self.strategy,
            dataset_fn,
            split,
            global_batch_size=batch,
            start_step=start_step,
            stream_positions=stream_positions,
        )

    def evaluate(self) -> dict[str, float]:
        """Loss and accuracy on the whole held-out split; written to the eval summaries."""
        loss_sum, correct, count = self._eval_loop(self._eval_dataset).numpy()
        if count == 0:
            raise TrainerError("the eval data set is empty: give it at least one global batch")
        metrics = {"loss": loss_sum / count, "accuracy": correct / count}
        self.summaries.scalars("eval", self.step, metrics)
        logging.info(
            "eval at step %d: loss %.4f, accuracy %.4f on %d targets",
            *(self.step, metrics["loss"], metrics["accuracy"], count),
        )
        return metrics

    def train_iterator(self):
        """An iterator over the distributed training data, from the current step on (reading
        from the restored checkpoint's stream positions where it holds them)."""
        first, self._first_train_dataset = self._first_train_dataset, None
        if first is not None and first[0] == self.step:
            return iter(first[1])
        return iter(self._train_dataset())

    def _train_dataset(self) -> tf.distribute.DistributedDataset:
        if self._stream_positions is not None and self.run_state is not None:
            self._stream_positions.saved = self.run_state.saved_data_position
        return self._dataset("train", self.step, self._stream_positions)

    def _note_stream_position(self) -> None:
        """Keeps the checkpoint's stream positions at the current step: this process's, or
        every worker's (a collective, as each loop ends on all workers)."""
        if self._stream_positions is None or self.run_state is None:
            return
        row = self._stream_positions.of_step(self.step)
        workers = self.run_state.workers
        rows = row[None] if workers == 1 else distribute.gather_workers(self.strategy, row)
        self.run_state.set_data_position(rows)

    def run_steps(self, iterator, num_steps: int) -> np.ndarray:
        """Runs `num_steps` compiled train steps; returns the sums of `train_step.TRAIN_SUMS`. No
        actions: `train` adds them, and measurements (`framework.planner`) call this directly."""
        try:
            return self._train_loop(iterator, tf.constant(num_steps)).numpy()
        except tf.errors.OutOfRangeError:
            raise TrainerError(
                f"the training data ran out at step {self.step}: dataset_fn('train', ...) "
                "must repeat forever (or hold at least train_steps batches)"
            ) from None

    def compiled_step(
        self,
        global_batch_size: int | None = None,
        planned: shard.ShardedState | None = None,
        in_program: bool | None = None,
    ) -> tuple:
        """One replica's forward and backward pass as XLA compiles it, and the arguments to call
        it with (a batch of `global_batch_size`, the run's by default; and at the "weights"
        shard level on CPUs and GPUs the gathered weights): what `memory.compiled_bytes(fn,
        *args)` reads XLA's buffer assignment of. `planned` is another sharded state to plan
        the step of (the planner's, cut for a slice larger than this run's devices), and
        `in_program` whether its collectives run inside the program (by default: on TPUs)."""
        s = self.settings
        batch_size = global_batch_size or s.global_batch_size
        per_replica = batch_size // self.strategy.num_replicas_in_sync
        batch = next(iter(s.dataset_fn("train", global_batch_size=per_replica)))
        sharded = planned or self.sharded
        if in_program is None:
            in_program = train_step.runs_as_one_program(self.strategy)
        fn = train_step.compiled_gradients(
            self.model, s.loss_fn, s.microbatches, sharded=sharded, in_program=in_program
        )
        if train_step.gathers_between_programs(sharded, in_program):
            # The gathered weights are the whole weights: their values (here, the model's)
            # do not change the program.
            return fn, (batch, [tf.convert_to_tensor(v) for v in self.model.trainable_variables])
        return fn, (batch,)

    def run_loop(self, iterator, num_steps: int) -> dict[str, float]:
        """Runs one host loop of `num_steps` steps; returns its metrics
        (`train_step.loop_metrics`)."""
        start = time.perf_counter()
        tracker = memory.PeakTracker(self._memory_device, strict=False)
        with tracker if self._memory_device else contextlib.nullcontext():
            sums = self.run_steps(iterator, num_steps)
        metrics = train_step.loop_metrics(
            sums,
            num_steps,
            time.perf_counter() - start,
            global_batch_size=self.settings.global_batch_size,
            learning_rate=float(self.optimizer.learning_rate.numpy()),
            peak_bytes=tracker.result.peak_bytes if tracker.result else None,
            flops=self.flops,
        )
        if metrics.get("mfu", 0.0) > 1.0:
            self._raise_peak(metrics)
        return metrics

    def _raise_peak(self, metrics: dict[str, float]) -> None:
        """A loop faster than the devices' peak shows that the peak is low: on a CPU it is
        measured once at start, and a busy machine then reads it low. The loop's own rate is a
        reading of the peak too, so the peak becomes the largest seen and MFU never exceeds 1."""
        flops_per_step, peak = self.flops
        achieved = metrics["mfu"] * peak
        logging.warning(
            "this loop ran at %.3g TFLOP/s of model FLOPs, above the peak of %.3g TFLOP/s taken "
            "at start (read while the machine was busy, or set too low): MFU is relative to "
            "the fastest rate seen from now on",
            achieved / 1e12,
            peak / 1e12,
        )
        self.flops = (flops_per_step, achieved)
        metrics["mfu"] = 1.0

    def train(self, max_steps: int | None = None) -> dict[str, float]:
        """Trains from the current step to `train_steps` and returns the last loop's metrics.

        `max_steps` stops earlier, after that many steps, as an interrupted run would: the learning
        rate schedule still follows `train_steps`, and a later run resumes from the checkpoint.
        """
        end = self.settings.train_steps
        stop = end if max_steps is None else min(end, self.step + max_steps)
        if self.step >= stop:
            logging.info("at step %d of %d: nothing to train", self.step, end)
            return {}
        logging.info(
            "training from step %d to %d, %d steps per loop (the first loop compiles the step)",
            *(self.step, stop, self.settings.steps_per_loop),
        )
        if self.settings.count_flops and self.flops is None:
            replicas = self.strategy.num_replicas_in_sync
            peak = self.runtime.peak_flops_per_device(self.strategy)
            batch = self.compiled_step()[1][0]
            self.flops = flops.count_step(self.model, batch[0], replicas, *peak)
        iterator = self.train_iterator()
        metrics: dict[str, float] = {}
        loop = _LoopView(self)
        while self.step < stop and loop.stopped is None:
            metrics = self.run_loop(iterator, min(self.settings.steps_per_loop, stop - self.step))
            self._note_stream_position()
            for action in self.actions:
                action(loop, metrics)
                if loop.rolled_back:  # the other actions would see the restored state
                    loop.rolled_back = False
                    iterator = self.train_iterator()
                    break
        if loop.stopped is not None:
            logging.info("stopped at step %d: %s", self.step, loop.stopped)
        self.save()  # the last step, whatever the checkpoint interval
        if self.sharded is not None and self.sharded.level == "weights":
            self.sharded.write_model()  # the model is current again where the run hands it on
        return metrics

    def train_and_evaluate(self) -> dict[str, float]:
        """Trains to `train_steps` (evaluating every `eval_every` steps), then evaluates."""
        self.train()
        return self.evaluate()

    def save(self) -> str | None:
        """Saves the current step to model_dir (once); None without a model_dir."""
        return self.run_state.save() if self.run_state else None


def _build(model: keras.Model, features) -> None:
    """Builds a model that has no weights yet (a `keras.Sequential` without an `Input`, a
    subclassed model before its first call) as Keras' `fit` does, by calling it once, here on
    zeros shaped as one example of the data, in inference mode (no statistics or random state
    move). `features`: the data's feature specs (a nest of `tf.TensorSpec`). Remat, sharded state
    and checkpoints need the weights before the first step."""

    def one_example(spec: tf.TensorSpec) -> tf.Tensor:
        if not spec.shape[1:].is_fully_defined():
            raise TrainerError(
                f"cannot build the model {model.name!r} on the data's features of shape "
                f"{spec.shape}: give it its input shape (keras.Input first in a Sequential, or "
                "model.build in Trainer.model_fn)"
            )
        return tf.zeros([1, *spec.shape[1:]], spec.dtype)

    model(tf.nest.map_structure(one_example, features), training=False)


def _check_float32_weights(model: keras.Model) -> None:
    """Raises ValueError for weights in another type than float32: the step sums, clips and
    all-reduces gradients in float32, and a bfloat16 weight would lose small updates."""
    other = [v for v in model.trainable_variables if v.dtype != "float32"]
    if other:
        named = getattr(other[0], "path", other[0].name)
        more = f" and {len(other) - 1} more" if len(other) > 1 else ""
        raise ValueError(
            f"the model has {other[0].dtype} weights ({named}{more}): the trainer keeps weights "
            "in float32; for bfloat16 compute set Runtime.precision = 'bfloat16' (float32 "
            "weights) and leave the layers' dtype unset"
        )


class _LoopView(actions_lib.Loop):
    """The trainer as its actions see it (`actions.Loop`): the step, the settings, the model
    directory and the operations an action may ask for; whether one rolled back or stopped."""

    def __init__(self, trainer: Trainer):
        self._trainer = trainer
        self.rolled_back = False
        self.stopped: str | None = None

    @property
    def step(self) -> int:
        return self._trainer.step

    @property
    def settings(self) -> TrainerSettings:
        return self._trainer.settings

    @property
    def model_dir(self) -> str | None:
        return self._trainer.model_dir

    @property
    def learning_rate_scale(self) -> float:
        return float(self._trainer.learning_rate_scale.numpy())

    def save(self) -> str | None:
        return self._trainer.save()

    def save_if_preempted(self) -> None:
        if self._trainer.run_state is not None:
            self._trainer.run_state.save_if_preempted()

    def evaluate(self) -> dict[str, float]:
        return self._trainer.evaluate()

    def write_scalars(self, split: str, metrics: dict[str, float]) -> None:
        self._trainer.summaries.scalars(split, self.step, metrics)

    def state_is_finite(self) -> bool:
        return self._trainer.state_is_finite()

    def newest_finite_checkpoint(self) -> str | None:
        state = self._trainer.run_state
        return state.newest_finite() if state is not None else None

    def roll_back(self, learning_rate_factor: float) -> str | None:
        state, scale = self._trainer.run_state, self._trainer.learning_rate_scale
        if state is None:
            return None
        before = float(scale.numpy())
        restored = state.restore()
        if restored is not None:
            # Lower than before the rollback, not only than the checkpoint's: a run that
            # diverges again before its next save rolls back to the same checkpoint.
            scale.assign(min(before, float(scale.numpy())) * learning_rate_factor)
            self.rolled_back = True
        return restored

    def stop(self, reason: str) -> None:
        self.stopped = reason
