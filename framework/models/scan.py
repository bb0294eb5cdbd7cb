"""Scan over layers: `depth` copies of one block as one loop, its weights stacked on a new axis.

An unrolled stack of N blocks is N copies of the block's graph: tracing and XLA compile time grow
with N, and so does the compiled program. `ScannedBlocks` holds each block variable once, with a
leading axis of size N, and applies the block in a `tf.while_loop` that reads slice i in step i (as
MaxText's `scan_layers` and Flax's `nn.scan` do). The block is traced and compiled once, whatever
the depth. Each step can be a checkpointed region: the loop then keeps one input per block for the
backward pass and recomputes a block's activations in the backward loop - the memory of full remat.

The block runs through Keras' `stateless_call`, so it neither reads nor writes real variables
inside the loop: its weights are slices of the stacked variables, and the new values of its
non-trainable state (the dropout seed of each block) are collected and written back once after
the loop. The losses a block adds in its call (`add_loss`, activity regularizers) are loop
outputs too, summed over the blocks into the layer's own losses. A block variable's weight
regularizer and constraint become the stacked variable's, applied to each block's slice: Keras
computes the regularizers from the variables once per step, and the optimizer applies the
constraints after each update, as for the unrolled blocks.

Checkpoints: the stacked layout is its own (one variable per block variable, `[depth, ...]`).
`stack_weights` and `unstack_weights` convert to and from a list of unrolled blocks, so weights
move between the two layouts (and a checkpoint of one can be restored into a model of the other).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import keras
import tensorflow as tf

from framework import remat
from framework.core import tf_internals


class ScannedBlocks(keras.layers.Layer):
    """`depth` blocks made by `make_block(name)`, applied in a loop with stacked weights.

    Args:
      make_block: builds one block (a Keras layer) given its name; every block has the same
        variables (shapes and order), as copies of one block class with one config have.
      depth: number of blocks.
      remat_policy: policy of `remat.checkpoint` for each step of the loop, or None (no remat).
      build_shapes: shapes of the block's other inputs its `build` takes beside the input's, by
        argument name: `{"encoder_sequence_shape": (None, 64, 256)}` for a cross-attention
        decoder. Keras builds this layer from its input's shape alone.
    """

    def __init__(
        self,
        make_block: Callable[[str], keras.layers.Layer],
        depth: int,
        remat_policy: str | remat.policies.Policy | None = None,
        build_shapes: dict[str, tuple] | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if depth < 1:
            raise ValueError(f"ScannedBlocks needs depth >= 1, got {depth}")
        self.make_block = make_block
        self.depth = depth
        self.remat_policy = remat_policy
        self.build_shapes = dict(build_shapes or {})

    def build(self, input_shape):
        # The template defines the block's computation; its own variables are never read (each
        # step maps them to slices) and are kept out of the layer's tracking.
        template = self.make_block("block")
        template.build(input_shape, **self.build_shapes)
        if not template.variables:
            raise ValueError(
                f"ScannedBlocks stacks the variables a block makes in build(input_shape); "
                f"{type(template).__name__}.build made none (the block makes them in its first "
                "call), so it cannot be scanned: stack the blocks unrolled."
            )
        object.__setattr__(self, "_template", template)
        initial = [self.make_block(f"init_{i}") for i in range(self.depth)]
        for block in initial:
            block.build(input_shape, **self.build_shapes)
        for k, variable in enumerate(template.variables):
            values = tf.stack([tf.convert_to_tensor(b.variables[k]) for b in initial])
            stacked = self.add_weight(
                shape=values.shape,
                dtype=variable.dtype,
                trainable=variable.trainable,
                initializer=keras.initializers.Constant(values.numpy()),
                # The loop reads the stack in its own dtype; each step's block casts its slice
                # as the unrolled block casts its variable (under mixed precision, a bfloat16
                # copy of one block's weights at a time, not of the whole stack).
                autocast=False,
                regularizer=variable.regularizer and _EachBlockRegularizer(variable.regularizer),
                constraint=variable.constraint and _EachBlockConstraint(variable.constraint),
                name=f"{k}_" + variable.path.replace("/", "_"),
            )
            # Keras computes a weight regularizer from the variable, once per step however
            # often the layer is called: the stacked variable's does, the steps must not.
            variable.regularizer = None
            # One attribute each: tf.train.Checkpoint does not save variables held in a list.
            setattr(self, f"stacked_{k}", stacked)
        self.built = True

    @property
    def stacked(self) -> list:
        """One variable `[depth, ...]` per variable of the block, in the block's order."""
        return [getattr(self, f"stacked_{k}") for k in range(len(self.template.variables))]

    @property
    def template(self) -> keras.layers.Layer:
        return self._template

    def set_remat_policy(self, policy: str | remat.policies.Policy | None) -> None:
        """What `remat.set_grad_checkpointing` calls: checkpoint each step with `policy`."""
        self.remat_policy = policy

    def _step(self, x, *slices, training=None, **kwargs):
        template = self.template
        if len(template.variables) != len(slices):
            raise ValueError(
                f"{type(template).__name__} made variables in its call that its build did not "
                f"({len(slices)} stacked, {len(template.variables)} now); ScannedBlocks stacks "
                "only what build(input_shape) makes, so the block cannot be scanned."
            )
        trainable = list(slices[: len(template.trainable_variables)])
        non_trainable = list(slices[len(template.trainable_variables) :])
        # `stateless_call` runs `call` itself: a block whose call takes no `training` leaves it
        # to its sublayers, which read it from the call context, as under Keras' `__call__`.
        parameters = inspect.signature(template.call).parameters.values()
        if any(p.name == "training" or p.kind is p.VAR_KEYWORD for p in parameters):
            kwargs["training"] = training
        tf_internals.keras_forget_losses(template)
        return template.stateless_call(trainable, non_trainable, x, return_losses=True, **kwargs)

    def _ordered(self) -> tuple[list, list]:
        """The stacked variables in the template's order: trainable ones, then the others."""
        by_template = {id(v): s for v, s in zip(self.template.variables, self.stacked)}
        trainable = [by_template[id(v)] for v in self.template.trainable_variables]
        non_trainable = [by_template[id(v)] for v in self.template.non_trainable_variables]
        return trainable, non_trainable

    def call(self, x, training=None, **kwargs):
        built_from = inspect.signature(self.template.build).parameters
        for name, value in kwargs.items():
            shape = f"{name}_shape"
            if value is not None and shape in built_from and shape not in self.build_shapes:
                raise ValueError(
                    f"{type(self.template).__name__}.build takes `{shape}` for the `{name}` "
                    "passed to the call (a cross-attention block), and Keras builds ScannedBlocks "
                    f"from its input's shape alone: pass ScannedBlocks(..., build_shapes="
                    f"{{{shape!r}: {tuple(value.shape)}}})."
                )
        trainable, non_trainable = self._ordered()
        flat = tf.nest.flatten(kwargs)
        tensors = [k for k, v in enumerate(flat) if isinstance(v, tf.Tensor)]

        def step(h, slices, consts):
            values = list(flat)
            for k, c in zip(tensors, consts):
                values[k] = c
            y, new_states, losses = self._step(
                h, *slices, training=training, **tf.nest.pack_sequence_as(kwargs, values)
            )
            if not tf.is_tensor(y):
                raise ValueError(
                    "ScannedBlocks carries one tensor from block to block; "
                    f"{type(self.template).__name__}.call returned {type(y).__name__}: wrap the "
                    "block in a layer whose call returns the tensor the next block reads."
                )
            y = tf.ensure_shape(tf.cast(y, h.dtype), h.shape)
            return y, [*new_states, *losses]

        x, ys = remat.scan(
            step,
            x,
            [tf.convert_to_tensor(v) for v in trainable + non_trainable],
            [flat[k] for k in tensors],
            policy=self.remat_policy,
            label=self.name,
        )
        for variable, state in zip(non_trainable, ys):
            variable.assign(state)
        # The losses the blocks add in their calls (`add_loss`, activity regularizers), one per
        # block each, summed over the blocks.
        for losses in ys[len(non_trainable) :]:
            self.add_loss(tf.reduce_sum(losses, axis=0))
        return x

    def compute_output_shape(self, input_shape):
        return input_shape


class _EachBlockRegularizer(keras.regularizers.Regularizer):
    """A block variable's regularizer on its stacked variable: the sum of its value on each
    block's slice, what the unrolled blocks' regularizers add up to (for any regularizer, not
    only those that sum over the values)."""

    def __init__(self, regularizer: Callable[[tf.Tensor], tf.Tensor]):
        self.regularizer = regularizer

    def __call__(self, stacked: tf.Tensor) -> tf.Tensor:
        return tf.add_n([self.regularizer(w) for w in tf.unstack(stacked)])


class _EachBlockConstraint(keras.constraints.Constraint):
    """A block variable's constraint on its stacked variable, applied to each block's slice."""

    def __init__(self, constraint: Callable[[tf.Tensor], tf.Tensor]):
        self.constraint = constraint

    def __call__(self, stacked: tf.Tensor) -> tf.Tensor:
        return tf.stack([self.constraint(w) for w in tf.unstack(stacked)])


def stack_weights(blocks: list[keras.layers.Layer], scanned: ScannedBlocks) -> None:
    """Copies the weights of unrolled `blocks` (built, in order) into `scanned`."""
    _check(blocks, scanned)
    trainable, non_trainable = scanned._ordered()
    for k, variable in enumerate(trainable + non_trainable):
        per_block = [(b.trainable_variables + b.non_trainable_variables)[k] for b in blocks]
        variable.assign(tf.stack([tf.convert_to_tensor(v) for v in per_block]))


def unstack_weights(scanned: ScannedBlocks, blocks: list[keras.layers.Layer]) -> None:
    """Copies the weights of `scanned` into unrolled `blocks` (built, in order)."""
    _check(blocks, scanned)
    trainable, non_trainable = scanned._ordered()
    for k, variable in enumerate(trainable + non_trainable):
        values = tf.unstack(tf.convert_to_tensor(variable))
        for block, value in zip(blocks, values):
            (block.trainable_variables + block.non_trainable_variables)[k].assign(value)


def _check(blocks: list[keras.layers.Layer], scanned: ScannedBlocks) -> None:
    if len(blocks) != scanned.depth:
        raise ValueError(f"{len(blocks)} blocks for a scan of depth {scanned.depth}")
    want = [tuple(v.shape) for v in scanned.template.variables]
    for block in blocks:
        got = [tuple(v.shape) for v in block.variables]
        if got != want:
            raise ValueError(
                f"block {block.name!r} has variables of shapes {got}; the scanned block has {want}"
            )
