"""Labelled images from TFRecord files of `tf.train.Example`s (local or gs://).

Each example holds an encoded image (JPEG/PNG) and an integer label; the keys default to the
common ImageNet layout (`image/encoded`, `image/class/label`, labels from 1, hence
`label_offset = 1`). Preprocessing is the shared image pipeline's (`pipeline.py`).

- **Training order**: epoch after epoch; each epoch reads the files in a permutation drawn from
  (seed, epoch), `cycle_length` files at a time, interleaved record by record, then in blocks
  of `shuffle_block` records, each block permuted by (seed, epoch, block) (the locality of a
  shuffle buffer of that size). Deterministic for a seed.
- **Sharding** (`sharding`): 'read_own' gives each input pipeline (one per host) every P-th file,
  so each host reads 1/P of the data; 'read_all' has every pipeline read all files and keep its
  rows of each global batch (the same stream whatever P; P times the reading). 'auto' reads own
  files when there are at least as many files as pipelines.
- **Resume**: a run resumed at step s continues the stream exactly where step s would have been,
  as long as the files, the seed, `shuffle_block`, `cycle_length` and, with 'read_own', the
  number of pipelines are the same (with another number of hosts each host has other files: the
  stream differs, exact resume is impossible). Whole epochs are skipped by counting the records
  once (one read of this pipeline's files, on resume only); the part of the current epoch before
  step s is read again and dropped without decoding.
- **Eval**: every pipeline reads the eval files in order and decodes its rows; the last global
  batch is padded with weight-0 examples, so each example counts once.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from framework.core import checks
from framework.core.errors import BAD_DATA
from framework.core.files import list_files
from framework.data import sharding as sharding_lib
from framework.data import streams
from framework.data.images import image_ops, pipeline


def _check_example(record: bytes, image_key: str, label_key: str, files: list[str]) -> None:
    """The first record holds an image under `image_key` and an integer under `label_key`."""
    features = tf.train.Example.FromString(record).features.feature
    wanted = {image_key: "bytes_list", label_key: "int64_list"}
    for key, kind in wanted.items():
        setting = "image_key" if key == image_key else "label_key"
        if key not in features or features[key].WhichOneof("kind") != kind:
            raise ValueError(
                f"the examples of {files[0]} have no {kind.split('_')[0]} feature {key!r} "
                f"(data.tfrecord.{setting}); their features: {sorted(features)}"
            )


def _first_record(files: list[str]) -> bytes:
    for record in tf.data.TFRecordDataset(files).take(1):
        return record.numpy()
    raise ValueError(f"the TFRecord files {files[:3]}... hold no records")


def tfrecord(
    split: str,
    input_context: tf.distribute.InputContext | None = None,
    *,
    global_batch_size: int,
    start_step: int = 0,
    train_files: str | Sequence[str],
    eval_files: str | Sequence[str],
    image_key: str = "image/encoded",
    label_key: str = "image/class/label",
    label_offset: int = 1,
    num_classes: int | None = None,
    sharding: str = "auto",
    shuffle_block: int = 10_000,
    cycle_length: int = 16,
    seed: int = 0,
    **preprocessing: object,
) -> tf.data.Dataset:
    """A data set function (`sharding.DatasetFn`) over TFRecord files (see the module
    docstring). `train_files`, `eval_files`: file names or globs. The label is the integer
    feature minus `label_offset`; `num_classes` (needed by mixup and cutmix) also checks each
    label's range. `preprocessing`: the settings of `image_ops.Preprocessing`."""
    pipeline.check_split_and_seed("tfrecord", split, seed)
    prep = image_ops.preprocessing("tfrecord", preprocessing)
    checks.integer("data.tfrecord.label_offset", label_offset, minimum=-(2**31))
    checks.integer("data.tfrecord.num_classes", num_classes, optional=True)
    checks.integer("data.tfrecord.shuffle_block", shuffle_block)
    checks.integer("data.tfrecord.cycle_length", cycle_length)
    part = sharding_lib.share(global_batch_size, input_context)
    files = list_files(train_files, "data.tfrecord.train_files")
    read_own = streams.reads_own_files("data.tfrecord.sharding", sharding, len(files), part)
    if split == "eval":
        files = list_files(eval_files, "data.tfrecord.eval_files")
    _check_example(_first_record(files), image_key, label_key, files)

    def parse(record):
        features = tf.io.parse_single_example(
            record,
            {
                image_key: tf.io.FixedLenFeature([], tf.string),
                label_key: tf.io.FixedLenFeature([], tf.int64),
            },
        )
        label = tf.cast(features[label_key] - label_offset, tf.int32)
        label_range = "negative" if num_classes is None else f"outside [0, {num_classes})"
        message = (
            f"{BAD_DATA}a label of {files[0]}... minus data.tfrecord.label_offset = "
            f"{label_offset} is {label_range}: set label_offset (0 for labels from 0) or "
            "num_classes"
        )
        valid = label >= 0 if num_classes is None else (label >= 0) & (label < num_classes)
        with tf.control_dependencies([tf.debugging.Assert(valid, [message, label])]):
            return image_ops.decode(features[image_key]), tf.identity(label)

    def train(part, start):
        own = files[part.pipeline :: part.pipelines] if read_own else files
        if read_own:
            _first_record(own)

        def epoch(number):
            records = streams.interleaved_files(
                own, tf.data.TFRecordDataset, seed, number, cycle_length
            )
            return streams.block_shuffle(records, shuffle_block, seed, number)

        def count():
            records = tf.data.TFRecordDataset(own, num_parallel_reads=cycle_length)
            return int(records.reduce(tf.constant(0, tf.int64), lambda n, _: n + 1))

        return streams.record_epochs(epoch, part, start, read_own=read_own, epoch_length=count)

    source = pipeline.ImageSource(
        name="tfrecord",
        train=train,
        eval=lambda: tf.data.TFRecordDataset(files, num_parallel_reads=cycle_length),
        parse=parse,
        num_classes=num_classes,
        prep=prep,
        seed=seed,
    )
    return pipeline.labelled_images(split, input_context, global_batch_size, start_step, source)
