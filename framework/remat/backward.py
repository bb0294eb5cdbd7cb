"""One call of a checkpointed region: its forward pass traced and recorded, and its gradient -
the region rebuilt inline under a tape of its own (the recorded pass replayed, kept values
used), then differentiated. Graph-mode and eager calls share both.

Variables the region writes are put back to their values before the call for the
recomputation, and back to what the rest of the step left them afterwards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import tensorflow as tf

from framework.core import tf_internals
from framework.remat.call_structure import CallStructure
from framework.remat.dependencies import (
    dependency,
    differentiable,
    in_graph,
    tied_input,
    with_dep,
)
from framework.remat.effects import Effects, find_effects, stateful_random_error
from framework.remat.replay import Region
from framework.remat.state_order import assign_variable, read_variable


def trace_forward(
    region: Region, call: Callable[[list[tf.Tensor]], object], tensors: list[tf.Tensor]
) -> tuple[tf.types.experimental.ConcreteFunction, CallStructure, Effects]:
    """Traces `call(tensors)` as `region`'s forward pass: a function returning the results
    (flat, in the returned structure's order) and then the values the policy keeps, and the
    variables it writes.

    Raises:
      UnreplayableRandomOpError: when it draws from stateful random ops, which a recomputation
        cannot draw again.
    """
    layouts: list[CallStructure] = []
    pricing = pricing_at_static_shapes(region, call, tensors)

    def forward(*inputs):
        with region.recording(dependency(list(inputs))):
            layouts.append(CallStructure(call(list(inputs))))
        return layouts[-1].tensors() + region.saved(pricing)

    function = tf_internals.trace_function(forward, *tensors)
    effects = find_effects(function.graph)
    if effects.stateful_random_ops:
        raise stateful_random_error(region.label, effects.stateful_random_ops)
    return function, layouts[-1], effects


# What an unknown dimension of a region's inputs stands for when a policy prices its values.
STAND_IN_SIZE = 8


def pricing_at_static_shapes(
    region: Region,
    call: Callable[[list[tf.Tensor]], object],
    tensors: list[tf.Tensor | tf.TensorSpec],
) -> list | None:
    """What a policy that prices values by their shapes (a memory budget) should see of the
    region's ops, when the call leaves dimensions unknown: the ops of a second trace, for
    pricing only, with each unknown dimension of the inputs `STAND_IN_SIZE`. None when the
    policy prices nothing, every shape is known, a rank is not, or the code cannot run at those
    sizes (the pricing then counts an unknown dimension as 1).

    Keras' `fit` traces its step with the batch dimension unknown. Counting that dimension as
    any one size would not do: a dense layer flattens its input to `[batch x sequence, width]`,
    where the unknown dimension stands for a different product than in `[batch, sequence,
    width]`, and the budget would weigh the two wrongly against each other.
    """
    shapes = [t.shape for t in tensors]
    if getattr(region.policy, "select", None) is None:
        return None
    if all(s.is_fully_defined() for s in shapes) or any(s.rank is None for s in shapes):
        return None
    specs = [
        tf.TensorSpec([STAND_IN_SIZE if d is None else d for d in s.as_list()], t.dtype)
        for s, t in zip(shapes, tensors)
    ]
    probe = Region(region.policy, region.label, region.keep_random_keys)

    def forward(*inputs):
        with probe.recording(dependency(list(inputs))):
            call(list(inputs))
        return []

    try:
        tf_internals.trace_function(forward, *specs)
    except Exception:  # code that cannot run at the stand-in sizes: priced as traced
        return None
    return [e.info for e in probe.entries if e.candidate is not None]


@dataclasses.dataclass(frozen=True)
class RegionCall:
    """One call of a region, as its gradient function needs it.

    Attributes:
      region: the recorded forward pass.
      call: runs the region's code on a list of tensors (`CallStructure.tensors()`' order).
      tensors: the call's tensor arguments.
      closures: the differentiable tensors the traced region closes over, seen from the caller.
      effects: the variables the region writes.
      snapshots: their values before the call, read in the caller's graph.
    """

    region: Region
    call: Callable[[list[tf.Tensor]], object]
    tensors: list[tf.Tensor]
    closures: list[tf.Tensor]
    effects: Effects
    snapshots: list[tf.Tensor]


def recompute_gradients(
    forward: RegionCall, dy: list, variables: list[tf.Variable], kept_dy: list = ()
) -> list[tf.Tensor | None]:
    """Gradients for the call's tensors, closures and `variables`, in that order, from a
    recomputation of the region: `dy` are the upstream gradients of its results, `kept_dy`
    (None or missing for none) those of the values its policy kept, which an eager call's
    second-order gradient gives (`eager.EagerRegion`)."""
    region, effects = forward.region, forward.effects
    graph = tf.compat.v1.get_default_graph()
    dep = dependency(list(dy) + forward.tensors + forward.closures)
    # Closed-over tensors and variable handles, as the region's own code sees them from here:
    # it refers to the outermost tensor (an eager handle, say), not to a capture of a capture.
    handles = [in_graph(tf_internals.outermost(w.handle), graph) for w in effects.writes]
    with tf_internals.stop_recording():
        current = [read_variable(graph, h, w.dtype) for h, w in zip(handles, effects.writes)]
        for h, s in zip(handles, forward.snapshots):
            assign_variable(graph, h, in_graph(s, graph))
    inputs = [tied_input(t, dep) for t in forward.tensors]
    # Closed-over tensors are differentiated as the region's code refers to them: the outermost
    # tensor, seen from this graph; an eager tensor as itself (the tape then also follows the
    # function calls that captured it directly).
    outer = [tf_internals.outermost(c) for c in forward.closures]
    closures = [o if not tf.is_symbolic_tensor(o) else in_graph(o, graph) for o in outer]
    built_before = len(graph.get_operations())
    with tf.GradientTape() as tape:
        sources = [t for t in inputs if differentiable(t)]
        sources += closures + variables
        tape.watch(sources)
        with region.replaying(dep, handles):
            results = CallStructure(forward.call(inputs))
    reads = [
        op.outputs[0] for op in graph.get_operations()[built_before:] if op.type == "ReadVariableOp"
    ]
    tf_internals.pass_eager_captures_through_control_flow(graph)
    targets, upstream = [], []
    for t, g in zip(results.tensors() + region.replayed_kept(), list(dy) + list(kept_dy)):
        if g is not None and differentiable(t):
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
    flat = [next(grads) if differentiable(t) else None for t in inputs]
    flat += list(grads)
    # An optimizer may update a variable as soon as its gradient exists, while the recomputation
    # reads it again for the other gradients; graph mode orders the two by control edges alone,
    # which Grappler may drop (Keras' steps_per_execution loop: the update ran first, 1 time in 3).
    # A data edge from every read of the recomputation keeps them first.
    tie = dependency(reads, every=True)
    n_tied = len(flat) - len(variables)
    flat = flat[:n_tied] + [None if g is None else _tied(g, tie) for g in flat[n_tied:]]
    with tf_internals.stop_recording():
        finals = [assign_variable(graph, h, c) for h, c in zip(handles, current)]
    if finals:
        with tf.control_dependencies(finals):
            flat = [None if g is None else _identity(g) for g in flat]
    return flat


def _tied(gradient, dep: tf.Tensor):
    """`gradient` (a tensor or IndexedSlices), not computable before `dep` exists."""

    def tie(t):
        return with_dep(t, dep) if t.dtype.is_floating else t

    return tf.nest.map_structure(tie, gradient, expand_composites=True)


def _identity(gradient):
    return tf.nest.map_structure(tf.identity, gradient, expand_composites=True)
