"""Ordering the ops that touch a variable a region writes, in graphs that do not order them.

`tf.function` graphs order such ops by themselves; the backward graphs TensorFlow builds for an
eager call do not, and there a region's snapshot restore, its recomputation's reads and writes
and the final restore must not interleave with a nested region's.
"""

from __future__ import annotations

import tensorflow as tf

from framework.core import tf_internals


class StateOrder:
    """Runs the ops that touch one variable in the order they were created, in any graph.

    Edges only ever go from an earlier-created op to a later one, as `tf.function`'s own, so they
    cannot make a cycle.
    """

    # Kept on the graph itself: a table outside it would hold its ops, hence the graph, forever.
    _ATTR = "_remat_last_state_ops"

    @classmethod
    def _table(cls, graph: tf.Graph) -> dict:
        if not hasattr(graph, cls._ATTR):
            setattr(graph, cls._ATTR, {})
        return getattr(graph, cls._ATTR)

    @classmethod
    def last(cls, graph: tf.Graph, handle: tf.Tensor) -> tf.Operation | None:
        """The op touching `handle`'s variable that was ordered last in `graph`."""
        return cls._table(graph).get(handle.ref())

    @classmethod
    def chain(
        cls, graph: tf.Graph, handle: tf.Tensor, ops: list, after: tf.Operation | None = None
    ) -> None:
        """Orders `ops` (in creation order) one after the other, the first after `after` (by
        default the last op ordered so far)."""
        previous = cls.last(graph, handle) if after is None else after
        for op in ops:
            if previous is not None and previous is not op:
                tf_internals.add_control_input(op, previous)
            previous = op
        if previous is not None:
            current = cls.last(graph, handle)
            if current is None or (
                tf_internals.creation_index(current) <= tf_internals.creation_index(previous)
            ):
                cls._table(graph)[handle.ref()] = previous


def read_variable(graph: tf.Graph, handle: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """The variable's value, read after every op ordered on it so far."""
    value = tf.raw_ops.ReadVariableOp(resource=handle, dtype=dtype)
    StateOrder.chain(graph, handle, [value.op])
    return value


def assign_variable(graph: tf.Graph, handle: tf.Tensor, value: tf.Tensor) -> tf.Operation:
    """Writes `value` to the variable after every op ordered on it so far."""
    op = tf.raw_ops.AssignVariableOp(resource=handle, value=value)
    StateOrder.chain(graph, handle, [op])
    return op
