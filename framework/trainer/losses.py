"""Losses: per-target values from logits and labels.

A loss returns one value per label (any rank: one per image, one per token); the step weights
them (padding weighs 0) and sums them over the global batch. The trainer's `loss_fn` is any
function of this shape.

Labels are integer class ids [...], or floating-point class probabilities [..., C] (soft labels:
mixup and cutmix make them). `label_classes` gives the class each label counts as for accuracy.
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from framework.core.errors import TrainerError

LossFn = Callable[[tf.Tensor, tf.Tensor], tf.Tensor]


def cross_entropy(
    logits: tf.Tensor, labels: tf.Tensor, *, label_smoothing: float = 0.0
) -> tf.Tensor:
    """Softmax cross-entropy of `labels` under `logits` [..., C], per label: integer labels
    [...], or class probabilities [..., C] (mixed labels).

    With `label_smoothing` e the target is (1 - e) * the label's + e spread uniformly over the C
    classes. Computed as (1 - e) * CE + e * (logsumexp(logits) - mean(logits)), which is the same
    value without building a [..., C] one-hot target (C is 32k or more for language models).
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"cross_entropy.label_smoothing must be in [0, 1), got {label_smoothing}")
    logits = tf.cast(logits, tf.float32)
    labels = tf.convert_to_tensor(labels)
    check_labels(logits, labels)
    if labels.dtype.is_floating:
        labels = tf.cast(labels, tf.float32)
        losses = tf.nn.softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    else:
        losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    if label_smoothing:
        uniform = tf.reduce_logsumexp(logits, -1) - tf.reduce_mean(logits, -1)
        losses = (1.0 - label_smoothing) * losses + label_smoothing * uniform
    return losses


def check_labels(logits: tf.Tensor, labels: tf.Tensor) -> None:
    """Raises TrainerError for labels that do not fit logits [..., C]: integer class ids must
    have one axis fewer, probabilities the same axes and C classes. Checked on static shapes, as
    a step is traced: labels [batch, 1] or float class ids [batch] would otherwise broadcast
    or be read as probabilities (over the batch, when it equals C), a wrong loss without error.
    """
    rank, classes = logits.shape.rank, logits.shape[-1] if logits.shape.rank else None
    if rank is None or labels.shape.rank is None:
        return
    shapes = f"labels {labels.dtype.name} {labels.shape.as_list()}, logits {logits.shape.as_list()}"
    if labels.dtype.is_floating and labels.shape.rank == rank:
        if None not in (labels.shape[-1], classes) and labels.shape[-1] != classes:
            raise TrainerError(
                f"the labels are probabilities over {labels.shape[-1]} classes, the logits over "
                f"{classes}: give the model the data set's number of classes"
            )
    elif labels.dtype.is_floating and labels.shape.rank == rank - 1:
        raise TrainerError(
            f"{shapes}: the labels look like class ids in floating point; cast them to int32 "
            "in the data set (floating-point labels are class probabilities [..., classes])"
        )
    elif not labels.dtype.is_integer or labels.shape.rank != rank - 1:
        hint = (
            "; drop the labels' last axis of size 1"
            if labels.shape.rank == rank and labels.shape[-1] == 1
            else ""
        )
        raise TrainerError(
            f"{shapes}: give integer class ids with one axis fewer than the logits, or float "
            f"class probabilities with the logits' shape{hint}"
        )


def label_classes(labels: tf.Tensor) -> tf.Tensor:
    """The class each label counts as for accuracy: integer labels as they are, class
    probabilities their most probable class (for a mixed pair, the larger part)."""
    labels = tf.convert_to_tensor(labels)
    if labels.dtype.is_floating:
        return tf.argmax(labels, -1, output_type=tf.int32)
    return labels
