"""Variables stored as one shard per replica, and their whole values when a run needs them.

A shard is a `SyncOnRead` variable: each replica reads and writes its own copy, which here holds
that replica's part of the value (`layout.Layout`). tf.distribute treats such variables as
replica-local state on every strategy (MirroredStrategy, MultiWorkerMirroredStrategy,
TPUStrategy; a plain variable under one device), so a replica's update touches its part alone,
and the device holds 1/N of the variable.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import keras
import tensorflow as tf

from framework.shard.layout import Layout


@contextlib.contextmanager
def per_replica_variables() -> Iterator[None]:
    """Inside a strategy's scope: variables created in the block hold one value per replica,
    each replica reading and writing its own (their cross-replica read is replica 0's)."""

    def create(next_creator, **kwargs):
        kwargs["synchronization"] = tf.VariableSynchronization.ON_READ
        kwargs["aggregation"] = tf.VariableAggregation.ONLY_FIRST_REPLICA
        return next_creator(**kwargs)

    with tf.variable_creator_scope(create):
        yield


class ShardedVariables:
    """`variables` (Keras variables, unchanged) and a shard of each per replica of `strategy`.

    `shards[j]` is a Keras variable of `layouts[j].shard_size` elements with `variables[j]`'s
    name and dtype (optimizers that treat weights by name, as weight decay does, treat a shard
    as its variable). The shards start as parts of the variables' current values.
    """

    def __init__(
        self,
        strategy: tf.distribute.Strategy,
        variables: Sequence[keras.Variable],
        replicas: int | None = None,
    ):
        self.strategy = strategy
        self.variables = list(variables)
        replicas = replicas or strategy.num_replicas_in_sync
        self.layouts = [Layout(tuple(v.shape), replicas) for v in self.variables]
        with strategy.scope(), per_replica_variables():
            self.shards = [
                keras.Variable("zeros", shape=(layout.shard_size,), dtype=v.dtype, name=v.name)
                for v, layout in zip(self.variables, self.layouts)
            ]
        for shard, layout, variable in zip(self.shards, self.layouts, self.variables):
            assign_whole(strategy, shard, layout, variable.value)
        self._whole = WholeValues(strategy, self.shards, self.layouts)

    def whole_values(self) -> list[tf.Tensor]:
        """Each variable's current value, gathered from its shards (see `WholeValues`)."""
        return self._whole.read()


def host_of(strategy: tf.distribute.Strategy) -> str:
    """The CPU of the host this process drives its first replica from (a TPU VM's, a GPU
    host's): where state too large for one device can be put together."""
    spec = tf.DeviceSpec.from_string(strategy.extended.worker_devices[0])
    return spec.replace(device_type="CPU", device_index=0).to_string()


class WholeValues:
    """The whole values of `shards` (cut by `layouts`), gathered to the host's CPU: one
    all-gather per dtype for all of them (a save of hundreds of variables is one collective, not
    hundreds), the parts packed side by side on each replica. Cross-replica context; on a
    cluster every worker reads, at the same point (a checkpoint save: all workers save)."""

    def __init__(self, strategy: tf.distribute.Strategy, shards: list, layouts: list[Layout]):
        self._strategy = strategy
        self._shards = list(shards)
        self._layouts = list(layouts)
        self._gather = tf.function(self._gather_all)

    def read(self) -> list[tf.Tensor]:
        return self._gather()

    def _gather_all(self) -> list[tf.Tensor]:
        strategy = self._strategy
        dtypes = list(dict.fromkeys(s.dtype for s in self._shards))
        groups = [[i for i, s in enumerate(self._shards) if s.dtype == d] for d in dtypes]

        def pack():
            return [tf.concat([self._shards[i].value for i in group], 0) for group in groups]

        packed = strategy.run(pack)
        values: list[tf.Tensor | None] = [None] * len(self._shards)
        with tf.device(host_of(strategy)):
            for group, parts in zip(groups, packed):
                rows = tf.reshape(
                    strategy.gather(parts, axis=0), [strategy.num_replicas_in_sync, -1]
                )
                sizes = [self._layouts[i].shard_size for i in group]
                for i, column in zip(group, tf.split(rows, sizes, axis=1)):
                    values[i] = self._layouts[i].whole(tf.reshape(column, [-1]))
        return values


def assign_whole(
    strategy: tf.distribute.Strategy, shard: keras.Variable, layout: Layout, value
) -> None:
    """Gives each replica's copy of `shard` its part of `value` (cross-replica context)."""
    value = tf.convert_to_tensor(value, shard.dtype)
    parts = strategy.experimental_distribute_values_from_function(
        lambda context: layout.shard(value, context.replica_id_in_sync_group)
    )
    strategy.extended.update(shard.value, lambda local, part: local.assign(part), args=(parts,))
