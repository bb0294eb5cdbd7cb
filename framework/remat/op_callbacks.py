"""The op callback that hands each op created while a region records or replays to that region.

TensorFlow calls an op callback for every op created while a graph is built and lets it return
replacement outputs. One callback per thread, registered while any region is active, dispatches
each op: to the innermost active region whose top level is being built, or - for a stateless
random op in a control-flow body inside the innermost region - to the seed tying of that region's
pass. Ops of a nested checkpoint belong to that checkpoint.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Protocol

import tensorflow as tf

from framework.core import tf_internals
from framework.remat.dependencies import in_graph, with_dep
from framework.remat.random_values import is_random_op, tie_seeds
from framework.remat.thread_state import ThreadSetting

_IGNORED_OPS = frozenset({"Placeholder", "Const", "NoOp"})


class ActivePass(Protocol):
    """A region's pass while it is built (`replay.Region`)."""

    graph: tf.Graph | None  # the top level being built
    dep: tf.Tensor | None  # the zero tied to the pass

    def top_level_op(self, op: tf.Operation, attrs, outputs): ...

    def constant(self, value) -> None: ...

    def owns(self, graph: tf.Graph) -> bool: ...


_local = threading.local()


def _stack() -> list[ActivePass]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def in_region() -> bool:
    """True while this thread records or replays a region (nested checkpoints must stay active)."""
    return bool(_stack())


@contextlib.contextmanager
def active(region: ActivePass) -> Iterator[None]:
    """Sends the ops created in this thread to `region` (innermost first) while inside."""
    stack = _stack()
    if not stack:
        tf_internals.add_op_callback(_dispatch)
    stack.append(region)
    try:
        yield
    finally:
        stack.remove(region)
        if not stack:
            tf_internals.remove_op_callback(_dispatch)


def tied_to_pass(t: tf.Tensor) -> tf.Tensor:
    """`t`, not computable before the innermost checkpointed region's pass starts: plus its zero
    (the inputs' in the forward pass, the upstream gradient's in the recomputation); outside
    checkpointed regions, `t` itself.

    For a value computed from a variable alone, such as a weight gathered from the shards of the
    other replicas: XLA would otherwise hoist it to the start of the step, merge the
    recomputation's with the forward pass's, and keep it for the whole step.
    """
    stack = _stack()
    if not stack:
        return t
    return with_dep(t, in_graph(stack[-1].dep, tf.compat.v1.get_default_graph()))


_tag: ThreadSetting[str | None] = ThreadSetting(None)


def pending_tag() -> str | None:
    """The `checkpoint_name` tag of the op being created, if any."""
    return _tag.value


def tagging(name: str) -> contextlib.AbstractContextManager:
    """Marks the next op created in this thread as `checkpoint_name(..., name)`."""
    return _tag.set(name)


def _dispatch(op_type, inputs, attrs, outputs, op_name=None, graph=None):
    stack = _stack()
    if not stack or graph is None:
        return None
    owner = next((region for region in reversed(stack) if graph is region.graph), None)
    if op_type == "Const" and owner is not None and attrs:
        owner.constant(dict(zip(attrs[::2], attrs[1::2])).get("value"))
    if op_type in _IGNORED_OPS:
        return None
    op = graph.get_operation_by_name(op_name)
    if outputs is None:  # a callback registered before ours returned nothing
        outputs = op.outputs
    if owner is not None:
        return owner.top_level_op(op, attrs, outputs)
    if stack[-1].owns(graph) and is_random_op(op_type):
        tie_seeds(op, stack[-1].dep)
    return None
