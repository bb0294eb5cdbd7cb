"""AdamW with linear warm-up and cosine decay, for gradients the trainer has already all-reduced.

The trainer sums gradients across replicas once, clips them by the global norm of that sum, and then
applies them. Keras' own `global_clipnorm` cannot do this under a strategy: it clips each replica's
share before the sum. `ReducedGradientAdamW` therefore skips the sum Keras would do again (through a
private Keras method, hence `tf_internals`).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from framework import tf_internals


class ReducedGradientAdamW(tf_internals.GradientsAlreadyReduced, keras.optimizers.AdamW):
    """AdamW that takes gradients already summed over replicas."""


class ScaledSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """A schedule times a variable, so a running trainer can lower its learning rate (after
    rolling back a diverged run) without rebuilding the optimizer or retracing its step."""

    def __init__(
        self, schedule: keras.optimizers.schedules.LearningRateSchedule, scale: tf.Variable
    ):
        self.schedule = schedule
        self.scale = scale

    def __call__(self, step):
        rate = self.schedule(step)
        return rate * tf.cast(self.scale, rate.dtype)

    def get_config(self) -> dict:
        return {"schedule": self.schedule.get_config(), "scale": float(self.scale.numpy())}


def warmup_cosine(
    learning_rate: float, warmup_steps: int, total_steps: int, final_fraction: float = 0.0
) -> keras.optimizers.schedules.LearningRateSchedule:
    """Linear warm-up from 0 to `learning_rate`, then cosine decay to `final_fraction` of it."""
    warmup_steps = min(warmup_steps, total_steps)
    return keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=0.0,
        warmup_target=learning_rate,
        warmup_steps=warmup_steps,
        decay_steps=max(total_steps - warmup_steps, 1),
        alpha=final_fraction,
    )


def adamw(
    learning_rate: float,
    total_steps: int,
    warmup_steps: int = 0,
    weight_decay: float = 0.05,
    beta_2: float = 0.999,
    scale: tf.Variable | None = None,
) -> ReducedGradientAdamW:
    """AdamW on the warm-up + cosine schedule (times `scale`, when given); norm and bias
    weights are not decayed."""
    schedule = warmup_cosine(learning_rate, warmup_steps, total_steps)
    optimizer = ReducedGradientAdamW(
        learning_rate=schedule if scale is None else ScaledSchedule(schedule, scale),
        weight_decay=weight_decay,
        beta_2=beta_2,
    )
    optimizer.exclude_from_weight_decay(var_names=["bias", "gamma", "beta", "class_token"])
    return optimizer
