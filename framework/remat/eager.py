"""A checkpointed region called eagerly: its forward pass traced once, its gradient an op of the
eager tape with a backward pass traced once per set of results the step uses.

Op callbacks can replace outputs only while a graph is built, so the region's forward pass is a
traced function (recorded by `replay.Region`; its extra outputs are the values the policy
keeps), run with the tapes paused. What the tapes see instead is one op from the call's tensors,
the tensors the region closes over and the trainable variables it reads to its results.

Each result reaches the caller through a gate whose gradient marks it as used. The tape fills in
zeros for the gradient of a result nothing uses before any gradient function sees it; by the
time the region's gradient runs, the gates of the used results have run, so it differentiates
the used results alone and inputs and variables that reach only unused results get None, as
they do without remat (and in graph mode, where the unused results are read off the graph).

Where a second-order gradient could follow (a persistent tape or several tapes watch the call,
or a forward accumulator), the values the policy keeps are results of the op too, gated the
same way, and the gradient function reads them through their gates. A first-order gradient
leaves them unused; a second-order one differentiates the gradient function, reaches them, and
the region's gradient then differentiates its recomputed ops' outputs where they were kept:
without that path, the kept values would be constants to the outer tape and the second-order
gradient would miss every term through them (graph mode has the path through its forward call
op). With a single non-persistent tape they stay off the tape, which would otherwise fill in
zeros of each one's size for the gradient function.
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from framework.core import tf_internals
from framework.remat.backward import RegionCall, recompute_gradients, trace_forward
from framework.remat.dependencies import differentiable
from framework.remat.policies import Policy
from framework.remat.replay import Region


class EagerRegion:
    """One traced forward pass of a region, called eagerly as often as its inputs match.

    Attributes:
      layout: the structure of the region's results.
      captures_values: whether the traced pass closed over tensors (by value), in which case it
        must not be reused for a later call.
    """

    def __init__(
        self,
        policy: Policy,
        label: str,
        call: Callable[[list[tf.Tensor]], object],
        tensors: list[tf.Tensor],
        state: tf_internals.KerasCallState,
    ):
        self._region = Region(policy, label)
        self._call = call
        self._state = state
        with tf_internals.watching_variables() as read:
            self._forward, self.layout, self._effects = trace_forward(self._region, call, tensors)
        self._variables = read  # the trainable ones; a tape may watch the others (below)
        self._every_variable = list(self._forward.graph.variables)
        # What a layer computes depends on its `trainable` flag (a frozen BatchNorm normalizes
        # with its moving statistics): a trace is stale once one of the layers it ran changes it.
        self._trainable = [(layer, layer.trainable) for layer in self._region.layers_run.values()]
        captured = self._forward.captured_inputs
        self._closures = [c for c in captured if differentiable(c)]
        self.captures_values = any(c.dtype != tf.resource for c in captured)
        self._backward: dict[tuple, tuple[Callable, list[bool]]] = {}

    @property
    def stale(self) -> bool:
        """Whether a Keras layer the trace ran has been frozen or unfrozen since."""
        return any(layer.trainable != trainable for layer, trainable in self._trainable)

    def __call__(self, tensors: list[tf.Tensor]):
        """Runs the region on `tensors`; returns its results, packed as the region returns them."""
        n_out = len(self.layout.tensors())
        with tf_internals.stop_recording():
            snapshots = [
                tf.raw_ops.ReadVariableOp(resource=tf_internals.outermost(w.handle), dtype=w.dtype)
                for w in self._effects.writes
            ]
            results = self._forward(*tensors)
        outputs, kept = list(results[:n_out]), list(results[n_out:])
        first_order = tuple(differentiable(t) for t in outputs) + (False,) * len(kept)
        accumulating = tf_internals.forward_accumulator_active()
        variables = [
            *self._variables,
            *tf_internals.untrainable_variables_watched(self._every_variable),
        ]
        # A forward-mode accumulator calls the gradient function alone (no gate runs: every
        # result counts as used), in a state where a trace's own tapes record nothing: the
        # backward pass is traced now. Otherwise a tape's gradient traces it when it runs, for
        # the results the step used: traced here for all of them, it was traced twice whenever
        # the step left one unused (the position bias T5's last blocks hand on).
        if accumulating and any(first_order):
            every = tuple(differentiable(t) for t in outputs + kept)
            self._backward_for(every, variables, tensors, kept, snapshots)
        gated_kept: list[tf.Tensor] = []  # the kept values as the gradient function reads them

        def backward(mask: tuple[bool, ...], upstream: list[tf.Tensor]) -> list:
            mask += (False,) * (len(first_order) - len(mask))  # kept values not on the tape
            function, connected = self._backward_for(mask, variables, tensors, kept, snapshots)
            # (Before the gates exist when a forward accumulator calls it as the op is recorded.)
            grads = iter(function(*tensors, *(gated_kept or kept), *snapshots, *upstream))
            flat = [next(grads) if has else None for has in connected]
            # To the op's inputs: the differentiable tensors, closures and variables.
            by_tensor, rest = flat[: len(tensors)], flat[len(tensors) :]
            return [g for t, g in zip(tensors, by_tensor) if differentiable(t)] + rest

        sources = [t for t in tensors if differentiable(t)] + self._closures
        # Only where a second-order gradient could follow: the tape fills in zeros for every
        # result a gradient leaves unused, a kept value's size each.
        recorded = outputs + kept
        watched = sources + [v.handle for v in variables]
        if not accumulating and not tf_internals.higher_order_gradient_possible(watched):
            recorded = outputs
        gated = attach_gradient(recorded, sources, variables, backward)
        gated_kept.extend(gated[n_out:] or kept)
        return self.layout.pack(gated[:n_out])

    def _backward_for(
        self,
        mask: tuple[bool, ...],
        variables: list[tf.Variable],
        tensors: list[tf.Tensor],
        kept: list[tf.Tensor],
        snapshots: list[tf.Tensor],
    ) -> tuple[Callable, list[bool]]:
        """The traced backward pass for the results `mask` marks as used (the region's results,
        then its kept values), and which of its gradients exist (the tensors', closures' and
        variables', in that order)."""
        key = (mask, len(variables), *map(id, variables[len(self._variables) :]))
        if key not in self._backward:
            n_tensors, n_kept, n_snapshots = len(tensors), len(kept), len(snapshots)
            n_out = len(mask) - n_kept
            connected: list[bool] = []

            def backward(*args):
                self._region.keep(list(args[n_tensors : n_tensors + n_kept]))
                upstream = iter(args[n_tensors + n_kept + n_snapshots :])
                dy = [next(upstream) if used else None for used in mask]
                forward = RegionCall(
                    self._region,
                    self._call,
                    list(args[:n_tensors]),
                    self._closures,
                    self._effects,
                    list(args[n_tensors + n_kept : n_tensors + n_kept + n_snapshots]),
                )
                with tf_internals.keras_call_state_entered(self._state):
                    grads = recompute_gradients(forward, dy[:n_out], variables, kept_dy=dy[n_out:])
                connected.extend(g is not None for g in grads)
                return [g for g in grads if g is not None]

            outputs = self.layout.tensors() + kept
            specs = [_spec(t) for t in tensors + kept + snapshots]
            specs += [_spec(o) for o, used in zip(outputs, mask) if used]
            self._backward[key] = (tf_internals.trace_function(backward, *specs), connected)
        return self._backward[key]


def attach_gradient(
    outputs: list[tf.Tensor],
    sources: list[tf.Tensor],
    variables: list[tf.Variable],
    backward: Callable[[tuple[bool, ...], list[tf.Tensor]], list],
) -> list[tf.Tensor]:
    """Records on the eager tapes one op from `sources` and `variables` (read, for tapes that
    watch what a step reads) to the differentiable `outputs`, and returns the outputs through
    gates that mark which of them a gradient uses.

    `backward(mask, upstream)` gives one gradient (or None) per source and variable: `mask` says
    which outputs are used (all differentiable ones when no gate ran), `upstream` holds their
    gradients, in order.
    """
    flowing = [k for k, t in enumerate(outputs) if differentiable(t)]
    if not flowing:
        return outputs
    every = tuple(differentiable(t) for t in outputs)
    used = [False] * len(outputs)

    def gradient(*dy):
        mask = tuple(used) if any(used) else every
        used[:] = [False] * len(outputs)
        return backward(mask, [g for k, g in zip(flowing, dy) if mask[k]])

    for variable in variables:
        tf_internals.mark_read(variable)
    tf_internals.record_gradient(
        "RematRegion",
        [outputs[k] for k in flowing],
        sources + [v.handle for v in variables],
        gradient,
    )
    return [_gate(t, used, k) if k in flowing else t for k, t in enumerate(outputs)]


def _gate(result: tf.Tensor, used: list[bool], k: int) -> tf.Tensor:
    """`result` as the caller gets it: the same value, whose gradient marks result `k` used."""
    with tf_internals.stop_recording():
        gated = tf.identity(result)

    def gradient(dy):
        used[k] = True
        return [dy]

    tf_internals.record_gradient("RematResult", [gated], [result], gradient)
    return gated


def _spec(t: tf.Tensor) -> tf.TensorSpec:
    return tf.TensorSpec(t.shape, t.dtype)
