"""`checkpoint(fn_or_layer, policy)`: run a function or Keras layer as a rematerialized region.

How a call works (see docs/remat.md, "How it works"):

1. The region is traced into a function graph of its own, with op callbacks recording its top
   level (`replay.Region`). Tracing first makes everything the region depends on explicit: the
   tensors it closes over are the function's captured inputs, and the variables it writes are
   found in the graph, nested functions included (`effects.find_effects`).
2. Snapshots of the written variables are read, then the function is called. Its extra outputs
   are the values the policy keeps. A `tf.custom_gradient` over the inputs *and* the closed-over
   tensors attaches the gradient function, so closures get their gradients.
3. The gradient function puts the snapshots back, rebuilds the region inline under a tape of its
   own (replaying kept values, checking that it builds the same ops), differentiates it, and
   puts the variables back as the rest of the step left them.

The recomputation starts from the inputs plus a zero derived from the upstream gradient (as in
`tf.recompute_grad`): a data dependency, which XLA cannot ignore, so it cannot hoist the
recomputation into the forward pass or merge it with the original computation. In eager mode
the whole call is traced into a `tf.function` first (op callbacks can only replace outputs while
a graph is built).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import keras
import numpy as np
import tensorflow as tf

from framework.core import tf_internals
from framework.remat.effects import find_effects
from framework.remat.policies import Policy, everything_saveable, get_policy
from framework.remat.replay import (
    Region,
    StateOrder,
    UnreplayableRandomOpError,
    in_graph,
    in_region,
    tagging,
)

T = TypeVar("T")
TAG_ATTR = "_remat_checkpoint_name"
_names = threading.local()


@contextlib.contextmanager
def without_checkpoint_names() -> Iterator[None]:
    """In this thread, `checkpoint_name` is a plain `tf.identity` that tags nothing.

    For graphs no policy will ever read, such as a model's serving function in a SavedModel
    (`framework.export`): they then carry no attribute of the remat library.
    """
    previous = getattr(_names, "off", False)
    _names.off = True
    try:
        yield
    finally:
        _names.off = previous


def checkpoint_name(x: T, name: str) -> T:
    """Identity that tags `x` (a tensor or nested structure of tensors) for name-based policies.

    Outside a checkpointed region it is a plain `tf.identity`.
    """
    if getattr(_names, "off", False):
        return tf.nest.map_structure(tf.identity, x)

    def tag(t):
        with tagging(name):
            out = tf.identity(t)
        if not tf_internals.executing_eagerly():
            tf_internals.set_string_attr(out.op, TAG_ATTR, name)
        return out

    return tf.nest.map_structure(tag, x)


def _is_tensor(x: Any) -> bool:
    return isinstance(x, tf.Tensor)


def _differentiable(t: Any) -> bool:
    return t is not None and (t.dtype.is_floating or t.dtype.is_complex)


def _dependency(tensors: list) -> tf.Tensor:
    """A float32 zero that cannot be computed before `tensors` exist (NaN-safe, reads 1 element
    of each of the first two floating-point tensors)."""
    zero = tf.constant(0.0)
    used = 0
    for t in tensors:
        if _differentiable(t) and used < 2:
            elem = tf.reduce_max(tf.math.real(tf.reshape(t, [-1])[:1]))
            elem_bool = tf.cast(elem, tf.bool)
            zero = zero + tf.where(tf.equal(elem_bool, elem_bool), 0.0, float("nan"))
            used += 1
    return zero


def _offset(t: tf.Tensor, dep: tf.Tensor) -> tf.Tensor:
    t = tf.identity(t)
    if _differentiable(t):
        return t + tf.cast(dep, t.dtype)
    return t


def _signature(
    args: tuple, kwargs: dict, flat: list, state: tf_internals.KerasCallState
) -> tuple | None:
    """A hashable key for an eager call: its structure, tensor shapes and dtypes (and Keras
    masks), the other values as they are, the Keras call state (None when one of them cannot
    be hashed: such calls are traced every time)."""

    def leaf(x):
        if _is_tensor(x):
            mask = _mask(x)
            return (tuple(x.shape), x.dtype, None if mask is None else tuple(mask.shape))
        if isinstance(x, tf.Variable):
            return (type(x), x.ref())
        return (type(x), x)

    structure = repr(tf.nest.map_structure(lambda _: None, (args, kwargs)))
    key = (structure, tuple(leaf(x) for x in flat), state)
    try:
        hash(key)
    except TypeError:
        return None
    return key


class _Layout:
    """The structure of a region's results: where its tensors go among the other values, and
    which of them carry a Keras mask (returned after the tensors, attached again by `pack`)."""

    def __init__(self, out: Any):
        self.structure = out
        self.flat = tf.nest.flatten(out, expand_composites=True)
        self.positions = [i for i, x in enumerate(self.flat) if _is_tensor(x)]
        self.masked = [k for k, i in enumerate(self.positions) if _mask(self.flat[i]) is not None]

    def tensors(self) -> list[tf.Tensor]:
        tensors = [self.flat[i] for i in self.positions]
        return tensors + [_mask(tensors[k]) for k in self.masked]

    def pack(self, tensors: list[tf.Tensor]) -> Any:
        flat = list(self.flat)
        for i, t in zip(self.positions, tensors):
            flat[i] = t
        n = len(self.positions)
        _attach_masks([flat[i] for i in self.positions], self.masked, tensors[n:])
        return tf.nest.pack_sequence_as(self.structure, flat, expand_composites=True)


def _mask(t: Any) -> tf.Tensor | None:
    mask = tf_internals.keras_mask(t)
    return mask if _is_tensor(mask) else None


def _attach_masks(tensors: list[tf.Tensor], masked: list[int], masks: list[tf.Tensor]) -> None:
    """Attaches `masks[j]` to `tensors[masked[j]]`: Keras masks ride on tensors as attributes,
    which a function's inputs and outputs do not carry, so regions pass them as tensors."""
    for k, mask in zip(masked, masks, strict=True):
        tf_internals.set_keras_mask(tensors[k], mask)


class Checkpointed:
    """A callable running `fn` as a checkpointed region with `policy`; same signature as `fn`.

    It keeps `fn`'s name and signature but deliberately has no `__wrapped__`: `tf.function` and
    `inspect.unwrap` follow that attribute to the plain function and would silently skip remat.
    """

    def __init__(self, fn: Callable, policy: str | Policy | None = "nothing_saveable"):
        self.fn = fn
        self.policy = get_policy(policy)
        self.label = getattr(fn, "__qualname__", None) or type(fn).__name__
        for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
            if hasattr(fn, attr):
                setattr(self, attr, getattr(fn, attr))
        try:
            self.__signature__ = inspect.signature(fn)
        except (TypeError, ValueError):
            pass
        # Eager calls: one traced function per input signature, as `tf.function` keeps them
        # (a new function per call would also keep its kernels' constants alive for good).
        self._traced: dict = {}

    @tf.autograph.experimental.do_not_convert
    def __call__(self, *args, **kwargs):
        if self.policy is everything_saveable:
            return self.fn(*args, **kwargs)
        if not tf_internals.tape_is_active() and not in_region():
            return self.fn(*args, **kwargs)
        flat = tf.nest.flatten((args, kwargs))
        positions = [i for i, x in enumerate(flat) if _is_tensor(x)]
        masked = [k for k, i in enumerate(positions) if _mask(flat[i]) is not None]
        fn = tf_internals.autograph_like_caller(self.fn)
        # What the enclosing Keras layer call hands down (`training`, autocast): the
        # recomputation runs in it again, whether or not the code passes `training` on.
        state = tf_internals.keras_call_state()

        def call(tensors):
            full = list(flat)
            for i, t in zip(positions, tensors):
                full[i] = t
            _attach_masks(tensors, masked, tensors[len(positions) :])
            a, kw = tf.nest.pack_sequence_as((args, kwargs), full)
            return fn(*a, **kw)

        tensors = [flat[i] for i in positions]
        tensors += [_mask(tensors[k]) for k in masked]
        if not tf_internals.executing_eagerly():
            return self._region(call, tensors, state)
        key = _signature(args, kwargs, flat, state)
        if key is not None:  # each replica of a strategy captures its own variables
            key = (key, tf_internals.current_device())
        if key not in self._traced:
            layouts: list[_Layout] = []

            def traced(*inputs):
                layouts.append(_Layout(self._region(call, list(inputs), state)))
                return layouts[-1].tensors()

            function = tf_internals.trace_function(traced, *tensors)
            # Tensors the region closes over were captured by value: trace again next time.
            if key is None or any(c.dtype != tf.resource for c in function.captured_inputs):
                return layouts[-1].pack(function(*tensors))
            self._traced[key] = (function, layouts[-1])
        function, layout = self._traced[key]
        return layout.pack(function(*tensors))

    def _region(self, call: Callable, tensors: list[tf.Tensor], state):
        """One call of the region in graph mode: traced forward function, gradient attached.
        `state` is the Keras call state the region is called in."""
        region = Region(self.policy, self.label)
        layouts: list[_Layout] = []

        def forward(*inputs):
            dep = _dependency(list(inputs))
            with region.recording(dep):
                layouts.append(_Layout(call(list(inputs))))
            return layouts[-1].tensors() + region.saved()

        function = tf_internals.trace_function(forward, *tensors)
        layout = layouts[-1]
        effects = find_effects(function.graph)
        if effects.stateful_random_ops:
            raise UnreplayableRandomOpError(
                f"Remat region {self.label!r} contains stateful random ops "
                f"({', '.join(effects.stateful_random_ops)}); their recomputation would draw "
                "different numbers and give wrong gradients. Use stateless randomness instead: "
                "keras.random / keras.layers.Dropout with a SeedGenerator, "
                "tf.random.stateless_*, or tf.random.Generator."
            )
        graph = tf.compat.v1.get_default_graph()
        # Captured eager tensors (closures, variable handles) as this graph sees them.
        closures = [in_graph(c, graph) for c in function.captured_inputs if _differentiable(c)]
        with tf_internals.stop_recording():
            snapshots = [_read(graph, in_graph(w.handle, graph), w.dtype) for w in effects.writes]
        n_out = len(layout.tensors())

        def run() -> list[tf.Tensor]:
            with tf.control_dependencies(snapshots):
                results = function(*tensors)
            region.keep(results[n_out:])
            return results[:n_out]

        if not n_out:
            run()
            return layout.pack([])

        results: list[tf.Tensor] = []  # the region's results as the rest of the step reads them

        @tf.custom_gradient
        def attach(*differentiable):
            outputs = run()

            def grad_fn(*dy, variables=None):
                variables = list(variables or [])
                # A result nothing reads gets TensorFlow's filled-in zeros as its gradient.
                dy = [
                    None if _unused(r) and _filled_with_zeros(g) else g for r, g in zip(results, dy)
                ]
                with tf_internals.keras_call_state_entered(state):
                    grads = self._backward(
                        region, call, tensors, closures, effects, snapshots, dy, variables
                    )
                return grads[: len(tensors) + len(closures)], grads[len(tensors) + len(closures) :]

            return outputs, grad_fn

        results.extend(attach(*tensors, *closures))
        return layout.pack(results)

    def _backward(self, region, call, tensors, closures, effects, snapshots, dy, variables):
        """Gradients for tensors + closures + variables, from a recomputation of the region."""
        graph = tf.compat.v1.get_default_graph()
        dep = _dependency(list(dy) + list(tensors) + list(closures))
        # Closed-over tensors and variable handles, as the region's own code sees them from here:
        # it refers to the outermost tensor (an eager handle, say), not to a capture of a capture.
        handles = [in_graph(tf_internals.outermost(w.handle), graph) for w in effects.writes]
        with tf_internals.stop_recording():
            current = [_read(graph, h, w.dtype) for h, w in zip(handles, effects.writes)]
            for h, s in zip(handles, snapshots):
                _assign(graph, h, in_graph(s, graph))
        inputs = [_offset(t, dep) for t in tensors]
        # Closed-over tensors are differentiated as the region's code refers to them: the outermost
        # tensor, seen from this graph; an eager tensor as itself (the tape then also follows the
        # function calls that captured it directly).
        outer = [tf_internals.outermost(c) for c in closures]
        closures = [o if not tf.is_symbolic_tensor(o) else in_graph(o, graph) for o in outer]
        with tf.GradientTape() as tape:
            sources = [t for t in inputs if _differentiable(t)]
            sources += closures + variables
            tape.watch(sources)
            with region.replaying(dep, handles):
                layout = _Layout(call(inputs))
        tf_internals.pass_eager_captures_through_loop(graph)
        targets, upstream = [], []
        for t, g in zip(layout.tensors(), dy):
            if g is not None and _differentiable(t):
                targets.append(t)
                upstream.append(g)
        grads = iter(
            tape.gradient(
                targets,
                sources,
                output_gradients=upstream,
                unconnected_gradients=tf.UnconnectedGradients.NONE,
            )
        )
        flat = [next(grads) if _differentiable(t) else None for t in inputs]
        flat += list(grads)
        with tf_internals.stop_recording():
            finals = [_assign(graph, h, c) for h, c in zip(handles, current)]
        if finals:
            with tf.control_dependencies(finals):
                flat = [None if g is None else _identity(g) for g in flat]
        return flat


def _unused(result: tf.Tensor) -> bool:
    """Whether no op of the step reads `result` (a graph tensor; eager ones count as used)."""
    return tf.is_symbolic_tensor(result) and not result.consumers()


def _filled_with_zeros(gradient) -> bool:
    """Whether `gradient` is zeros of the kinds TensorFlow's gradient code puts in for a result
    nothing uses (a constant, `Fill` or `ZerosLike`). Differentiating through those would give
    zeros, not None, to inputs and variables that reach only unused results; `_unused` tells
    them from a real zero gradient of the same form (`sign`'s is `ZerosLike`)."""
    op = getattr(gradient, "op", None)
    if op is None or op.type not in ("Const", "Fill", "ZerosLike"):
        return False
    if op.type == "ZerosLike":
        return True
    value = tf.get_static_value(op.inputs[1] if op.type == "Fill" else gradient)
    return value is not None and not np.any(value)


def _identity(gradient):
    return tf.nest.map_structure(tf.identity, gradient, expand_composites=True)


def _read(graph: tf.Graph, handle: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    value = tf.raw_ops.ReadVariableOp(resource=handle, dtype=dtype)
    StateOrder.chain(graph, handle, [value.op])
    return value


def _assign(graph: tf.Graph, handle: tf.Tensor, value: tf.Tensor) -> tf.Operation:
    op = tf.raw_ops.AssignVariableOp(resource=handle, value=value)
    StateOrder.chain(graph, handle, [op])
    return op


def loops_over_steps(layer: keras.layers.Layer) -> bool:
    """Whether `layer` applies its own steps in a loop and checkpoints each step itself (e.g.
    `framework.models.scan.ScannedBlocks`): it has `remat_policy` and `set_remat_policy`."""
    return callable(getattr(layer, "set_remat_policy", None))


def _checkpoint_layer(layer: keras.layers.Layer, policy: str | Policy | None):
    if loops_over_steps(layer):
        layer.set_remat_policy(None if get_policy(policy) is everything_saveable else policy)
        return layer
    original = layer.__dict__.get("_remat_original_call")
    if original is None:
        original = layer.call
    if get_policy(policy) is everything_saveable:
        unwrap_layer(layer)
        return layer
    wrapped = Checkpointed(original, policy)
    wrapped.label = layer.name
    object.__setattr__(layer, "_remat_original_call", original)
    object.__setattr__(layer, "call", wrapped)
    return layer


def unwrap_layer(layer: keras.layers.Layer) -> keras.layers.Layer:
    """Undoes `checkpoint(layer)`: the layer calls its own `call` again."""
    if loops_over_steps(layer):
        layer.set_remat_policy(None)
    if "_remat_original_call" in layer.__dict__:
        del layer.__dict__["call"]
        del layer.__dict__["_remat_original_call"]
    return layer


def is_checkpointed(layer: keras.layers.Layer) -> bool:
    """Whether `checkpoint` or `set_grad_checkpointing` currently wraps this layer's `call` (or,
    for a layer that loops over its steps, checkpoints each step)."""
    if loops_over_steps(layer):
        return layer.remat_policy is not None
    return "_remat_original_call" in layer.__dict__


def checkpoint(
    fn_or_layer: Callable | keras.layers.Layer,
    policy: str | Policy | None = "nothing_saveable",
):
    """Rematerializes `fn_or_layer` in the backward pass, keeping only what `policy` saves.

    For a function, returns a callable with the same signature (positional and keyword arguments,
    nested structures in and out, several outputs). For a Keras layer, wraps that layer's `call` in
    place and returns the same layer: weights, `training`, masks and serialization are untouched
    (the remat setting itself is not serialized; re-apply it after loading). A layer that loops
    over its own steps (`set_remat_policy`, as `ScannedBlocks`) checkpoints each step instead.
    Calls made without an active gradient tape (inference, Keras shape inference) run the
    original code unchanged.

    Args:
      fn_or_layer: the region: a function of tensors (and any non-tensor values) or a Keras layer.
        Variables it reads receive gradients. It must build the same ops on every call.
      policy: a name from `policies.policy_names()`, a predicate over `policies.OpInfo`, or None
        (no remat).
    """
    policy = get_policy(policy)
    if isinstance(fn_or_layer, keras.layers.Layer):
        return _checkpoint_layer(fn_or_layer, policy)
    if not callable(fn_or_layer):
        raise TypeError(f"checkpoint expects a callable or a Keras layer, got {fn_or_layer!r}")
    return Checkpointed(fn_or_layer, policy)
