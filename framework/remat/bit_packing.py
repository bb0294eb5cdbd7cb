"""Kept boolean values (dropout masks) stored as bits: one bit per value in uint32 words.

Saved as is, XLA fuses the comparison that made a mask into each consumer and keeps the 4-byte
random bits it compared instead; the packing reduction is not fused into two places, so one bit
per value is all that stays alive until the backward pass. A word holds the values of 32 rows at
one column (rows: all dimensions but the last), so that unpacking, fused into each consumer, is a
broadcast along contiguous columns (with 8 consecutive values per byte instead, ViT-B/16's
GELU-gradient fusions ran 3.7x slower than without remat; `benchmarks/profile_step.py`).
"""

from __future__ import annotations

import tensorflow as tf

from framework.core import tf_internals

_WORD_BITS = 32
_WORD_BIT_VALUES = tuple(1 << i for i in range(_WORD_BITS))


def packable(t: tf.Tensor) -> bool:
    """Whether `t` is kept as bits: a non-empty boolean of static shape."""
    return t.dtype == tf.bool and t.shape.is_fully_defined() and t.shape.num_elements() > 0


def _as_rows(shape: tf.TensorShape) -> tuple[int, int]:
    """A non-empty `shape` seen as a matrix (rows, columns) for `pack_bits`.

    The columns are the last dimension, unless that leaves fewer rows than a word has bits: then
    padding to 32 rows would cost more than the values, and one column is used instead.
    """
    columns = shape[-1] if shape.rank >= 2 else 1
    rows = shape.num_elements() // columns
    return (rows, columns) if rows >= _WORD_BITS else (shape.num_elements(), 1)


def pack_bits(mask: tf.Tensor) -> tf.Tensor:
    """A boolean tensor as uint32 words, one bit per value, a word per 32 rows of a column."""
    rows, columns = _as_rows(mask.shape)
    matrix = tf.reshape(tf.cast(mask, tf.uint32), [rows, columns])
    matrix = tf.pad(matrix, [[0, -rows % _WORD_BITS], [0, 0]])
    bits = tf.reshape(matrix, [_WORD_BITS, -1, columns])
    return tf.reduce_sum(bits * tf.constant(_WORD_BIT_VALUES, tf.uint32)[:, None, None], axis=0)


def unpack_bits(packed: tf.Tensor, shape: tf.TensorShape) -> tf.Tensor:
    """Inverse of `pack_bits` for a mask of static `shape`."""
    rows, columns = _as_rows(shape)
    values = tf.constant(_WORD_BIT_VALUES, tf.uint32)[:, None, None]
    bits = tf.bitwise.bitwise_and(packed[None], values) > 0
    return tf.reshape(tf.reshape(bits, [-1, columns])[:rows], shape)


def as_kept(outputs: tuple[tf.Tensor, ...]) -> tuple[tf.Tensor, ...]:
    """Outputs as they are kept: booleans packed as bits."""
    with outputs[0].graph.as_default(), tf_internals.stop_recording():
        return tuple(pack_bits(t) if packable(t) else t for t in outputs)
