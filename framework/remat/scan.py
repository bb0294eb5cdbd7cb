"""`scan(step, carry, xs, consts, policy)`: a loop over stacked slices whose every step is a
checkpointed region, with a gradient of its own.

A `tf.while_loop` gets TensorFlow's generic loop gradient: whatever the body's gradient reads is
pushed onto a per-iteration accumulator, a stacked input the body slices is carried through the
loop state, and its gradient is a full-size `[length, ...]` accumulator added to on every
iteration. Under XLA that is about two extra copies of every stacked weight (a loop-state copy and
the accumulator) beyond what the unrolled loop holds. Here, as in JAX's transpose of a scan:

* the forward loop runs each step through one traced function (`replay.Region` records it and the
  policy picks what it keeps) and writes, into one slot per step, the carry it started from and
  the values the policy kept;
* the backward loop runs in reverse: it rebuilds step i from its carry and kept values (the
  region's replay, under a tape), and writes step i's gradients into slot i of one `[length, ...]`
  buffer per stacked input (under XLA an in-place `dynamic-update-slice`); the gradients of the
  per-step constants are summed over the steps.

Each step reads its slices with `tf.gather` from the stacked tensors, which the loop only passes
through, so nothing copies them. A float32 slice is read as its bits, behind an optimization
barrier: a TPU multiplies float32 in bfloat16, and its compiler's bfloat16 propagation would
otherwise find that every reader of a stacked weight wants bfloat16 and convert the whole stack
once, before the loops - a second copy of every stacked weight, live for the whole step (at
depth 48, 1.15 times the unrolled step's temporaries in TPU v5e's plan). Integers cannot be
narrowed, and the barrier keeps the bits from being folded back into floats before that pass.
The steps' random ops draw from seeds passed in `xs` (e.g. the dropout seed states of stacked
Keras layers), so the recomputation draws the forward pass's bits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tensorflow as tf

from framework.core import tf_internals
from framework.core.errors import RematError
from framework.remat.backward import pricing_at_static_shapes
from framework.remat.checkpoint import remat_is_on
from framework.remat.dependencies import dependency, differentiable, tied_input
from framework.remat.policies import Policy, get_policy
from framework.remat.replay import Region

Step = Callable[[tf.Tensor, list, list], tuple]


def scan(
    step: Step,
    carry: tf.Tensor,
    xs: Sequence[tf.Tensor],
    consts: Sequence[tf.Tensor] = (),
    policy: str | Policy | None = "nothing_saveable",
    label: str = "scan",
) -> tuple[tf.Tensor, list[tf.Tensor]]:
    """Runs `carry, ys_i = step(carry, [x[i] for x in xs], consts)` for i in range(length).

    Args:
      step: the loop body. It returns the new carry (the same shape and dtype) and a list of
        per-step outputs; it must build the same ops on every call and read no variable (pass
        weights in `xs` or `consts`).
      carry: the loop's state (a tensor); differentiated.
      xs: tensors with a leading axis of the loop's length (static); step i reads slice i.
        Floating-point ones are differentiated.
      consts: tensors every step reads whole (floating-point ones are differentiated). A
        step may also close over eager tensors, differentiated as `consts` are; a graph tensor
        it closes over must be passed in `consts` (an error says so).
      policy: what each step keeps for the backward pass (`remat.get_policy`). None is
        TensorFlow's own loop gradient, which keeps one copy per step of every value the step's
        gradient reads, elementwise ones included; `dots_saveable` recomputes no matmul either
        and keeps less.
      label: the region's name in errors and in `saved_residuals`.

    Returns:
      The final carry and the per-step outputs, each stacked on a new leading axis.
    """
    xs, consts = list(xs), list(consts)
    if not xs or xs[0].shape[0] is None:
        raise ValueError("remat.scan needs at least one stacked input with a static length")
    length = int(xs[0].shape[0])
    policy = get_policy(policy)
    if not remat_is_on(policy):
        return _plain_loop(step, carry, xs, consts, length, label)
    # Kept keys would reach the backward loop through its state, where the TPU planner's
    # lowering of auto-selected random ops cannot trace them to their seed.
    region = Region(policy, label, keep_random_keys=False)
    call_state = tf_internals.keras_call_state()
    n_x, n_y = len(xs), []
    specs = _step_specs(carry, xs, consts)
    # Keras' `fit` leaves the batch unknown: a budget prices the step at static shapes.
    pricing = pricing_at_static_shapes(
        region, lambda args: step(args[0], args[1 : 1 + n_x], args[1 + n_x :]), specs
    )

    def forward(h, *args):
        with region.recording(dependency([h])):
            new_h, ys = step(h, list(args[:n_x]), list(args[n_x:]))
        n_y.append(len(ys))
        return [new_h, *ys, *region.saved(pricing)]

    forward_fn = tf_internals.trace_function(forward, *specs)
    _check_captures(forward_fn, label)
    # Eager tensors the step closes over: differentiated as consts, read by the step's own code.
    closures = [c for c in forward_fn.captured_inputs if differentiable(c)]
    n_c = len(consts)
    outputs = forward_fn.outputs
    ys_out, kept_out = outputs[1 : 1 + n_y[0]], outputs[1 + n_y[0] :]

    @tf.custom_gradient
    def run(h0, *inputs):
        stacked, whole = inputs[:n_x], inputs[n_x : n_x + n_c]

        def body(i, h, carries, ys, kept):
            out = forward_fn(h, *_slices(stacked, i), *whole)
            ys = [a.write(i, v) for a, v in zip(ys, out[1 : 1 + len(ys)])]
            kept = [a.write(i, v) for a, v in zip(kept, out[1 + len(ys) :])]
            return i + 1, out[0], carries.write(i, h), ys, kept

        _, h, carries, ys, kept = tf.while_loop(
            lambda i, *_: i < length,
            body,
            (
                tf.constant(0),
                h0,
                _array(h0, length),
                _arrays(ys_out, length),
                _arrays(kept_out, length),
            ),
            maximum_iterations=length,
        )
        carries = carries.stack()
        kept = [a.stack() for a in kept]
        ys = [a.stack() for a in ys]

        def grad_fn(d_h, *d_ys):
            d_ys = [g if differentiable(y) else None for y, g in zip(ys, d_ys)]
            with tf_internals.keras_call_state_entered(call_state):
                return _backward(
                    step, region, carries, stacked, whole, closures, kept, d_h, d_ys, length
                )

        return (h, *ys), grad_fn

    h, *ys = run(carry, *xs, *consts, *closures)
    return h, ys


def _plain_loop(step, carry, xs, consts, length, label):
    """The loop without remat: TensorFlow's own loop gradient keeps what the backward pass
    reads and nothing else (a region keeping every value would store each intermediate and stop
    XLA from fusing them)."""
    # Slices read from TensorArrays: their gradient is dense, where `tf.gather`'s is IndexedSlices.
    reads = [_array(x, length, sliced=True).unstack(x) for x in xs]

    def body(i, h, ys):
        new_h, step_ys = step(h, [r.read(i) for r in reads], consts)
        return i + 1, new_h, [a.write(i, v) for a, v in zip(ys, step_ys)]

    # The per-step outputs' shapes are known once the step has been traced.
    probe = tf_internals.trace_function(
        lambda h, *args: step(h, list(args[: len(xs)]), list(args[len(xs) :]))[1],
        *_step_specs(carry, xs, consts),
    )
    _check_captures(probe, label)
    arrays = _arrays(probe.outputs, length)
    _, h, ys = tf.while_loop(
        lambda i, *_: i < length, body, (tf.constant(0), carry, arrays), maximum_iterations=length
    )
    return h, [a.stack() for a in ys]


def _backward(step, region, carries, stacked, whole, closures, kept, d_h, d_ys, length):
    """Gradients for (carry, *xs, *consts, *closures) from the steps rebuilt in reverse order."""
    n_x = len(stacked)
    if d_h is None:
        d_h = tf.zeros(carries.shape[1:], carries.dtype)
    upstream = [i for i, g in enumerate(d_ys) if g is not None]
    n_kept = len(kept)
    connected: list[list[bool]] = []  # per source of the traced step: whether it has a gradient

    def backward(h, d_out, *args):
        slices = list(args[:n_x])
        consts = list(args[n_x : len(args) - n_kept - len(upstream)])
        region.keep(list(args[len(args) - n_kept - len(upstream) : len(args) - len(upstream)]))
        d_y_slices = list(args[len(args) - len(upstream) :])
        dep = dependency([d_out, h])
        h = tied_input(h, dep)
        with tf.GradientTape() as tape:
            # An eager closure as itself: the tape follows the captures of it the step makes.
            sources = [h] + [t for t in slices + consts if differentiable(t)] + closures
            tape.watch(sources)
            with region.replaying(dep, []):
                new_h, ys = step(h, slices, consts)
        targets = [new_h] + [ys[i] for i in upstream]
        grads = tape.gradient(
            targets,
            sources,
            output_gradients=[d_out, *d_y_slices],
            unconnected_gradients=tf.UnconnectedGradients.NONE,
        )
        connected.append([g is not None for g in grads])
        return [g for g in grads if g is not None]

    d_y_specs = [_spec(d_ys[i], sliced=True) for i in upstream]
    specs = (
        [_spec(carries, sliced=True), _spec(d_h)]
        + [_spec(x, sliced=True) for x in stacked]
        + [_spec(c) for c in whole]
        + [_spec(k, sliced=True) for k in kept]
        + d_y_specs
    )
    backward_fn = tf_internals.trace_function(backward, *specs)
    has_grad = connected[0]
    sources = [carries] + [t for t in list(stacked) + list(whole) if differentiable(t)]
    sources += closures
    # Source 0 is the carry; then the stacked inputs (a slot per step), then the constants and
    # closures (summed over the steps).
    n_stacked = sum(differentiable(x) for x in stacked)
    live = [k for k, has in enumerate(has_grad) if has]
    slots = [k for k in live if 1 <= k <= n_stacked]
    sums = [k for k in live if k > n_stacked]

    def body(i, d, grads, totals):
        j = length - 1 - i
        out = backward_fn(
            tf.gather(carries, j),
            d,
            *_slices(stacked, j),
            *whole,
            *[tf.gather(k, j) for k in kept],
            *[tf.gather(d_ys[u], j) for u in upstream],
        )
        by_source = dict(zip(live, out))
        d = by_source.get(0, tf.zeros_like(d))
        grads = [a.write(j, by_source[k]) for a, k in zip(grads, slots)]
        totals = [t + by_source[k] for t, k in zip(totals, sums)]
        return i + 1, d, grads, totals

    _, d, grads, totals = tf.while_loop(
        lambda i, *_: i < length,
        body,
        (
            tf.constant(0),
            d_h,
            [_array(sources[k], length, sliced=True) for k in slots],
            [tf.zeros_like(sources[k]) for k in sums],
        ),
        maximum_iterations=length,
    )
    by_source = {0: d}
    by_source.update({k: a.stack() for k, a in zip(slots, grads)})
    by_source.update(dict(zip(sums, totals)))
    flat = iter(by_source.get(k) for k in range(len(sources)))
    results = [next(flat)]
    results += [next(flat) if differentiable(t) else None for t in stacked]
    results += [next(flat) if differentiable(t) else None for t in whole]
    results += list(flat)
    return results


def _slices(stacked: Sequence[tf.Tensor], i: tf.Tensor) -> list[tf.Tensor]:
    """Slice i of each stacked input; float32 ones pass the barrier as int32 bits, so that the
    stacks stay float32 and each step converts only its own slice (see the module docstring)."""
    slices = [tf.gather(x, i) for x in stacked]
    wide = [k for k, t in enumerate(slices) if t.dtype == tf.float32]
    if wide:
        for k, value in zip(wide, _through_barrier(*[slices[k] for k in wide])):
            slices[k] = value
    return slices


@tf.custom_gradient
def _through_barrier(*values: tf.Tensor):
    """`values` passed through the barrier as their bits, with the identity's gradient: the
    backward loop's reads of the stacked inputs are differentiated in a second-order gradient,
    and neither a bitcast nor the barrier has a gradient of its own."""
    bits = tf_internals.optimization_barrier([tf.bitcast(v, tf.int32) for v in values])
    return [tf.bitcast(b, tf.float32) for b in bits], lambda *dy: list(dy)


def _step_specs(carry: tf.Tensor, xs: list, consts: list) -> list[tf.TensorSpec]:
    """What one step is traced with: the carry, one slice of each stacked input, the consts."""
    return [_spec(carry)] + [_spec(x, sliced=True) for x in xs] + [_spec(c) for c in consts]


def _spec(t: tf.Tensor, sliced: bool = False) -> tf.TensorSpec:
    shape = t.shape[1:] if sliced else t.shape
    return tf.TensorSpec(shape, t.dtype)


def _array(t: tf.Tensor, length: int, sliced: bool = False) -> tf.TensorArray:
    shape = t.shape[1:] if sliced else t.shape
    return tf.TensorArray(t.dtype, size=length, element_shape=shape)


def _arrays(tensors: Sequence[tf.Tensor], length: int) -> list[tf.TensorArray]:
    return [_array(t, length) for t in tensors]


def _check_captures(function, label: str) -> None:
    """A step may close over eager tensors only: a variable it read or a graph tensor it closed
    over would get no gradient from this loop's gradient function, and a Keras layer's state
    updated inside a `ScannedBlocks` step (its stateless call) would lose its update."""
    variables = {id(v.handle): v for v in function.variables}
    for captured in function.captured_inputs:
        if captured.dtype == tf.resource or (
            tf.is_symbolic_tensor(captured) and differentiable(captured)
        ):
            variable = variables.get(id(captured))
            what = (
                f"the variable {variable.name!r}"
                if variable is not None
                else f"a variable or a tensor ({captured.dtype.name}{list(captured.shape)})"
            )
            raise RematError(
                f"The steps of remat.scan {label!r} read {what}, which is not one of their "
                "inputs: pass it to remat.scan in `xs` (one slice per step) or `consts` (read "
                "whole). In ScannedBlocks, a block may read only its own variables: a seed "
                "generator shared by several layers (Keras' global one, which a random op given "
                "no seed draws from: a drop-path layer without a seed) would draw the same "
                "values at every step; give the layer a seed of its own."
            )
