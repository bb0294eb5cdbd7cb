"""`checkpoint(fn_or_layer, policy)`: run a function or Keras layer as a rematerialized region.

Built the way `tf.recompute_grad` is - a `tf.custom_gradient` whose gradient function rebuilds the
region under its own tape - with what it lacks:

* any signature: arguments and results are flattened (nested structures, keyword arguments,
  non-tensor values closed over), so `tf.function` sees only tensors;
* policies and exact replay through `replay.Region` (saved values, random seeds, variable writes,
  determinism check);
* eager mode: op callbacks can only replace outputs while a graph is built, so an eager call runs
  the region through a `tf.function` of its own (traced once per input signature).

The recomputation starts from the inputs plus a zero derived from the upstream gradient (as in
`tf.recompute_grad`): a data dependency, which XLA cannot ignore, so it cannot hoist the
recomputation into the forward pass or merge it with the original computation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import keras
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.eager import context, record

from framework.remat.policies import Policy, everything_saveable, get_policy
from framework.remat.replay import Region, in_region, tagging

T = TypeVar("T")
TAG_ATTR = "_remat_checkpoint_name"


def checkpoint_name(x: T, name: str) -> T:
    """Identity that tags `x` (a tensor or nested structure of tensors) for name-based policies.

    Outside a checkpointed region it is a plain `tf.identity`.
    """

    def tag(t):
        with tagging(name):
            out = tf.identity(t)
        if not context.executing_eagerly():
            out.op._set_attr(TAG_ATTR, attr_value_pb2.AttrValue(s=name.encode()))
        return out

    return tf.nest.map_structure(tag, x)


def _is_tensor(x: Any) -> bool:
    return isinstance(x, tf.Tensor)


def _dependency(tensors: list) -> tf.Tensor:
    """A float32 zero that cannot be computed before `tensors` exist (NaN-safe, reads 1 element)."""
    for t in tensors:
        if t is not None and (t.dtype.is_floating or t.dtype.is_complex):
            elem = tf.reduce_max(tf.math.real(tf.reshape(t, [-1])[:1]))
            elem_bool = tf.cast(elem, tf.bool)
            return tf.where(tf.equal(elem_bool, elem_bool), 0.0, float("nan"))
    return tf.constant(0.0)


def _offset(t: tf.Tensor, dep: tf.Tensor) -> tf.Tensor:
    t = tf.identity(t)
    if t.dtype.is_floating or t.dtype.is_complex:
        return t + tf.cast(dep, t.dtype)
    return t


def _differentiable(t: Any) -> bool:
    return t is not None and (t.dtype.is_floating or t.dtype.is_complex)


class Checkpointed:
    """A callable running `fn` as a checkpointed region with `policy`; same signature as `fn`."""

    def __init__(self, fn: Callable, policy: str | Policy | None = "nothing_saveable"):
        self.fn = fn
        self.policy = get_policy(policy)
        self.label = getattr(fn, "__qualname__", None) or type(fn).__name__
        self._eager_fn = tf.function(self._traced_call, autograph=False)
        self._eager_layouts: dict[str, tuple] = {}
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args, **kwargs):
        if self.policy is everything_saveable:
            return self.fn(*args, **kwargs)
        if not record.could_possibly_record() and not in_region():
            return self.fn(*args, **kwargs)
        if context.executing_eagerly():
            return self._eager_call(*args, **kwargs)
        return self._graph_call(*args, **kwargs)

    def _traced_call(self, *args, **kwargs):
        """Body of the eager-mode `tf.function`: returns tensors only, keeps the rest aside."""
        out = self._graph_call(*args, **kwargs)
        flat = tf.nest.flatten(out, expand_composites=True)
        positions = [i for i, x in enumerate(flat) if _is_tensor(x)]
        graph_name = tf.compat.v1.get_default_graph().name
        self._eager_layouts[graph_name] = (out, flat, positions)
        return [flat[i] for i in positions]

    def _eager_call(self, *args, **kwargs):
        concrete = self._eager_fn.get_concrete_function(*args, **kwargs)
        tensors = concrete(*args, **kwargs)
        structure, flat, positions = self._eager_layouts[concrete.graph.name]
        flat = list(flat)
        for i, t in zip(positions, tensors, strict=False):
            flat[i] = t
        return tf.nest.pack_sequence_as(structure, flat, expand_composites=True)

    def _graph_call(self, *args, **kwargs):
        flat_in = tf.nest.flatten((args, kwargs), expand_composites=True)
        positions = [i for i, x in enumerate(flat_in) if _is_tensor(x)]
        fn, policy, label = self.fn, self.policy, self.label
        layout: dict[str, Any] = {}

        def call_with(tensors):
            full = list(flat_in)
            for i, t in zip(positions, tensors, strict=False):
                full[i] = t
            a, kw = tf.nest.pack_sequence_as((args, kwargs), full, expand_composites=True)
            return fn(*a, **kw)

        def split_outputs(out):
            flat_out = tf.nest.flatten(out, expand_composites=True)
            return flat_out, [i for i, x in enumerate(flat_out) if _is_tensor(x)]

        @tf.custom_gradient
        def region(*tensors):
            rec = Region(policy, label)
            with rec.recording(_dependency(list(tensors))), record.stop_recording():
                out = call_with(tensors)
            flat_out, out_positions = split_outputs(out)
            layout.update(structure=out, flat=flat_out, positions=out_positions)

            def grad_fn(*dresult, variables=None):
                dep = _dependency(list(dresult))
                variables = list(variables or [])
                with tf.GradientTape() as tape:
                    inputs = [_offset(t, dep) for t in tensors]
                    tape.watch([t for t in inputs if _differentiable(t)])
                    tape.watch(variables)
                    with rec.replaying(dep):
                        again = call_with(inputs)
                flat_again, _ = split_outputs(again)
                targets, upstream = [], []
                for i, g in zip(out_positions, dresult, strict=False):
                    if g is not None and _differentiable(flat_again[i]):
                        targets.append(flat_again[i])
                        upstream.append(g)
                sources = [t for t in inputs if _differentiable(t)]
                grads = tape.gradient(
                    targets,
                    sources + variables,
                    output_gradients=upstream,
                    unconnected_gradients=tf.UnconnectedGradients.ZERO,
                )
                grads_in = iter(grads[: len(sources)])
                input_grads = [next(grads_in) if _differentiable(t) else None for t in inputs]
                return input_grads, grads[len(sources) :]

            return [flat_out[i] for i in out_positions], grad_fn

        results = region(*[flat_in[i] for i in positions])
        flat_out = list(layout["flat"])
        for i, t in zip(layout["positions"], results, strict=False):
            flat_out[i] = t
        return tf.nest.pack_sequence_as(layout["structure"], flat_out, expand_composites=True)


def _checkpoint_layer(layer: keras.layers.Layer, policy: str | Policy | None):
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
    if "_remat_original_call" in layer.__dict__:
        del layer.__dict__["call"]
        del layer.__dict__["_remat_original_call"]
    return layer


def is_checkpointed(layer: keras.layers.Layer) -> bool:
    """Whether `checkpoint` or `set_grad_checkpointing` currently wraps this layer's `call`."""
    return "_remat_original_call" in layer.__dict__


def checkpoint(
    fn_or_layer: Callable | keras.layers.Layer,
    policy: str | Policy | None = "nothing_saveable",
):
    """Rematerializes `fn_or_layer` in the backward pass, keeping only what `policy` saves.

    For a function, returns a callable with the same signature (positional and keyword arguments,
    nested structures in and out, several outputs). For a Keras layer, wraps that layer's `call` in
    place and returns the same layer: weights, `training`, masks and serialization are untouched
    (the remat setting itself is not serialized; re-apply it after loading). Calls made without an
    active gradient tape (inference, Keras shape inference) run the original code unchanged.

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
