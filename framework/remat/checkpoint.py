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
recomputation into the forward pass or merge it with the original computation. An eager call
runs the same traced forward pass (`backward.trace_forward`), and its gradient is an op of the
eager tape (`eager.EagerRegion`); the gradient function itself is `backward.recompute_gradients`.
An eager call of a Keras layer with `nothing_saveable`, whose variables are known, is not traced
at all (`eager_rerun`).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf

from framework.core import tf_internals
from framework.core.errors import RematError
from framework.remat import eager_rerun
from framework.remat.backward import RegionCall, recompute_gradients, trace_forward
from framework.remat.call_structure import CallStructure
from framework.remat.dependencies import differentiable, in_graph
from framework.remat.eager import EagerRegion
from framework.remat.op_callbacks import in_region
from framework.remat.policies import Policy, everything_saveable, get_policy, nothing_saveable
from framework.remat.replay import Region
from framework.remat.state_order import read_variable
from framework.remat.thread_state import ThreadSetting

_plain = ThreadSetting(False)


def plain_calls() -> contextlib.AbstractContextManager:
    """In this thread, checkpointed regions (and `remat.scan`'s steps) run as plain calls: the
    step as it would be without remat, e.g. to measure what remat saves (`remat.summary`)."""
    return _plain.set(True)


def remat_is_on(policy: Policy) -> bool:
    """Whether a region with `policy` recomputes in this thread (see `plain_calls`)."""
    return policy is not everything_saveable and not _plain.value


@tf_internals.called_as_is_by_autograph
class Checkpointed:
    """A callable running `fn` as a checkpointed region with `policy`; same signature as `fn`.

    It keeps `fn`'s name and signature but deliberately has no `__wrapped__`: `tf.function` and
    `inspect.unwrap` follow that attribute to the plain function and would silently skip remat.
    """

    def __init__(
        self,
        fn: Callable,
        policy: Policy,
        layers: Callable[[], list] | None = None,
    ):
        self.fn = fn
        self.policy = policy
        # The Keras layers `fn` runs, when known: their variables are then known before a call,
        # and an eager call with `nothing_saveable` needs no trace.
        self._layers = layers
        self.label = getattr(fn, "__qualname__", None) or type(fn).__name__
        for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
            if hasattr(fn, attr):
                setattr(self, attr, getattr(fn, attr))
        try:
            self.__signature__ = inspect.signature(fn)
        except (TypeError, ValueError):
            pass
        # Eager calls: one traced region per input signature, as `tf.function` keeps them
        # (a new function per call would also keep its kernels' constants alive for good).
        self._eager: dict = {}

    def __call__(self, *args, **kwargs):
        if tf_internals.executing_eagerly():
            with eager_rerun.nested_region():
                return self._call(*args, **kwargs)
        return self._call(*args, **kwargs)

    def _call(self, *args, **kwargs):
        if not remat_is_on(self.policy):
            return self.fn(*args, **kwargs)
        if not tf_internals.tape_is_active() and not in_region():
            return self.fn(*args, **kwargs)
        # Composite arguments (ragged, sparse) stay whole: the traced region captures them.
        arguments = CallStructure((args, kwargs), expand_composites=False)
        # A function is converted by AutoGraph as a direct call from the caller would convert
        # it; a layer's `call` never is (Keras 3 calls it as it is).
        fn = self.fn if self._layers is not None else tf_internals.autograph_like_caller(self.fn)
        # What the enclosing Keras layer call hands down (`training`, autocast): the
        # recomputation runs in it again, whether or not the code passes `training` on.
        state = tf_internals.keras_call_state()

        # The inputs whose masks the call took off: it runs on a traced function's inputs, so
        # the caller's tensors lose them after it.
        cleared: set[int] = set()

        def call(tensors):
            a, kw = arguments.pack(tensors)
            results = fn(*a, **kw)
            cleared.update(arguments.masks_cleared(tensors))
            return results

        if self._layers is None:
            results = self._run(call, arguments, state, None, cleared)
            arguments.clear_masks(sorted(cleared))
            return results
        # The layers it runs: its own, and any passed to it (a shared layer).
        layers = self._layers() + [x for x in arguments.flat if isinstance(x, keras.layers.Layer)]
        # Losses the layers add (add_loss, activity regularizers) are results of the region:
        # the forward pass's reach the layers from outside it, so that the step differentiates
        # them; the recomputation's are dropped.
        losses = tf_internals.keras_loss_lists(layers)
        held = sum(map(len, losses))
        stateless = tf_internals.keras_stateless_losses()
        held_statelessly = len(stateless or ())
        results, added = self._run(
            _collecting_losses(call, losses), arguments, state, layers, cleared
        )
        arguments.clear_masks(sorted(cleared))
        for held_list, new in zip(losses, added, strict=True):
            held_list.extend(new)
        if len(stateless or ()) != held_statelessly:
            raise RematError(
                f"Remat region {self.label!r} added losses in a stateless scope "
                "(`stateless_call(..., return_losses=True)`), which it cannot hand on: call the "
                "model itself, or leave this layer out of the checkpoint."
            )
        if sum(map(len, tf_internals.keras_loss_lists(layers))) != held + sum(map(len, added)):
            raise RematError(
                f"Remat region {self.label!r} added losses to a layer built inside its call, "
                "where the region cannot collect them: run the model once before the "
                "checkpointed step, so that its layers are built."
            )
        return results

    def _run(
        self,
        call: Callable,
        arguments: CallStructure,
        state,
        layers: list | None,
        cleared: set[int],
    ):
        """The call's results, from the path for this mode (graph, eager untraced or traced).
        A reused eager trace adds to `cleared` the masks its traced call took off."""
        tensors = arguments.tensors()
        if not tf_internals.executing_eagerly():
            return self._region(call, tensors, state)
        # Untraced, unless a forward-mode accumulator will call the gradient function alone, in
        # a state where a tape of its own records nothing (a traced backward pass works there).
        if (
            self.policy is nothing_saveable
            and layers is not None
            and not tf_internals.forward_accumulator_active()
        ):
            return eager_rerun.call(self.label, call, tensors, state, layers)
        key = arguments.eager_key(state)
        if key is not None:  # each replica of a strategy captures its own variables
            key = (key, tf_internals.current_device(), _trainable_flags(layers))
        region, masks_cleared = self._eager.get(key, (None, ()))
        if region is None or region.stale:
            region = EagerRegion(self.policy, self.label, call, tensors, state)
            # Tensors the region closes over were captured by value: trace again next time.
            if key is not None and not region.captures_values:
                self._eager[key] = (region, frozenset(cleared))
        cleared.update(masks_cleared)
        return region(tensors)

    def _region(self, call: Callable, tensors: list[tf.Tensor], state):
        """One call of the region in graph mode: traced forward function, gradient attached.
        `state` is the Keras call state the region is called in."""
        region = Region(self.policy, self.label)
        graph = tf.compat.v1.get_default_graph()
        # Arguments from an enclosing graph (a branch's or loop body's caller), captured here:
        # the region's gradient then reaches them through the control flow's own captures.
        tensors = [in_graph(t, graph) if isinstance(t, tf.Tensor) else t for t in tensors]
        function, layout, effects = trace_forward(region, call, tensors)
        # Captured eager tensors (closures, variable handles) as this graph sees them.
        closures = [in_graph(c, graph) for c in function.captured_inputs if differentiable(c)]
        with tf_internals.stop_recording():
            snapshots = [
                read_variable(graph, in_graph(w.handle, graph), w.dtype) for w in effects.writes
            ]
        region_call = RegionCall(region, call, tensors, closures, effects, snapshots)
        n_out = len(layout.tensors())
        watched = tf_internals.untrainable_variables_watched(function.graph.variables)

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
        def attach(*sources):
            outputs = run()
            for variable in watched:
                tf_internals.mark_read_for_custom_gradient(variable)

            def grad_fn(*dy, variables=None):
                variables = list(variables or [])
                # A result nothing reads gets TensorFlow's filled-in zeros as its gradient.
                dy = [
                    None if _unused(r) and _filled_with_zeros(g) else g for r, g in zip(results, dy)
                ]
                with tf_internals.keras_call_state_entered(state):
                    grads = recompute_gradients(region_call, dy, variables)
                n_inputs = len(tensors) + len(closures)
                return grads[:n_inputs], grads[n_inputs:]

            return outputs, grad_fn

        results.extend(attach(*tensors, *closures))
        return layout.pack(results)


def _trainable_flags(layers: list | None) -> tuple[bool, ...]:
    """Which of the layers (and those inside them) are trainable: freezing one (BatchNorm, to
    fine-tune) changes what the region computes, so a trace made before cannot be reused."""
    inside = [x for layer in layers or () for x in tf_internals.flatten_layers(layer, True)]
    return tuple(layer.trainable for layer in [*(layers or ()), *inside])


def _collecting_losses(call: Callable, losses: list[list]) -> Callable:
    """`call`, returning `(results, added)`: `added` holds, per list of `losses`, the losses the
    call appended to it, which it takes out again."""

    def collect(tensors):
        sizes = [len(x) for x in losses]
        results = call(tensors)
        added = [x[n:] for x, n in zip(losses, sizes)]
        for x, n in zip(losses, sizes):
            del x[n:]
        return results, added

    return collect


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


def loops_over_steps(layer: keras.layers.Layer) -> bool:
    """Whether `layer` applies its own steps in a loop and checkpoints each step itself (e.g.
    `framework.models.scan.ScannedBlocks`): it has `remat_policy` and `set_remat_policy`."""
    return callable(getattr(layer, "set_remat_policy", None))


def _checkpoint_layer(layer: keras.layers.Layer, policy: Policy):
    if loops_over_steps(layer):
        layer.set_remat_policy(None if policy is everything_saveable else policy)
        return layer
    original = layer.__dict__.get("_remat_original_call")
    if original is None:
        original = layer.call
    if policy is everything_saveable:
        unwrap_layer(layer)
        return layer
    wrapped = Checkpointed(original, policy, layers=lambda: [layer])
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


def layer_policy(layer: keras.layers.Layer) -> Policy | None:
    """The policy `layer` is checkpointed with (each step's, for a layer that loops over its
    steps), or None when it is not checkpointed."""
    if loops_over_steps(layer):
        return None if layer.remat_policy is None else get_policy(layer.remat_policy)
    wrapped = layer.__dict__.get("call")
    return wrapped.policy if isinstance(wrapped, Checkpointed) else None


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
        Variables it reads receive gradients (a non-trainable one when a tape watches it, as
        without remat). It must build the same ops on every call.
      policy: a name from `policies.policy_names()`, a predicate over `policies.OpInfo`, or None
        (no remat).
    """
    policy = get_policy(policy)
    if isinstance(fn_or_layer, keras.layers.Layer):
        return _checkpoint_layer(fn_or_layer, policy)
    if not callable(fn_or_layer):
        raise TypeError(f"checkpoint expects a callable or a Keras layer, got {fn_or_layer!r}")
    return Checkpointed(fn_or_layer, policy)
