"""Losses: per-target values from logits and integer labels.

A loss returns one value per label (any rank: one per image, one per token); the step weights
them (padding weighs 0) and sums them over the global batch. The trainer's `loss_fn` is any
function of this shape.
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

LossFn = Callable[[tf.Tensor, tf.Tensor], tf.Tensor]


def cross_entropy(
    logits: tf.Tensor, labels: tf.Tensor, *, label_smoothing: float = 0.0
) -> tf.Tensor:
    """Softmax cross-entropy of integer `labels` [...] under `logits` [..., C], per label.

    With `label_smoothing` e the target puts 1 - e on the label and spreads e uniformly over
    the C classes. Computed as (1 - e) * CE + e * (logsumexp(logits) - mean(logits)), which is
    the same value without building a [..., C] one-hot target (C is 32k or more for language
    models).
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"cross_entropy.label_smoothing must be in [0, 1), got {label_smoothing}")
    logits = tf.cast(logits, tf.float32)
    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    if label_smoothing:
        uniform = tf.reduce_logsumexp(logits, -1) - tf.reduce_mean(logits, -1)
        losses = (1.0 - label_smoothing) * losses + label_smoothing * uniform
    return losses
