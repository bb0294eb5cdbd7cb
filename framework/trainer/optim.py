"""Optimizers for gradients the trainer has already all-reduced, and the learning rate schedule.

The trainer sums gradients across replicas once, clips them by the global norm of that sum, and then
applies them. Keras' own `global_clipnorm` cannot do this under a strategy: it clips each replica's
share before the sum. The optimizers here therefore skip the sum Keras would do again (through a
private Keras method, hence `tf_internals`).

An optimizer function takes the learning rate (a schedule) and the decoupled weight decay, and any
hyperparameters of its own (bound by gin at the edge): `Trainer.optimizer_fn` is one of these, or a
function of the same shape.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import keras
import tensorflow as tf

from framework.core import tf_internals

# Weights that are not decayed: biases, norm scales and offsets, the class token.
NOT_DECAYED = ("bias", "gamma", "beta", "class_token")

Schedule = keras.optimizers.schedules.LearningRateSchedule
OptimizerFn = Callable[[Schedule, float], keras.optimizers.Optimizer]


class ReducedGradientAdamW(tf_internals.GradientsAlreadyReduced, keras.optimizers.AdamW):
    """AdamW that takes gradients already summed over replicas."""


class ReducedGradientSGD(tf_internals.GradientsAlreadyReduced, keras.optimizers.SGD):
    """SGD (with momentum) that takes gradients already summed over replicas."""


class ReducedGradientAdafactor(tf_internals.GradientsAlreadyReduced, keras.optimizers.Adafactor):
    """Adafactor that takes gradients already summed over replicas."""


class ScaledSchedule(Schedule):
    """A schedule times a variable, so a running trainer can lower its learning rate (after
    rolling back a diverged run) without rebuilding the optimizer or retracing its step."""

    def __init__(self, schedule: Schedule, scale: tf.Variable):
        self.schedule = schedule
        self.scale = scale

    def __call__(self, step):
        rate = self.schedule(step)
        return rate * tf.cast(self.scale, rate.dtype)

    def get_config(self) -> dict:
        return {"schedule": self.schedule.get_config(), "scale": float(self.scale.numpy())}


def scheduled_optimizer(
    optimizer_fn: OptimizerFn,
    learning_rate: float,
    warmup_steps: int,
    total_steps: int,
    weight_decay: float,
) -> tuple[keras.optimizers.Optimizer, tf.Variable]:
    """`optimizer_fn`'s optimizer on the warm-up + cosine schedule times a scale variable (not
    built: build it for the variables it updates); and that scale, which a divergence rollback
    lowers (it is saved with the checkpoints, so a restart keeps it). Call it in the strategy's
    scope."""
    scale = tf.Variable(1.0, trainable=False, name="lr_scale")
    schedule = ScaledSchedule(warmup_cosine(learning_rate, warmup_steps, total_steps), scale)
    return for_reduced_gradients(optimizer_fn(schedule, weight_decay)), scale


def for_reduced_gradients(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    """`optimizer`, made to take gradients already summed over replicas: one of Keras' own
    classes (`keras.optimizers.Lion`, `RMSprop`, ...) that an `optimizer_fn` returns becomes the
    same class with `GradientsAlreadyReduced` mixed in (before it is built, so nothing of its
    state changes). Left as it was, it would sum the trainer's summed gradients again: N times
    too large on N replicas, and on shards a sum of different replicas' parts."""
    check_supported(optimizer)
    if not isinstance(optimizer, tf_internals.GradientsAlreadyReduced):
        optimizer.__class__ = _reduced_class(type(optimizer))
    return optimizer


def check_supported(optimizer: keras.optimizers.Optimizer) -> None:
    """Raises ValueError for Keras optimizer settings the trainer's step would silently undo:
    each is a step of Keras' `fit` that the trainer does its own way, or not at all."""
    name = type(optimizer).__name__
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            f"optimizer_fn returned a {name}: the trainer does not scale the loss, so its "
            "updates would be divided by the loss scale (2**15 times too small). Return the "
            "inner optimizer, and train in bfloat16 (Runtime.precision = 'bfloat16'), which "
            "needs no loss scaling"
        )
    if getattr(optimizer, "gradient_accumulation_steps", None):
        raise ValueError(
            f"{name} was made with gradient_accumulation_steps=..., which the trainer's step "
            "does not follow (under a strategy it fails; on one device each logged step would "
            "be several batches): accumulate with Trainer.microbatches instead"
        )
    if getattr(optimizer, "use_ema", False) and not optimizer.ema_overwrite_frequency:
        raise ValueError(
            f"{name} was made with use_ema=True but no ema_overwrite_frequency: the trainer "
            "never swaps the averaged weights into the model (Keras' fit does at its end), so "
            "evaluation, checkpoints and exports would hold the raw weights. Set "
            "ema_overwrite_frequency, or leave use_ema out"
        )


@functools.cache
def _reduced_class(cls: type) -> type:
    return type(f"ReducedGradient{cls.__name__}", (tf_internals.GradientsAlreadyReduced, cls), {})


def warmup_cosine(
    learning_rate: float, warmup_steps: int, total_steps: int, final_fraction: float = 0.0
) -> Schedule:
    """Linear warm-up from 0 to `learning_rate`, then cosine decay to `final_fraction` of it."""
    warmup_steps = min(warmup_steps, total_steps)
    return keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=0.0,
        warmup_target=learning_rate,
        warmup_steps=warmup_steps,
        decay_steps=max(total_steps - warmup_steps, 1),
        alpha=final_fraction,
    )


def _not_decaying(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    optimizer.exclude_from_weight_decay(var_names=list(NOT_DECAYED))
    return optimizer


def adamw(
    learning_rate: Schedule,
    weight_decay: float = 0.05,
    *,
    beta_1: float = 0.9,
    beta_2: float = 0.999,
    epsilon: float = 1e-7,
) -> ReducedGradientAdamW:
    """AdamW (the default): decoupled weight decay, except on `NOT_DECAYED` weights."""
    return _not_decaying(
        ReducedGradientAdamW(
            learning_rate=learning_rate,
            weight_decay=weight_decay,
            beta_1=beta_1,
            beta_2=beta_2,
            epsilon=epsilon,
        )
    )


def sgd(
    learning_rate: Schedule,
    weight_decay: float = 0.0,
    *,
    momentum: float = 0.9,
    nesterov: bool = False,
) -> ReducedGradientSGD:
    """SGD with momentum (ViT fine-tuning's usual choice), with decoupled weight decay."""
    return _not_decaying(
        ReducedGradientSGD(
            learning_rate=learning_rate,
            weight_decay=weight_decay or None,
            momentum=momentum,
            nesterov=nesterov,
        )
    )


def adafactor(
    learning_rate: Schedule,
    weight_decay: float = 0.0,
    *,
    beta_2_decay: float = -0.8,
    clip_threshold: float = 1.0,
    relative_step: bool = True,
) -> ReducedGradientAdafactor:
    """Adafactor (factored second moments: optimizer memory of O(rows + columns) per matrix
    instead of O(rows * columns), as T5 trains), from Keras."""
    return _not_decaying(
        ReducedGradientAdafactor(
            learning_rate=learning_rate,
            weight_decay=weight_decay or None,
            beta_2_decay=beta_2_decay,
            clip_threshold=clip_threshold,
            relative_step=relative_step,
        )
    )
