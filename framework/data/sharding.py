"""The data set protocol, and which rows of each global batch an input pipeline makes.

A data set function, the trainer's `dataset_fn`, is called as

    dataset_fn(split, input_context, *, global_batch_size, start_step)

once per input pipeline (one per host under a multi-worker or TPU strategy, as
`strategy.distribute_datasets_from_function` calls it) and returns that pipeline's batches of
`input_context.get_per_replica_batch_size(global_batch_size)` examples: an endless stream for
"train" starting at global step `start_step`, and a finite held-out set for "eval". Each
element is (inputs, labels) or (inputs, labels, weights); labels are integer class ids, or float
class probabilities [..., classes] (mixed labels).

A data set function whose stream a step number cannot address (packed text) also takes
`stream_positions` (`positions.StreamPositions`): it records there where each step's batch
begins, and a resumed run passes the positions it saved, so that it starts reading there.

The trainer, not the data set, owns the global batch size, since the planner and the user
change it per run; `input_context=None` means one pipeline feeding one replica (a notebook, a
test, or the planner's single-replica step).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Protocol

import tensorflow as tf

from framework.data import positions


class DatasetFn(Protocol):
    def __call__(
        self,
        split: str,
        input_context: tf.distribute.InputContext | None = None,
        *,
        global_batch_size: int,
        start_step: int = 0,
    ) -> tf.data.Dataset: ...


@dataclasses.dataclass(frozen=True)
class Share:
    """One pipeline's part of every global batch.

    Attributes:
      per_replica: examples per replica batch (what the pipeline's batches hold).
      rows: examples this pipeline makes per global batch (its replicas' batches together).
      first: index of its first row within each global batch; pipelines take consecutive rows,
        so global step `s` holds the same examples whatever the device layout.
      global_batch: the global batch size.
    """

    per_replica: int
    rows: int
    first: int
    global_batch: int

    @property
    def pipelines(self) -> int:
        """The number of input pipelines sharing each global batch."""
        return self.global_batch // self.rows

    @property
    def pipeline(self) -> int:
        """This pipeline's index."""
        return self.first // self.rows


def share(global_batch_size: int, input_context: tf.distribute.InputContext | None = None) -> Share:
    """This pipeline's share of each global batch of `global_batch_size` examples."""
    context = input_context or tf.distribute.InputContext()
    if not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ValueError(f"global_batch_size must be a positive integer, got {global_batch_size!r}")
    per_replica = context.get_per_replica_batch_size(global_batch_size)  # raises if not even
    rows = per_replica * (context.num_replicas_in_sync // context.num_input_pipelines)
    return Share(per_replica, rows, context.input_pipeline_id * rows, global_batch_size)


def distribute(
    strategy: tf.distribute.Strategy,
    dataset_fn: DatasetFn,
    split: str,
    *,
    global_batch_size: int,
    start_step: int = 0,
    stream_positions: positions.StreamPositions | None = None,
) -> tf.distribute.DistributedDataset:
    """`dataset_fn`'s `split` as the strategy's distributed data set: one call per pipeline.
    `stream_positions` goes to a `dataset_fn` that takes it."""
    settings = dict(global_batch_size=global_batch_size, start_step=start_step)
    if stream_positions is not None and takes_stream_positions(dataset_fn):
        settings["stream_positions"] = stream_positions

    def pipeline(context: tf.distribute.InputContext) -> tf.data.Dataset:
        return dataset_fn(split, context, **settings)

    return strategy.distribute_datasets_from_function(pipeline)


def features_spec(dataset_fn: DatasetFn, global_batch_size: int):
    """The spec of the features (the first of each element) of `dataset_fn`'s eval split, as one
    pipeline reads it: what a model that builds on its first call is built for."""
    dataset = dataset_fn(
        "eval", tf.distribute.InputContext(), global_batch_size=global_batch_size, start_step=0
    )
    return dataset.element_spec[0]


def takes_stream_positions(dataset_fn: DatasetFn) -> bool:
    """Whether `dataset_fn` records and seeks stream positions (a `stream_positions` argument)."""
    try:
        return "stream_positions" in inspect.signature(dataset_fn).parameters
    except (TypeError, ValueError):  # (a callable without a signature)
        return False
