"""The two collectives sharded state needs, in the two places a step can run them.

- `ReplicaCollectives`: tf.distribute's own, in a strategy's replica context (`all_gather`,
  `all_reduce`). TensorFlow cannot put them inside an XLA program on CPUs and GPUs (they
  synchronise the replicas' threads, or need collective kernels XLA does not lower), so a step
  runs them between its programs. tf.distribute has no reduce-scatter: it is an all-reduce of
  which each replica keeps its part.
- `XlaCollectives`: XLA's own all-reduce and reduce-scatter, inside one XLA program of many
  replicas (a TPU's step, or a multi-chip program compiled for planning). An all-gather is an
  all-reduce of the shard placed among zeros (TensorFlow lowers no all-gather into XLA, and
  TPUStrategy's own `all_gather` does the same). Each has the other as its gradient, so
  differentiating a step that gathers its weights reduce-scatters their gradients.

Shards are in replica order: replica i's is part i of a gathered value.
"""

from __future__ import annotations

from typing import Protocol

import tensorflow as tf

from framework.core import tf_internals


class Collectives(Protocol):
    replicas: int

    def all_gather(self, shards: list[tf.Tensor]) -> list[tf.Tensor]:
        """Each [k] shard -> [replicas * k], the replicas' shards in order."""

    def reduce_scatter(self, values: list[tf.Tensor]) -> list[tf.Tensor]:
        """Each [replicas * k] value -> this replica's [k] part of the sum over replicas."""


class ReplicaCollectives:
    """tf.distribute's collectives, called in replica context outside any XLA program. The
    values of one call travel together, one collective per dtype (as FSDP packs a flat buffer
    per group), not one per variable."""

    def __init__(self, strategy: tf.distribute.Strategy):
        self.replicas = strategy.num_replicas_in_sync

    def all_gather(self, shards: list[tf.Tensor]) -> list[tf.Tensor]:
        context = tf.distribute.get_replica_context()
        return _packed(shards, lambda flat: context.all_gather(flat, axis=0), self.replicas)

    def reduce_scatter(self, values: list[tf.Tensor]) -> list[tf.Tensor]:
        context = tf.distribute.get_replica_context()
        rows = [tf.reshape(v, [self.replicas, -1]) for v in values]
        index = context.replica_id_in_sync_group

        def mine(flat):
            summed = context.all_reduce(tf.distribute.ReduceOp.SUM, flat)
            return tf.reshape(summed, [self.replicas, -1])[index]

        return _by_dtype(rows, lambda group: _split(mine(_concat_rows(group)), group))


def _by_dtype(values: list[tf.Tensor], run) -> list[tf.Tensor]:
    """`run(group)` on the values of each dtype (a list in, a list out), in the input order."""
    results: list[tf.Tensor | None] = [None] * len(values)
    for dtype in dict.fromkeys(v.dtype for v in values):
        positions = [i for i, v in enumerate(values) if v.dtype == dtype]
        for i, result in zip(positions, run([values[i] for i in positions]), strict=True):
            results[i] = result
    return results


def _concat_rows(rows: list[tf.Tensor]) -> tf.Tensor:
    """[replicas, k_j] values side by side, flattened replica by replica."""
    return tf.reshape(tf.concat(rows, axis=1), [-1])


def _split(flat: tf.Tensor, like: list[tf.Tensor]) -> list[tf.Tensor]:
    """`flat` cut into one [k_j] part per value of `like` ([k_j] or [replicas, k_j])."""
    sizes = [int(v.shape[-1]) for v in like]
    return tf.split(flat, sizes)


def _packed(shards: list[tf.Tensor], gather, replicas: int) -> list[tf.Tensor]:
    """Each [k_j] shard gathered to [replicas * k_j] by one `gather` of all of them."""

    def run(group):
        gathered = tf.reshape(gather(tf.concat(group, axis=0)), [replicas, -1])
        columns = tf.split(gathered, [int(s.shape[0]) for s in group], axis=1)
        return [tf.reshape(c, [-1]) for c in columns]

    return _by_dtype(shards, run)


class XlaCollectives:
    """XLA's collectives inside one program compiled for `replicas` replicas; `replica_id` is
    the replica the program runs as (`tf_internals.xla_replica_id()` unless the caller knows
    it). The program's replica i must hold shard i: true of TPUStrategy's data-parallel
    replicas, whose replica i is XLA's replica i."""

    def __init__(self, replicas: int, replica_id: tf.Tensor | None = None):
        self.replicas = replicas
        self._replica_id = replica_id

    def _id(self) -> tf.Tensor:
        return tf_internals.xla_replica_id() if self._replica_id is None else self._replica_id

    def all_gather(self, shards: list[tf.Tensor]) -> list[tf.Tensor]:
        return [self._gather(shard) for shard in shards]

    def reduce_scatter(self, values: list[tf.Tensor]) -> list[tf.Tensor]:
        return [self._scatter(value) for value in values]

    def _gather(self, shard: tf.Tensor) -> tf.Tensor:
        @tf.custom_gradient
        def gather(x):
            mine = tf.one_hot(self._id(), self.replicas, dtype=x.dtype)[:, None]
            whole = tf_internals.xla_all_reduce(mine * x[None], self.replicas)
            return tf.reshape(whole, [-1]), lambda dy: self._scatter(dy)

        return gather(shard)

    def _scatter(self, value: tf.Tensor) -> tf.Tensor:
        @tf.custom_gradient
        def scatter(x):
            return tf_internals.xla_reduce_scatter(x, self.replicas), lambda dy: self._gather(dy)

        return scatter(value)
