"""Labelled images from a TensorFlow Datasets image classification data set (`cifar10`,
`imagenet2012`, ...), prepared beforehand in `data_dir` (local or gs://): nothing is downloaded.

TensorFlow Datasets is an optional extra: `pip install 'framework[tfds]'`. Images are read
encoded and decoded by the shared image pipeline (`pipeline.py`), so the records a pipeline skips
or leaves to other pipelines are never decoded.

- **Training order**: the split in TFDS's order (shuffled when TFDS prepared it), epoch after
  epoch, each epoch in blocks of `shuffle_block` examples, each block permuted by (seed, epoch,
  block). Deterministic for a seed.
- **Sharding** (`sharding`): 'read_own' gives input pipeline i of P the i-th of P even sub-splits
  (`tfds.even_splits`), so each host reads 1/P of the data; 'read_all' has every pipeline read
  the split and keep its rows of each global batch (the same stream whatever P). 'auto' reads
  own sub-splits with more than one pipeline.
- **Resume**: exact for the same data set, seed, `shuffle_block` and, with 'read_own', number
  of pipelines (another number of hosts gives each host another sub-split: exact resume is
  impossible). Whole epochs are skipped from the split's size without reading; the part of the
  current epoch before the step is read again and dropped without decoding.
- **Eval**: every pipeline reads the eval split in order and decodes its rows; the last global
  batch is padded with weight-0 examples, so each example counts once.
"""

from __future__ import annotations

import tensorflow as tf

from framework.core import checks
from framework.data import sharding as sharding_lib
from framework.data import streams, tfds_builder
from framework.data.images import image_ops, pipeline


def _read(
    builder, split: str, image_key: str, label_key: str, data_dir: str | None
) -> tf.data.Dataset:
    """The split's (image, label) examples in TFDS's order, images left encoded."""
    tfds = tfds_builder.import_tfds()
    decoders = None
    if isinstance(builder.info.features[image_key], tfds.features.Image):
        decoders = {image_key: tfds.decode.SkipDecoding()}
    examples = tfds_builder.as_dataset(builder, split, data_dir, decoders)
    return examples.map(lambda example: {key: example[key] for key in (image_key, label_key)})


def _check_keys(builder, image_key: str, label_key: str) -> int | None:
    """The number of classes of the label feature (None if it is not a ClassLabel)."""
    tfds_builder.check_features(builder, {"image_key": image_key, "label_key": label_key})
    label = builder.info.features[label_key]
    return (
        label.num_classes
        if isinstance(label, tfds_builder.import_tfds().features.ClassLabel)
        else None
    )


def tfds(
    split: str,
    input_context: tf.distribute.InputContext | None = None,
    *,
    global_batch_size: int,
    start_step: int = 0,
    name: str,
    train_split: str = "train",
    eval_split: str = "test",
    data_dir: str | None = None,
    image_key: str = "image",
    label_key: str = "label",
    sharding: str = "auto",
    shuffle_block: int = 10_000,
    seed: int = 0,
    **preprocessing: object,
) -> tf.data.Dataset:
    """A data set function (`sharding.DatasetFn`) over the TFDS data set `name` (see the module
    docstring). `train_split`, `eval_split`: TFDS split names, slices included
    ('train[:99%]', 'validation'). `preprocessing`: the settings of `image_ops.Preprocessing`."""
    pipeline.check_split_and_seed("tfds", split, seed)
    prep = image_ops.preprocessing("tfds", preprocessing)
    checks.integer("data.tfds.shuffle_block", shuffle_block)
    part = sharding_lib.share(global_batch_size, input_context)
    read_own = streams.reads_own("data.tfds.sharding", sharding, auto=part.pipelines > 1)
    data_set = tfds_builder.builder(name, data_dir)
    num_classes = _check_keys(data_set, image_key, label_key)
    eval_data = (
        _read(data_set, eval_split, image_key, label_key, data_dir) if split == "eval" else None
    )

    def train(part, start):
        own = train_split
        if read_own and part.pipelines > 1:
            own = tfds_builder.import_tfds().even_splits(train_split, n=part.pipelines)[
                part.pipeline
            ]
        data = _read(data_set, own, image_key, label_key, data_dir)
        size = int(data.cardinality())
        if size == 0:
            raise ValueError(f"data.tfds: {name} split {own!r} holds no examples")

        def epoch(number):
            return streams.block_shuffle(data, shuffle_block, seed, number)

        def count():
            if size < 0:  # unknown: count by reading
                return int(data.reduce(tf.constant(0, tf.int64), lambda n, _: n + 1))
            return size

        return streams.record_epochs(epoch, part, start, read_own=read_own, epoch_length=count)

    def parse(example):
        return image_ops.decode(example[image_key]), tf.cast(example[label_key], tf.int32)

    source = pipeline.ImageSource(
        name="tfds",
        train=train,
        eval=lambda: eval_data,
        parse=parse,
        num_classes=num_classes,
        prep=prep,
        seed=seed,
    )
    return pipeline.labelled_images(split, input_context, global_batch_size, start_step, source)
