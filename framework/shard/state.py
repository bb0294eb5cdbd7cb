"""A model's training state sharded at one level, and what a training step does with it.

`ShardedState` owns the shards of the model's trainable weights and the optimizer built on them,
and gives a step three things:

- `weight_reads(...)`: what the model computes with instead of its weights, and what gradients
  are taken for (the shards, or the gathered weights).
- `apply(...)`: the update from one replica's gradients: sum over replicas (reduce-scatter, or
  all-reduce keeping this replica's part), the mean over the global batch, clipping by the
  global norm over all parts, the optimizer on this replica's parts; below the `weights` level,
  the updated parts all-gathered back into the replicated weights.
- `checkpoint_replacements()`: the whole-value stand-ins a checkpoint saves for each shard.

Two places to run the collectives (see `collectives`): a step on CPUs and GPUs gathers the
weights before its XLA program and reduces the gradients after it; a step compiled as one
program (a TPU's) gathers each weight where a layer reads it and reduce-scatters its gradient
where the backward pass makes it, inside the program.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable

import keras
import tensorflow as tf

from framework import remat
from framework.core import tf_internals
from framework.shard.checkpoint import WholeValue
from framework.shard.collectives import ReplicaCollectives, XlaCollectives
from framework.shard.layout import Layout
from framework.shard.optimizer import build_on_shards
from framework.shard.variables import ShardedVariables, WholeValues, assign_whole

LEVELS = ("none", "optimizer", "gradients", "weights")


@dataclasses.dataclass(frozen=True)
class WeightReads:
    """What a forward and backward pass computes with in place of the model's trainable weights
    (`value_of(variable)`, None for the variable itself) and what it returns gradients for
    (`sources`, in order)."""

    sources: list
    value_of: Callable[[keras.Variable], tf.Tensor | None]
    redirects: bool = True

    @classmethod
    def unchanged(cls, model: keras.Model) -> WeightReads:
        return cls(list(model.trainable_variables), lambda variable: None, redirects=False)


class ShardedState:
    """`model`'s trainable weights and `optimizer`'s state, sharded over `strategy`'s replicas.

    Args:
      level: "optimizer", "gradients" or "weights" (`LEVELS`).
      strategy: the run's strategy; the weights were made in its scope (at the "weights" level,
        on the host: `tf_internals.trainable_variables_on`).
      model: the built model.
      optimizer: made in the strategy's scope and not built yet; it is built on the shards.
      replicas: the replicas the state is cut for, when not the strategy's: a planner compiles
        one replica's program of a larger slice on one device.
    """

    def __init__(
        self,
        level: str,
        strategy: tf.distribute.Strategy,
        model: keras.Model,
        optimizer: keras.optimizers.Optimizer,
        replicas: int | None = None,
    ):
        if level not in LEVELS[1:]:
            raise ValueError(f"unknown shard level {level!r}; choose one of {', '.join(LEVELS)}")
        self.level = level
        self.strategy = strategy
        self.model = model
        self.optimizer = optimizer
        self.replicas = replicas or strategy.num_replicas_in_sync
        constrained = [v.path for v in model.trainable_variables if v.constraint is not None]
        if constrained:
            raise ValueError(
                f"weights with a constraint ({', '.join(constrained[:3])}) cannot be sharded: "
                "the optimizer updates parts of them, and a constraint such as MaxNorm or "
                "UnitNorm needs the whole weight. Use Trainer.shard_state = 'none', or drop "
                "the constraint"
            )
        self.weights = ShardedVariables(strategy, model.trainable_variables, self.replicas)
        slot_layouts = build_on_shards(optimizer, self.weights)
        self._slot_layouts = slot_layouts
        self._index = {id(v): j for j, v in enumerate(self.weights.variables)}
        # What checkpoints save whole: each weight's shards, then each slot.
        slots = [v for v in optimizer.variables if id(v) in slot_layouts]
        self._saved = [*self.shards, *slots]
        self._saved_layouts = [*self.layouts, *(slot_layouts[id(v)] for v in slots)]
        self._saved_whole = WholeValues(strategy, self._saved, self._saved_layouts)
        self._saved_cache: tuple | None = None  # ((step, writes), {index: whole value})
        self._writes = 0

    @property
    def shards(self) -> list[keras.Variable]:
        return self.weights.shards

    @property
    def layouts(self) -> list[Layout]:
        return self.weights.layouts

    # --- in a replica's step -------------------------------------------------------------

    def gather_weights(self) -> list[tf.Tensor]:
        """Every weight's whole value, all-gathered from the shards (replica context, outside
        an XLA program)."""
        gathered = ReplicaCollectives(self.strategy).all_gather([s.value for s in self.shards])
        return [layout.whole(g) for layout, g in zip(self.layouts, gathered)]

    def weight_reads(self, gathered: list[tf.Tensor] | None = None, in_program: bool = False):
        """The reads of a forward and backward pass at this level.

        Between programs (`in_program=False`): at the "weights" level the model computes with
        `gathered` (from `gather_weights`), which gradients are taken for; below it with its
        own replicated weights. In one program of all replicas (`in_program=True`), at the
        "gradients" and "weights" levels, reading a weight gathers its shards there (or, at
        "gradients", reads the replicated weight), and its gradient comes back reduce-scattered
        onto the shard: gradients are taken for the shards (`reduces_in_program`). At the
        "optimizer" level the gradients are whole, summed after the pass, everywhere.
        """
        if not self.reduces_in_program(in_program):
            if self.level != "weights":
                return WeightReads.unchanged(self.model)
            return WeightReads(list(gathered), lambda v: self._pick(gathered, v))
        collectives = XlaCollectives(self.replicas)
        # Below the "weights" level the replicated weights are read once, here: inside the
        # block below, reading a Keras variable would ask `value_of` again.
        replicated = (
            []
            if self.level == "weights"
            else [tf.convert_to_tensor(v.value) for v in self.weights.variables]
        )

        def value_of(variable):
            j = self._index.get(id(variable))
            if j is None:
                return None
            layout, shard = self.layouts[j], self.shards[j].value
            if self.level == "weights":
                # Gathered where the block runs, and again in its recomputation (see
                # `remat.tied_to_pass`).
                (whole,) = collectives.all_gather([remat.tied_to_pass(shard)])
                return layout.whole(whole)
            return _replicated_read(replicated[j], shard, layout, collectives)

        return WeightReads(list(self.shards), value_of)

    def reduces_in_program(self, in_program: bool) -> bool:
        """Whether the forward and backward pass returns gradients for the shards, already
        summed over the replicas (inside one program of all replicas, above "optimizer")."""
        return in_program and self.level != "optimizer"

    def _pick(self, values: list[tf.Tensor], variable) -> tf.Tensor | None:
        j = self._index.get(id(variable))
        return None if j is None else values[j]

    def apply(
        self,
        grads: list[tf.Tensor],
        count: tf.Tensor,
        clip_norm: float | None,
        reduced: bool = False,
    ) -> tf.Tensor:
        """One replica's update, in replica context: `grads` are the loss sum's gradients for
        the whole weights (or, `reduced`, for the shards, summed over replicas already), `count`
        this replica's weight of the loss. Returns the global norm before clipping."""
        context = tf.distribute.get_replica_context()
        if not reduced:
            padded = [layout.padded(g) for layout, g in zip(self.layouts, grads)]
            grads = ReplicaCollectives(self.strategy).reduce_scatter(padded)
        total = context.all_reduce(tf.distribute.ReduceOp.SUM, count)
        grads = [g / tf.maximum(total, 1.0) for g in grads]
        squares = tf.add_n([tf.reduce_sum(tf.square(g)) for g in grads])
        norm = tf.sqrt(context.all_reduce(tf.distribute.ReduceOp.SUM, squares))
        if clip_norm:
            grads, _ = tf.clip_by_global_norm(grads, clip_norm, use_norm=norm)
        self.optimizer.apply(grads, self.shards)
        if self.level != "weights":
            self._assign_replicated(self.gather_weights())
        return norm

    def _assign_replicated(self, values: list[tf.Tensor]) -> None:
        """Assigns the replicated weights the same `values` on every replica."""

        def assign(strategy, values):
            for variable, value in zip(self.weights.variables, values):
                strategy.extended.update(
                    variable.value, lambda local, v: local.assign(v), args=(value,)
                )

        tf.distribute.get_replica_context().merge_call(assign, args=(values,))

    # --- outside the step ----------------------------------------------------------------

    def unsharded_optimizer_bytes(self) -> int:
        """The bytes of the optimizer's state were it not sharded (what every replica keeps at
        the "none" level), counted from the slots' layouts without building it whole."""
        return sum(
            (self._slot_layouts[id(v)].size if id(v) in self._slot_layouts else math.prod(v.shape))
            * tf.as_dtype(v.dtype).size
            for v in self.optimizer.variables
        )

    def state_variables(self) -> list[keras.Variable]:
        """The variables that hold the training state: the shards, the optimizer's variables
        and the model's other variables (at the "weights" level the model's own trainable
        weights are a copy on the host, current only after `write_model`)."""
        weights = {id(v) for v in self.weights.variables}
        other = [v for v in self.model.variables if id(v) not in weights]
        kept = [] if self.level == "weights" else self.weights.variables
        return [*kept, *other, *self.shards, *self.optimizer.variables]

    def write_model(self) -> None:
        """Gives the model's own trainable weights the values of their shards (cross-replica
        context): after a restore, and at the "weights" level wherever the model is used
        outside the step."""
        for variable, value in zip(self.weights.variables, self.weights.whole_values()):
            variable.assign(value)

    def read_model(self) -> None:
        """Gives the shards the values of the model's own trainable weights (cross-replica):
        after something assigned them, such as a warm start."""
        for shard, layout, variable in zip(self.shards, self.layouts, self.weights.variables):
            assign_whole(self.strategy, shard, layout, variable.value)

    def checkpoint_replacements(self) -> dict[int, WholeValue]:
        """What a checkpoint saves for each sharded variable, by the id of the object it stands
        in for (`checkpoint.checkpoint_view`): each weight's whole value, for the model's
        weight and for the optimizer's reference to its shard alike (one object, as in an
        unsharded run's checkpoint), and each slot's whole value."""
        stand_ins = [
            WholeValue(
                read=functools.partial(self._read_saved, k),
                write=functools.partial(self._write_saved, k),
            )
            for k in range(len(self._saved))
        ]
        replaced = {id(saved): whole for saved, whole in zip(self._saved, stand_ins)}
        for variable, whole in zip(self.weights.variables, stand_ins):
            replaced[id(variable)] = whole
        return replaced

    def _read_saved(self, k: int) -> tf.Tensor:
        """The whole value of saved variable `k`. A save reads them all, one after the other:
        the first read gathers every one at once, and each read takes its own out."""
        version = (int(self.optimizer.iterations.numpy()), self._writes)
        if (
            self._saved_cache is None
            or self._saved_cache[0] != version
            or k not in self._saved_cache[1]
        ):
            self._saved_cache = (version, dict(enumerate(self._saved_whole.read())))
        return self._saved_cache[1].pop(k)

    def _write_saved(self, k: int, value: tf.Tensor) -> None:
        assign_whole(self.strategy, self._saved[k], self._saved_layouts[k], value)
        self._writes += 1


def _replicated_read(
    weight: tf.Tensor, shard: tf.Tensor, layout: Layout, collectives: XlaCollectives
) -> tf.Tensor:
    """`weight` (replicated on every replica), whose gradient goes to `shard` reduce-scattered:
    inside one program of all replicas, a weight read below the "weights" level."""

    @tf.custom_gradient
    def read(part):
        def grad(dy):
            (summed,) = collectives.reduce_scatter([layout.padded(dy)])
            return summed

        return tf.identity(weight), grad

    return read(shard)


def reads_redirected(reads: WeightReads):
    """The block in which the model computes with `reads.value_of` (see `WeightReads`): none
    where nothing is redirected, so that the layers keep the losses they add as without it."""
    if not reads.redirects:
        return contextlib.nullcontext()
    return tf_internals.keras_reads_redirected(reads.value_of)
