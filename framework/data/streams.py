"""Streams of examples keyed by their position, shared by the image sources.

Global step `s` holds stream positions `[s * G, (s + 1) * G)` (G: the global batch); an input
pipeline makes rows `[first, first + rows)` of each global batch (`sharding.share`). Training
streams are endless and start at `start_step`; eval streams cover the split once, padded with
weight-0 examples to whole global batches.

Two ways for a pipeline to get its rows:

- **read all** (`pipeline_rows`): every pipeline builds the same global stream and keeps its rows.
  The stream is the same whatever the number of pipelines, at the price of every pipeline reading
  every record (only its own rows are decoded).
- **read own** (`own_positions`): each pipeline reads its own part of the data (its files, a
  sub-split) and numbers its examples as the rows it fills. Each pipeline reads 1/P of the data,
  but the stream depends on the number of pipelines P: a run resumed with another P continues
  with other examples in another order.
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from framework.data import sharding

ENDLESS = 2**62
SHARDING = ("auto", "read_own", "read_all")


def check_sharding(setting: str, sharding: object) -> None:
    """A source's `sharding` setting (named `setting` in errors) is one of SHARDING."""
    if sharding not in SHARDING:
        raise ValueError(f"{setting} must be one of {SHARDING}, got {sharding!r}")


def reads_own(setting: str, sharding: str, auto: bool) -> bool:
    """Whether each pipeline reads its own part of the data, for a source's `sharding` setting
    (named `setting` in errors); `auto` is the source's choice for 'auto'."""
    check_sharding(setting, sharding)
    return sharding == "read_own" or (sharding == "auto" and auto)


def reads_own_files(setting: str, choice: str, files: int, part: sharding.Share) -> bool:
    """`reads_own` for a source of `files` files and the `choice` of its `setting`: 'auto'
    reads own files when there are at least as many as pipelines; 'read_own' needs that many."""
    own = reads_own(setting, choice, auto=files >= part.pipelines)
    if own and files < part.pipelines:
        raise ValueError(
            f"{setting} = 'read_own' needs a file per input pipeline: {files} files, "
            f"{part.pipelines} pipelines ('read_all' reads them all)"
        )
    return own


def pipeline_rows(dataset: tf.data.Dataset, part: sharding.Share) -> tf.data.Dataset:
    """This pipeline's rows of each global batch of `dataset`, a stream starting at a global
    batch boundary."""
    if part.rows == part.global_batch:
        return dataset
    batches = dataset.batch(part.global_batch, drop_remainder=True)
    return batches.map(_rows_of(part)).unbatch()


def _rows_of(part: sharding.Share) -> Callable:
    """A function keeping this pipeline's rows of a global batch."""

    def rows(*batch):
        batch = batch if len(batch) > 1 else batch[0]
        return tf.nest.map_structure(lambda x: x[part.first : part.first + part.rows], batch)

    return rows


def indexed_epochs(count: int, seed: int, part: sharding.Share, start_step: int) -> tf.data.Dataset:
    """(position, example index) of this pipeline's rows from `start_step` on, over `count`
    examples epoch after epoch, each epoch a permutation drawn from (seed, epoch). Positions are
    computed, not read, so resuming costs nothing."""
    positions = tf.data.Dataset.range(start_step * part.global_batch, ENDLESS)

    def index(position):
        epoch, offset = position // count, position % count
        order = tf.random.experimental.stateless_shuffle(
            tf.range(count, dtype=tf.int64), seed=tf.stack([tf.cast(seed, tf.int64), epoch])
        )
        return position, order[offset]

    stream = positions.map(index, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return pipeline_rows(stream, part)


def interleaved_files(
    files: list[str],
    read: Callable[[tf.Tensor], tf.data.Dataset],
    seed: int,
    epoch: tf.Tensor,
    cycle_length: int,
) -> tf.data.Dataset:
    """The records of `files` (`read(path)` each) for one epoch: the files in a permutation drawn
    from (seed, epoch), `cycle_length` at a time, interleaved record by record, in parallel and
    in a deterministic order."""
    order = tf.random.experimental.stateless_shuffle(
        tf.range(len(files)), seed=tf.stack([tf.cast(seed, tf.int64), tf.cast(epoch, tf.int64)])
    )
    return tf.data.Dataset.from_tensor_slices(tf.gather(tf.constant(files), order)).interleave(
        read,
        cycle_length=min(cycle_length, len(files)),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )


def block_shuffle(
    records: tf.data.Dataset, block: int, seed: int, epoch: tf.Tensor
) -> tf.data.Dataset:
    """`records` in blocks of `block`, each block in a permutation drawn from (seed, epoch,
    block index): the locality of a shuffle buffer of that size, with stateless draws (tf.data's
    shuffle takes no tensor seed once a global seed is set, as the trainer sets one)."""

    def permute(index, batch):
        order = block_order(tf.shape(tf.nest.flatten(batch)[0])[0], seed, epoch, index)
        return tf.nest.map_structure(lambda x: tf.gather(x, order), batch)

    return records.batch(block).enumerate().map(permute).unbatch()


def block_order(size: tf.Tensor, seed: int, epoch: tf.Tensor, block: tf.Tensor) -> tf.Tensor:
    """The permutation of block `block` (`size` records) of epoch `epoch` in `block_shuffle`."""
    key = tf.stack([tf.cast(seed, tf.int64), tf.cast(epoch, tf.int64)])
    block_key = tf.random.experimental.stateless_fold_in(key, tf.cast(block, tf.int64))
    return tf.random.experimental.stateless_shuffle(tf.range(size), seed=block_key)


def record_epochs(
    epoch: Callable[[tf.Tensor], tf.data.Dataset],
    part: sharding.Share,
    start_step: int,
    *,
    read_own: bool,
    epoch_length: Callable[[], int],
) -> tf.data.Dataset:
    """(position, record) of this pipeline's rows from `start_step` on, over the endless
    stream epoch(0), epoch(1), ... (each a deterministic order of the records).

    `read_own`: the epochs hold only this pipeline's records (see the module docstring), else
    the records of all pipelines. On resume, whole epochs are skipped without reading them
    (`epoch_length()`, the records per epoch, is asked only then) and the records of the
    current epoch before `start_step` are read and dropped, undecoded.
    """
    per_step = part.rows if read_own else part.global_batch
    skip = start_step * per_step
    first_epoch, within = divmod(skip, epoch_length()) if skip else (0, 0)
    stream = tf.data.Dataset.range(first_epoch, ENDLESS).flat_map(epoch).skip(within)
    stream = stream.enumerate(skip)
    if not read_own:
        return pipeline_rows(stream, part)

    def position(index, record):  # the index-th example this pipeline makes
        step, row = index // part.rows, index % part.rows
        return step * part.global_batch + part.first + row, record

    return stream.map(position)


def eval_rows(records: tf.data.Dataset, part: sharding.Share) -> tf.data.Dataset:
    """(record, weight) for this pipeline's rows of each global batch of a finite split: every
    record once with weight 1, the last global batch completed with weight-0 copies of the
    first record. Every pipeline reads every record and yields the same number of rows, so all
    replicas run the same number of steps and no count is needed beforehand."""
    real = records.map(lambda record: (record, 1.0))
    padding = records.take(1).map(lambda record: (record, 0.0)).repeat()
    batches = real.concatenate(padding).batch(part.global_batch, drop_remainder=True)
    batches = batches.take_while(lambda record, weight: weight[0] > 0)
    return batches.map(_rows_of(part)).unbatch()
