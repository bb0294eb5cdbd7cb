"""A fully rematerialized region called eagerly: its ops run one by one with the tapes paused, and
its gradient runs the region's code again under a tape of its own, as PyTorch's checkpoint does.

Nothing is traced. Tracing a region's forward and backward passes into functions, which the other
policies need (an eager op cannot hand a kept value to the recomputation in place of its own
output), costs more on the first call than running them; `nothing_saveable` keeps nothing but the
inputs, so its first eager call costs the plain call plus one recomputation.

What tracing would find in a graph is read off the ops as they run, through an op callback:

* the tensors the region closes over: differentiable inputs of its ops that none of its ops made
  and that are not its arguments;
* the variables it writes, and their values before the call (its layers' non-trainable
  variables read up front, others at their first read);
* stateful random ops, which a recomputation cannot draw again (as in graph mode, an error);
* the ops themselves, in order: the recomputation must run the same ones, else
  `RecomputationMismatchError`. Ops of a nested checkpoint belong to that checkpoint.

A tensor the forward pass makes reaches the tapes only as one of the region's results. One the
region keeps elsewhere (attention scores in a layer attribute) is a value the tapes never saw: a
loss computed from it would get no gradient through it, silently; kept in a layer attribute, it
is warned of (`TensorStoredAsideWarning`). A traced region's such tensor is a graph tensor, an
error where it is read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import warnings
from collections.abc import Callable, Iterator

import tensorflow as tf

from framework.core import tf_internals
from framework.core.errors import RecomputationMismatchError, RematError
from framework.remat.call_structure import CallStructure
from framework.remat.dependencies import differentiable
from framework.remat.eager import attach_gradient
from framework.remat.effects import (
    STATEFUL_RANDOM_OPS,
    WRITE_OPS,
    eager_function_effects,
    stateful_random_error,
    written_dtype,
)

# Writes that do not read the value first: before them, the region needs no snapshot.
_PLAIN_WRITES = frozenset({"AssignVariableOp", "AssignVariableXlaConcatND"})
# When Python frees a summary writer or a queue (a trainer of an earlier run, say, collected by the
# garbage collector), TensorFlow destroys its resource with this op, run eagerly among the ops of
# whatever region is running: in one pass and not the other, and none of the region's work.
_DESTROY_OP = "DestroyResourceOp"
_DIFFERENT_OPS = (
    "The region must run the same ops on every call (no Python state that changes between the "
    "forward pass and the recomputation). A gradient tape inside the region records nothing in "
    "an eager forward pass (the tapes are paused there): call such a step in a tf.function."
)


class TensorStoredAsideWarning(UserWarning):
    """A layer of a `nothing_saveable` region called eagerly kept a tensor of its call in an
    attribute: the gradient tapes did not record it (see the module docstring)."""


@dataclasses.dataclass(frozen=True)
class _Op:
    """An op as the two passes must agree on it."""

    op_type: str
    shapes: tuple
    dtypes: tuple
    layers: tuple[str, ...]  # the Keras layers it ran in, from the region's own level down

    def __str__(self) -> str:
        outs = ", ".join(f"{d.name}{list(s)}" for s, d in zip(self.shapes, self.dtypes))
        return f"{self.op_type} -> ({outs}) in {'/'.join(self.layers) or 'the region'}"


class _Pass:
    """One pass of a region (the forward pass, or the recomputation checked against it)."""

    def __init__(
        self,
        label: str,
        tensors: list[tf.Tensor],
        expected: list[_Op] | None = None,
        holder=None,
    ):
        self.label = label
        self.expected = expected  # None: this is the forward pass, which records
        self.ops: list[_Op] = []
        self.arguments = {tf_internals.tensor_id(t) for t in tensors}
        self.made: set[int] = set()  # tensors the region's ops made (ids)
        self.closures: dict[int, tf.Tensor] = {}
        self.first_reads: dict[int, tf.Tensor] = {}  # handle id -> value before any write
        self.writes: dict[int, tuple[tf.Tensor, tf.DType]] = {}  # handle id -> handle, dtype
        self.unseen_reads: set[int] = set()  # handles a tf.function got before any known value
        self.created_variables = False
        self.nested = 0  # > 0 while a nested checkpoint runs
        self._depth = tf_internals.keras_layer_depth()
        # The layer the forward pass runs in; the recomputation runs outside it.
        self.holder = tf_internals.keras_current_layer() if holder is None else holder

    def see(self, op_type: str, inputs, attrs, outputs) -> None:
        if self.expected is None:
            self._note_effects(op_type, inputs, attrs, outputs)
        if self.nested:
            return
        layers = tf_internals.keras_layer_path(self._depth, self.holder)
        if tf_internals.is_eager_function(op_type):
            # Under a tape, TensorFlow calls another variant of a tf.function, with more outputs.
            op = _Op("tf.function", (), (), layers)
        else:
            shapes = tuple(tuple(t.shape) if t.shape.rank is not None else () for t in outputs)
            op = _Op(op_type, shapes, tuple(t.dtype for t in outputs), layers)
        if self.expected is None:
            self.ops.append(op)
            return
        index = len(self.ops)
        if index >= len(self.expected):
            raise RecomputationMismatchError(
                f"Recomputation of remat region {self.label!r} ran more ops than its forward "
                f"pass ({len(self.expected)}); first extra op #{index}: {op}."
            )
        if op != self.expected[index]:
            raise RecomputationMismatchError(
                f"Recomputation of remat region {self.label!r} differs from its forward pass at "
                f"op #{index}: forward ran {self.expected[index]}, recomputation ran {op}. "
                f"{_DIFFERENT_OPS}"
            )
        self.ops.append(op)

    def check_complete(self) -> None:
        """After the recomputation: it ran every op of the forward pass."""
        if self.expected is not None and len(self.ops) != len(self.expected):
            raise RecomputationMismatchError(
                f"Recomputation of remat region {self.label!r} stopped after {len(self.ops)} "
                f"ops; its forward pass went on with op #{len(self.ops)}: "
                f"{self.expected[len(self.ops)]}. {_DIFFERENT_OPS}"
            )

    def _note_effects(self, op_type: str, inputs, attrs, outputs) -> None:
        for t in inputs:
            key = tf_internals.tensor_id(t)
            if differentiable(t) and key not in self.made and key not in self.arguments:
                self.closures.setdefault(key, t)
        if op_type in STATEFUL_RANDOM_OPS:
            raise stateful_random_error(self.label, [op_type])
        if op_type == "ReadVariableOp":
            key = tf_internals.tensor_id(inputs[0])
            if key not in self.writes:
                self.first_reads.setdefault(key, outputs[0])
            return
        if op_type == "VarHandleOp":
            self.created_variables = True
        if op_type in WRITE_OPS:
            key = tf_internals.tensor_id(inputs[0])
            attributes = dict(zip(attrs[::2], attrs[1::2])) if attrs else {}
            if op_type not in _PLAIN_WRITES:  # it read the value first, as the region did not
                self._check_known(inputs[0], f"runs {op_type}, which updates")
            elif key in self.unseen_reads:  # a tf.function may have read it before
                self._check_known(inputs[0], "writes, after a tf.function that may read it,")
            self._write(inputs[0], written_dtype(attributes))
            return
        effects = eager_function_effects(op_type)
        if effects is None:
            return
        written, random_ops = effects
        if random_ops:
            raise stateful_random_error(self.label, random_ops)
        for position, dtype in written.items():
            self._check_known(inputs[position], f"calls the tf.function {op_type!r}, which writes")
            self._write(inputs[position], dtype)
        self.unseen_reads.update(
            tf_internals.tensor_id(t)
            for t in inputs
            if t.dtype == tf.resource and tf_internals.tensor_id(t) not in self.first_reads
        )

    def _check_known(self, handle: tf.Tensor, what: str) -> None:
        """Raises unless the value of the variable `handle` before the call is known."""
        if tf_internals.tensor_id(handle) not in self.first_reads:
            raise RematError(
                f"Remat region {self.label!r}, called eagerly, {what} a variable that is not the "
                "layer's own and that the region has not read before: its value before the call "
                "is gone, and the recomputation would start from another. Call the step in a "
                "tf.function (Keras fit does), or make the variable the layer's own."
            )

    def _write(self, handle: tf.Tensor, dtype: tf.DType) -> None:
        self.writes.setdefault(tf_internals.tensor_id(handle), (handle, dtype))


_local = threading.local()


def _stack() -> list[_Pass]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def _on_op(op_type, inputs, attrs, outputs, op_name=None, graph=None):
    stack = _stack()
    if graph is not None or not stack:  # a function being traced: its call op is what runs
        return None
    if op_type == _DESTROY_OP:
        return None
    outputs = outputs or ()
    made = [tf_internals.tensor_id(t) for t in outputs]
    for active in stack:
        active.made.update(made)
    stack[-1].see(op_type, inputs, attrs, outputs)
    return None


@contextlib.contextmanager
def _running(active: _Pass) -> Iterator[None]:
    # Added at every pass and never removed: removing a thread's last eager op callback turns
    # TensorFlow's callbacks off for tf.function calls in every thread, under the feet of a
    # region another thread (a MirroredStrategy replica) is running; adding one, even one
    # already there, turns them back on.
    tf_internals.add_op_callback(_on_op)
    stack = _stack()
    stack.append(active)
    try:
        yield
    finally:
        stack.remove(active)


@contextlib.contextmanager
def nested_region() -> Iterator[None]:
    """Marks the block as a nested checkpoint's call: its ops are its own, not the enclosing
    region's (the forward pass runs it plainly, the recomputation rematerializes it)."""
    stack = _stack()
    if not stack:
        yield
        return
    stack[-1].nested += 1
    try:
        yield
    finally:
        stack[-1].nested -= 1


def call(
    label: str,
    region: Callable[[list[tf.Tensor]], object],
    tensors: list[tf.Tensor],
    state: tf_internals.KerasCallState,
    layers: list,
):
    """Runs `region(tensors)` eagerly as a fully rematerialized region; returns its results.

    `state` is the Keras call state it is called in, entered again for the recomputation.
    `layers` are the Keras layers it runs: their non-trainable variables (the ones a call
    writes) are read before the call, so a `tf.function` the region calls may write them too
    (its own reads and writes are not seen).
    """
    tf_internals.create_keras_global_seed_generator()
    forward = _Pass(label, tensors)
    with tf_internals.stop_recording():
        for layer in layers:
            for variable in getattr(layer, "non_trainable_variables", ()):
                stored = tf_internals.tf_variable(variable)
                forward.first_reads[tf_internals.tensor_id(stored.handle)] = (
                    tf.raw_ops.ReadVariableOp(resource=stored.handle, dtype=stored.dtype)
                )
    untrainable = [
        tf_internals.tf_variable(v)
        for layer in layers
        for v in getattr(layer, "non_trainable_variables", ())
    ]
    watched = tf_internals.untrainable_variables_watched(untrainable)
    with tf_internals.stop_recording(), tf_internals.watching_variables() as variables:
        with _running(forward):
            results = CallStructure(region(tensors))
        # New tensors: a result that is an input, a closure or another result would make the
        # recorded op its own input, or give one gradient to two results.
        outputs = [tf.identity(t) for t in results.tensors()]
    variables += watched
    _warn_of_tensors_stored_aside(label, layers, forward.made, results.tensors())
    if forward.created_variables:
        raise RematError(
            f"Remat region {label!r} created variables in its call (a layer built inside "
            "another's call): run the model once before the checkpointed step, so that its "
            "layers are built."
        )
    writes = list(forward.writes.items())
    snapshots = [(handle, forward.first_reads.get(key)) for key, (handle, _) in writes]
    closures = list(forward.closures.values())
    expected = forward.ops

    def backward(mask: tuple[bool, ...], upstream: list[tf.Tensor]) -> list:
        with tf_internals.stop_recording():
            current = [
                tf.raw_ops.ReadVariableOp(resource=handle, dtype=dtype)
                for _, (handle, dtype) in writes
            ]
            for handle, value in snapshots:
                if value is not None:
                    tf.raw_ops.AssignVariableOp(resource=handle, value=value)
        inputs = [tf.identity(t) for t in tensors]  # watched apart from the caller's
        watched = [t for t in inputs if differentiable(t)] + closures + variables
        # Checked op by op when it runs eagerly; a forward-mode accumulator traces it instead.
        recomputation = _Pass(label, inputs, expected=expected, holder=forward.holder)
        checking = _running(recomputation) if tf_internals.executing_eagerly() else None
        try:
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(watched)
                with checking or contextlib.nullcontext():
                    with tf_internals.keras_call_state_entered(state):
                        again = CallStructure(region(inputs)).tensors()
        finally:
            with tf_internals.stop_recording():
                for (_, (handle, _)), value in zip(writes, current):
                    tf.raw_ops.AssignVariableOp(resource=handle, value=value)
        if checking is not None:
            recomputation.check_complete()
        targets = [t for t, used in zip(again, mask) if used]
        return tape.gradient(
            targets,
            watched,
            output_gradients=upstream,
            unconnected_gradients=tf.UnconnectedGradients.NONE,
        )

    sources = [t for t in tensors if differentiable(t)] + closures
    return results.pack(attach_gradient(outputs, sources, variables, backward))


def _warn_of_tensors_stored_aside(label: str, layers: list, made: set[int], results) -> None:
    returned = {tf_internals.tensor_id(t) for t in results}
    inside = [x for layer in layers for x in [layer, *tf_internals.flatten_layers(layer, True)]]
    for layer in {id(x): x for x in inside}.values():
        for name, value in vars(layer).items():
            if (
                isinstance(value, tf.Tensor)
                and tf_internals.tensor_id(value) in made
                and tf_internals.tensor_id(value) not in returned
            ):
                warnings.warn(
                    f"Remat region {label!r}, called eagerly with nothing_saveable, kept a tensor "
                    f"of its call in {layer.name}.{name}: the gradient tapes did not record it, "
                    "so a loss computed from it gets no gradient through it. Return it from the "
                    "call, or call the step in a tf.function (Keras fit does), where reading it "
                    "outside the call is an error.",
                    TensorStoredAsideWarning,
                    stacklevel=2,
                )
