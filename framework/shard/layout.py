"""How one variable is cut into one shard per replica.

Flattened row-major and zero-padded to a multiple of the replicas, so any shape shards evenly:
replica i holds elements [i * k, (i + 1) * k) of the padded vector, k = ceil(size / replicas).
A flat cut makes every elementwise optimizer (Adam, AdamW, SGD with momentum, ...) compute on a
shard exactly what it computes on those elements of the whole variable, and it is the layout
an all-gather reassembles and a reduce-scatter splits without any reordering.
"""

from __future__ import annotations

import dataclasses
import math

import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class Layout:
    """The shards of a variable of `shape` over `replicas` replicas."""

    shape: tuple[int, ...]
    replicas: int

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def shard_size(self) -> int:
        """Elements per shard, padding included (at least one)."""
        return max(1, -(-self.size // self.replicas))

    @property
    def padded_size(self) -> int:
        return self.shard_size * self.replicas

    def padded(self, value: tf.Tensor) -> tf.Tensor:
        """`value` (of `shape`) flattened and zero-padded to `padded_size` elements."""
        flat = tf.reshape(value, [-1])
        return tf.pad(flat, [[0, self.padded_size - self.size]])

    def shard(self, value: tf.Tensor, index: int | tf.Tensor) -> tf.Tensor:
        """Shard `index` (a replica) of `value`: [shard_size], in a buffer of its own (a slice
        could share `value`'s, and a variable assigned it would keep the whole value alive)."""
        rows = tf.reshape(self.padded(value), [self.replicas, self.shard_size])
        return tf.gather(rows, tf.cast(index, tf.int32))

    def whole(self, gathered: tf.Tensor) -> tf.Tensor:
        """The variable's value of `shape` from its shards gathered in replica order."""
        return tf.reshape(gathered[: self.size], self.shape)
