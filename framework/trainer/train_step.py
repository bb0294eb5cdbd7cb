"""The training and evaluation steps, as functions of a model, an optimizer, a batch and settings.

The per-replica forward and backward pass is one XLA program (`jit_compile=True`), traced inside
`strategy.run` so each replica compiles against its own variables (one trace shared by the
replicas reads replica 0's variables from the other devices, and fails). Gradients are then
summed across replicas once, clipped by their global norm and applied. A host loop runs
`num_steps` steps in one `tf.function` over `tf.range`, so Python is entered once per loop.

With sharded training state (`framework.shard`, `Trainer.shard_state`) the replica's update is
the `ShardedState`'s: gradients reduce-scattered onto each replica's parts, clipped by the global
norm over all parts, the optimizer on the parts, the weights gathered back. On CPUs and GPUs the
collectives run between the replica's programs; on a TPU, where the whole replica step is one
XLA program, gathers and reduce-scatters run inside the forward and backward pass.

With `microbatches > 1` each replica's batch is cut into that many micro-batches whose gradients
are summed inside the compiled program (as t5x accumulates them), so activations are held for one
micro-batch at a time: the way to a large global batch when memory is the limit. The loss is a
weighted sum divided by the global weight once, so the gradients equal those of the whole batch.

Nothing here knows about checkpoints, summaries or gin: the trainer composes these functions, and
the planner and the benchmarks compile the same step without a trainer.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import keras
import tensorflow as tf

from framework.core import tf_internals
from framework.core.errors import TrainerError
from framework.shard.state import ShardedState, WeightReads, reads_redirected
from framework.trainer.losses import LossFn, cross_entropy, label_classes

# What a train loop returns, summed over its steps (the norm too: divide by the steps).
TRAIN_SUMS = ("loss_sum", "correct", "count", "grad_norm")
EVAL_SUMS = ("loss_sum", "correct", "count")


def unpack(batch) -> tuple:
    """(inputs, labels, weights) of a batch given as (inputs, labels) or (inputs, labels,
    weights); weights are float32 ones when absent, one per label (class probabilities
    [..., C] are one label)."""
    inputs, labels, weights = batch if len(batch) == 3 else (*batch, None)
    if weights is None:
        weights = tf.ones(tf.shape(label_classes(labels)))
    weights = tf.cast(weights, tf.float32)
    return inputs, labels, weights


def batch_sums(
    model: keras.Model, batch, loss_fn: LossFn = cross_entropy, training: bool = False
) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """Weighted sums of the loss, of correct predictions and of the weights over one batch.

    Labels may have any rank (one per image, or one per token), as class ids or class
    probabilities (`losses.label_classes`); a weight of 0 leaves a label out (padding). In
    training, the losses the model adds (weight and activity regularizers, `add_loss`) count
    once per unit of weight: the step divides the summed loss by the batch's weight, so they
    add to the mean loss as in Keras' `fit`.
    """
    inputs, labels, weights = unpack(batch)
    losses, predictions = _losses_and_predictions(model, inputs, labels, loss_fn, training)
    hits = tf.equal(predictions, tf.cast(label_classes(labels), predictions.dtype))
    loss, weight = tf.reduce_sum(losses * weights), tf.reduce_sum(weights)
    added = model.losses if training else []  # (each read computes the regularizers again)
    if added:
        loss += tf.add_n([tf.cast(x, tf.float32) for x in added]) * weight
    return loss, tf.reduce_sum(tf.cast(hits, tf.float32) * weights), weight


def _losses_and_predictions(model: keras.Model, inputs, labels, loss_fn: LossFn, training: bool):
    """Per-label losses and predicted classes. A model with a `loss_chunk` (the language models'
    setting for large vocabularies) computes them itself from the labels and `loss_fn`, chunk
    by chunk, and never holds the whole logits."""
    if getattr(model, "loss_chunk", None) is None:
        outputs = model(inputs, training=training)
        if not tf.is_tensor(outputs):
            raise TrainerError(
                f"the model returns {type(outputs).__name__} {_structure(outputs)}: the trainer "
                "needs one tensor of logits [..., classes]; have model_fn return a model with "
                "that one output"
            )
        logits = tf.cast(outputs, tf.float32)
        return loss_fn(logits, labels), tf.argmax(logits, -1, output_type=tf.int32)
    return model(inputs, training=training, labels=labels, loss_fn=loss_fn)


def _structure(outputs) -> str:
    """What a model returned, for an error: the structure with each tensor's shape."""
    return str(tf.nest.map_structure(lambda x: getattr(x, "shape", x), outputs))


def _batch_gradients(model: keras.Model, batch, loss_fn: LossFn, reads: WeightReads):
    with tf.GradientTape() as tape:
        tape.watch([s for s in reads.sources if not isinstance(s, keras.Variable)])
        sums = batch_sums(model, batch, loss_fn, training=True)
    grads = tape.gradient(sums[0], reads.sources)
    # Dense and never None, so micro-batch sums and the all-reduce see one structure; shaped
    # as their weights (a Dense kernel's gradient from a [batch, length, dim] input of unknown
    # batch has an unknown first dimension, which sharding cannot split).
    grads = [
        tf.zeros_like(v) if g is None else tf.ensure_shape(tf.convert_to_tensor(g), v.shape)
        for g, v in zip(grads, reads.sources, strict=True)
    ]
    return sums, grads


def split_batch(batch, microbatches: int):
    """The batch as `microbatches` micro-batches stacked on a new leading axis. A batch whose
    size is known only when the step runs (a multi-worker pipeline's) is split then: the
    trainer checked that the global batch splits (`TrainerSettings.check_replicas`)."""

    def split(x: tf.Tensor) -> tf.Tensor:
        size = x.shape[0]
        if size is not None and size % microbatches:
            raise ValueError(
                f"a replica's batch of {size} examples does not split into "
                f"Trainer.microbatches = {microbatches} equal micro-batches"
            )
        part = -1 if size is None else size // microbatches
        return tf.reshape(x, [microbatches, part, *x.shape[1:]])

    return tf.nest.map_structure(split, batch)


def gradients(
    model: keras.Model,
    batch,
    loss_fn: LossFn = cross_entropy,
    microbatches: int = 1,
    reads: WeightReads | None = None,
):
    """One replica's forward and backward pass: ((loss_sum, correct, count), gradients of the
    loss sum), summed over `microbatches` micro-batches run one after the other.

    Gradients are for the model's trainable variables, or for `reads.sources` when the model
    computes with other values in their place (sharded weights, `WeightReads`): the reads stay
    redirected through the backward pass, where checkpointed blocks are recomputed.
    """
    reads = reads or WeightReads.unchanged(model)
    with reads_redirected(reads):
        if microbatches == 1:
            return _batch_gradients(model, batch, loss_fn, reads)
        stacked = split_batch(batch, microbatches)
        zeros = (
            (tf.constant(0.0), tf.constant(0.0), tf.constant(0.0)),
            [tf.zeros(v.shape, v.dtype) for v in reads.sources],
        )

        def body(i, sums, grads):
            part = tf.nest.map_structure(lambda x: x[i], stacked)
            more_sums, more_grads = _batch_gradients(model, part, loss_fn, reads)
            return (
                i + 1,
                tuple(a + b for a, b in zip(sums, more_sums, strict=True)),
                [a + b for a, b in zip(grads, more_grads, strict=True)],
            )

        _, sums, grads = tf.while_loop(lambda i, *_: i < microbatches, body, (0, *zeros))
        return sums, grads


def compiled_gradients(
    model: keras.Model,
    loss_fn: LossFn = cross_entropy,
    microbatches: int = 1,
    traces: collections.Counter | None = None,
    sharded: ShardedState | None = None,
    in_program: bool = False,
) -> Callable:
    """`gradients` as one XLA program; `traces["train_step"]` counts its traces.

    With `sharded` state, the program reads the weights `sharded.weight_reads` gives: at the
    "weights" level between programs it takes the gathered weights as a second argument
    (`ShardedState.gather_weights`); `in_program` gathers and reduce-scatters inside it, for
    a program of all replicas (see `ShardedState.weight_reads`).
    """

    loss_fn = _converted_unless_ours(loss_fn)

    def forward_backward(batch, *gathered):
        if traces is not None:
            traces["train_step"] += 1
        reads = None
        if sharded is not None:
            reads = sharded.weight_reads(gathered[0] if gathered else None, in_program)
        return gradients(model, batch, loss_fn, microbatches, reads)

    return tf.function(forward_backward, jit_compile=True, autograph=False)


def _converted_unless_ours(loss_fn: LossFn) -> LossFn:
    """The library's losses traced as written; a user's converted by AutoGraph as a
    `tf.function` converts what it calls (a Python `if` on a tensor in it keeps working).

    The step's own functions are traced without AutoGraph: transpiling them cost more than a
    second of each run's first trace, for code that has no Python control flow on tensors.
    """
    if getattr(loss_fn, "__module__", "").startswith("framework."):
        return loss_fn
    return tf_internals.converted_by_autograph(loss_fn)


def gathers_between_programs(sharded: ShardedState | None, in_program: bool) -> bool:
    """Whether a replica gathers every weight before its programs run (the "weights" level on
    CPUs and GPUs)."""
    return sharded is not None and sharded.level == "weights" and not in_program


def apply_gradients(
    optimizer: keras.optimizers.Optimizer,
    variables: list,
    grads: list,
    count: tf.Tensor,
    clip_norm: float | None,
) -> tf.Tensor:
    """In a replica context: sums gradients and weights over replicas in one all-reduce, takes
    the mean, clips it by its global norm and applies it; returns the norm before clipping."""
    grads, total = tf.distribute.get_replica_context().all_reduce(
        tf.distribute.ReduceOp.SUM, (grads, count)
    )
    grads = [g / tf.maximum(total, 1.0) for g in grads]
    norm = tf.linalg.global_norm(grads)
    if clip_norm:
        grads, _ = tf.clip_by_global_norm(grads, clip_norm, use_norm=norm)
    optimizer.apply(grads, variables)
    return norm


def make_train_loop(
    strategy: tf.distribute.Strategy,
    model: keras.Model,
    optimizer: keras.optimizers.Optimizer,
    *,
    loss_fn: LossFn = cross_entropy,
    clip_norm: float | None = None,
    microbatches: int = 1,
    traces: collections.Counter | None = None,
    sharded: ShardedState | None = None,
) -> Callable[[object, tf.Tensor], tf.Tensor]:
    """A `tf.function(iterator, num_steps)` that runs `num_steps` steps and returns the sums
    named by `TRAIN_SUMS` over them. With `sharded` state, its update is the state's."""
    in_program = runs_as_one_program(strategy)

    @tf.autograph.experimental.do_not_convert
    def replica_step(batch):
        # Created here, inside the replica function, so each replica traces its own program.
        forward_backward = compiled_gradients(
            model, loss_fn, microbatches, traces, sharded, in_program
        )
        if sharded is None:
            (loss_sum, correct, count), grads = forward_backward(batch)
            norm = apply_gradients(optimizer, model.trainable_variables, grads, count, clip_norm)
            return loss_sum, correct, count, norm
        (loss_sum, correct, count), grads = forward_backward(
            *_step_args(batch, sharded, in_program)
        )
        reduced = sharded.reduces_in_program(in_program)
        norm = sharded.apply(grads, count, clip_norm, reduced=reduced)
        return loss_sum, correct, count, norm

    def train_loop(iterator, num_steps):
        totals = tf.zeros([len(TRAIN_SUMS)])
        for _ in tf.range(num_steps):
            *sums, norm = strategy.run(replica_step, args=(next(iterator),))
            norm = strategy.experimental_local_results(norm)[0]  # the same on every replica
            totals += tf.stack([*(_sum(strategy, x) for x in sums), norm])
        return totals

    return tf.function(train_loop)


def _step_args(batch, sharded: ShardedState | None, in_program: bool) -> tuple:
    """What a replica's program is called with: the batch, and the weights it gathered when it
    gathers them before its programs (see `compiled_gradients`)."""
    if gathers_between_programs(sharded, in_program):
        return batch, sharded.gather_weights()
    return (batch,)


def runs_as_one_program(strategy: tf.distribute.Strategy) -> bool:
    """Whether XLA compiles a replica's whole step as one program of all replicas, collectives
    included (TPUs); elsewhere tf.distribute's collectives run between a step's programs."""
    return isinstance(strategy, tf.distribute.TPUStrategy)


def make_eval_loop(
    strategy: tf.distribute.Strategy,
    model: keras.Model,
    *,
    loss_fn: LossFn = cross_entropy,
    sharded: ShardedState | None = None,
) -> Callable[[object], tf.Tensor]:
    """A `tf.function(dataset)` that returns the sums named by `EVAL_SUMS` over the dataset."""
    in_program = runs_as_one_program(strategy)
    loss_fn = _converted_unless_ours(loss_fn)

    def evaluate(batch, *gathered):
        reads = WeightReads.unchanged(model)
        if sharded is not None:
            reads = sharded.weight_reads(gathered[0] if gathered else None, in_program)
        with reads_redirected(reads):
            return batch_sums(model, batch, loss_fn, training=False)

    @tf.autograph.experimental.do_not_convert
    def replica_step(batch):
        step = tf.function(evaluate, jit_compile=True, autograph=False)
        return step(*_step_args(batch, sharded, in_program))

    def eval_loop(dataset):
        totals = tf.zeros([len(EVAL_SUMS)])
        for batch in dataset:
            sums = strategy.run(replica_step, args=(batch,))
            totals += tf.stack([_sum(strategy, x) for x in sums])
        return totals

    return tf.function(eval_loop)


def loop_metrics(
    sums,
    num_steps: int,
    seconds: float,
    *,
    global_batch_size: int,
    learning_rate: float,
    peak_bytes: int | None = None,
    flops: tuple[float, float | None] | None = None,
) -> dict[str, float]:
    """A host loop's metrics from the sums its train loop returned (`TRAIN_SUMS`) and its time;
    `flops` is (model FLOPs per step, peak FLOP/s of all devices or None)."""
    loss_sum, correct, count, norm_sum = sums
    metrics = {
        "loss": loss_sum / count,
        "accuracy": correct / count,
        "grad_norm": norm_sum / num_steps,
        "learning_rate": learning_rate,
        "steps_per_sec": num_steps / seconds,
        "examples_per_sec": num_steps * global_batch_size / seconds,
        "targets_per_sec": count / seconds,
    }
    if peak_bytes is not None:
        metrics["peak_memory_mib"] = peak_bytes / 2**20
    if flops is not None:
        flops_per_step, peak = flops
        metrics["tflops_per_sec"] = flops_per_step * num_steps / seconds / 1e12
        if peak:
            metrics["mfu"] = flops_per_step * num_steps / seconds / peak
    return metrics


def _sum(strategy: tf.distribute.Strategy, per_replica) -> tf.Tensor:
    return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)


def make_finite_check(strategy: tf.distribute.Strategy, variables: list) -> Callable[[], tf.Tensor]:
    """A `tf.function()` telling whether every floating-point value of `variables` is finite on
    every replica (each replica checks its own copies, which differ for sharded state): one
    reduction per device, cheap next to a step."""
    floating = [v for v in variables if tf.as_dtype(v.dtype).is_floating]

    def replica_count():
        finite = [tf.reduce_all(tf.math.is_finite(v)) for v in floating]
        return tf.reduce_sum(tf.cast(tf.logical_not(tf.stack(finite)), tf.int32))

    def finite():
        return tf.equal(_sum(strategy, strategy.run(replica_count)), 0)

    return tf.function(finite)
