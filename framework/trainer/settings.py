"""What a training run is told: the model, the data, the schedule and the run's bookkeeping.

One frozen dataclass, checked when it is made (gin passes any value, so a wrong one fails here,
naming the binding, before anything is built). Gin binds it under the name `Trainer`:
`Trainer.train_steps = 100` in a config and `Trainer(model_dir, train_steps=100)` in Python set
the same field, and `framework/trainer/trainer.py` is left with composing the run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import ClassVar

import gin
import keras

from framework import remat, shard
from framework.core import checks
from framework.data.sharding import DatasetFn
from framework.rundir import lock as run_lock
from framework.runtime import Runtime
from framework.trainer import losses, optim

# The trainer's own losses and optimizers, as gin names them. The defaults below are these
# registered functions, so a binding such as `optim.adamw.beta_2 = 0.98` takes effect whether or
# not `Trainer.optimizer_fn` is bound.
cross_entropy = gin.external_configurable(losses.cross_entropy, module="losses")
adamw = gin.external_configurable(optim.adamw, module="optim")
sgd = gin.external_configurable(optim.sgd, module="optim")
adafactor = gin.external_configurable(optim.adafactor, module="optim")


@gin.configurable("Trainer")
@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerSettings:
    """The settings of a `Trainer`, bound by gin as `Trainer.<name>`.

    Args:
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
      shard_state: what each replica keeps only its part of (`framework.shard`): "none", or
        "optimizer" (the optimizer's state), "gradients" (and the summed gradients) or
        "weights" (and the weights, gathered where they are read).
      init_checkpoint: a checkpoint (or a run's model_dir) whose model weights initialise a
        run that starts afresh (`warm_start`): fine-tuning. Ignored once the run has
        checkpoints of its own, which it resumes from.
      runtime: strategy, devices, compiler flags, precision; `Runtime()` (gin-bound) if None.
      actions: more callables `action(loop, metrics)` (`actions.Loop`) run after the built-in
        ones.
      count_flops: count the model FLOPs of a step at the start of training, for TFLOP/s and
        MFU (lowers the forward pass to XLA once; off saves that time).
      profile_steps: (first, last): a TensorBoard profile of the loops between these steps,
        in `model_dir/train` (see `actions.Profile`).
      seed: seeds Python, NumPy, TensorFlow and Keras.
    """

    gin_name: ClassVar[str] = "Trainer"

    model_fn: Callable[[], keras.Model] = gin.REQUIRED
    dataset_fn: DatasetFn = gin.REQUIRED
    global_batch_size: int = 128
    train_steps: int = 1000
    steps_per_loop: int = 100
    eval_every: int | None = None
    checkpoint_every: int | None = None
    keep_checkpoints: int | None = 3
    lock_lease_seconds: float = run_lock.DEFAULT_LEASE_SECONDS
    learning_rate: float = 1e-3
    warmup_steps: int = 0
    weight_decay: float = 0.05
    optimizer_fn: optim.OptimizerFn = adamw
    loss_fn: losses.LossFn = cross_entropy
    clip_norm: float | None = 1.0
    microbatches: int = 1
    divergence_rollbacks: int = 0
    rollback_learning_rate_factor: float = 0.5
    remat_policy: str | remat.policies.Policy | None = None
    shard_state: str = "none"
    init_checkpoint: str | None = None
    runtime: Runtime | None = None
    actions: Sequence[Callable[..., None]] = ()  # `actions.Action`s
    count_flops: bool = True
    profile_steps: Sequence[int] | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("global_batch_size", "train_steps", "steps_per_loop", "microbatches"):
            checks.integer(f"Trainer.{name}", getattr(self, name))
        for name in ("eval_every", "checkpoint_every", "keep_checkpoints"):
            checks.integer(f"Trainer.{name}", getattr(self, name), optional=True)
        for name in ("warmup_steps", "seed", "divergence_rollbacks"):
            checks.integer(f"Trainer.{name}", getattr(self, name), minimum=0)
        checks.number("Trainer.learning_rate", self.learning_rate)
        checks.number("Trainer.weight_decay", self.weight_decay, inclusive=True)
        checks.number("Trainer.clip_norm", self.clip_norm, optional=True)
        checks.number(
            "Trainer.rollback_learning_rate_factor",
            self.rollback_learning_rate_factor,
            maximum=1.0,
        )
        checks.number("Trainer.lock_lease_seconds", self.lock_lease_seconds)
        checks.boolean("Trainer.count_flops", self.count_flops)
        checks.choice("Trainer.shard_state", self.shard_state, shard.LEVELS)

    def check_replicas(self, replicas: int) -> None:
        """Each replica must get an equal part of the global batch, in equal micro-batches."""
        if self.global_batch_size % (replicas * self.microbatches):
            raise ValueError(
                f"global_batch_size {self.global_batch_size} does not split over {replicas} "
                f"replica(s) x {self.microbatches} micro-batch(es)"
            )
