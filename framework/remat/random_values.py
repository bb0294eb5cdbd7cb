"""Random values in a region: which values its forward pass computes from random bits and
constants alone (a dropout keep mask) and what recomputing each costs, and the seeds of stateless
random ops tied to the pass that draws them.

Seeds get a zero tied to the pass added: to the region's inputs in the forward pass (else XLA
draws every region's random bits at the start of the step and keeps them alive), to the upstream
gradient in the recomputation (else XLA merges the recomputed draw with the forward one). The
seeds' values themselves come back through the variable snapshots `checkpoint` takes.
"""

from __future__ import annotations

import tensorflow as tf

from framework.core import tf_internals
from framework.remat.costs import ELEMENTWISE_FLOPS_PER_VALUE, RANDOM_FLOPS_PER_VALUE
from framework.remat.dependencies import in_graph, with_dep

# Control flow named "Stateless" that draws nothing.
_STATELESS_CONTROL_FLOW = frozenset({"StatelessIf", "StatelessWhile", "StatelessCase"})
_SEED_ARGS = frozenset({"seed", "key", "counter"})  # not "alg": XLA needs it constant
# Ops whose outputs depend on their inputs' shapes alone: constants as far as the values go (a
# dropout mask drawn over `tf.shape(x)` is still computed from random bits and constants alone).
_SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank"})


def is_random_op(op_type: str) -> bool:
    """Stateless random ops (`StatelessRandomUniformV2`, ...): their seeds are tied to the pass."""
    return op_type.startswith("Stateless") and op_type not in _STATELESS_CONTROL_FLOW


def tie_seeds(op: tf.Operation, dep: tf.Tensor) -> None:
    """Offsets the seed inputs of the stateless random op `op` by the zero `dep`."""
    with op.graph.as_default(), tf_internals.stop_recording():
        dep = in_graph(dep, op.graph)
        for position, arg in enumerate(op.op_def.input_arg):
            if arg.name in _SEED_ARGS:
                tf_internals.update_input(op, position, with_dep(op.inputs[position], dep))


def _values(t: tf.Tensor) -> int | None:
    """The number of values of `t`, or None when its shape is not static."""
    return t.shape.num_elements()


class RandomValues:
    """The random and constant tensors of one recorded forward pass, op by op."""

    def __init__(self) -> None:
        self._random: dict = {}  # tensor ref -> FLOPs per value of recomputing it
        self._constant: set = set()  # refs of tensors computed from constants alone

    def _is_constant(self, t: tf.Tensor) -> bool:
        return t.op.type == "Const" or t.ref() in self._constant

    def flops(self, op: tf.Operation, outputs) -> float | None:
        """What recomputing each output value of `op` costs if it is computed from random bits
        and constants alone (at least one random input), else None: a random op's draw; after
        it, one FLOP per op along the dearest input's path, an input's cost shared over the
        output's values (a key of two words drawn for a hash over N values costs each of them
        almost nothing). The dearest path, not the sum: inputs share their ancestors."""
        if is_random_op(op.type):
            return RANDOM_FLOPS_PER_VALUE
        if not outputs:
            return None
        random = [t.ref() in self._random for t in op.inputs]
        if not any(random) or not all(
            r or self._is_constant(t) for r, t in zip(random, op.inputs, strict=True)
        ):
            return None
        values = _values(outputs[0])
        dearest = max(
            self._random[t.ref()] * (_values(t) / values if _values(t) and values else 1)
            for r, t in zip(random, op.inputs, strict=True)
            if r
        )
        return ELEMENTWISE_FLOPS_PER_VALUE + dearest

    def note(self, op: tf.Operation, outputs, random_flops: float | None) -> None:
        """Records `op`'s outputs as random (with `flops`' cost) or constant, if they are."""
        if random_flops is not None:
            self._random.update((t.ref(), random_flops) for t in outputs)
        elif op.type in _SHAPE_OPS or (op.inputs and all(self._is_constant(t) for t in op.inputs)):
            self._constant.update(t.ref() for t in outputs)
