"""Labelled images: the pipeline every image source shares, and folders of JPEG/PNG files.

A source (`ImageSource`: this module's `image_folder`, `tfrecord.py`, `tfds.py`) says how to read
its records; the pipeline, in `tf.data` on the host CPU, does the rest:

    train: this pipeline's (position, record) from start_step on -> decode -> random resized crop,
    flip, RandAugment, keyed by (seed, position) -> normalise -> per-replica batches -> mixup /
    cutmix of pairs of rows -> cast | eval: the whole split once, padded to whole global batches
    with weight-0 examples -> this pipeline's rows -> decode -> resize + centre crop -> normalise.

Batches have static shapes (`drop_remainder`), so XLA compiles the step once; every random
choice is keyed by position, so a resumed run draws what the uninterrupted one would have.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import tensorflow as tf

from framework.core import checks
from framework.data import sharding, streams
from framework.data.images import augment, image_ops

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".JPG", ".JPEG", ".PNG")


@dataclasses.dataclass(frozen=True)
class ImageSource:
    """How the shared pipeline reads one source's split.

    Attributes:
      name: the source's gin name (`tfds`), for messages.
      train: (share, start_step) -> this pipeline's (position, record) stream of the train split
        from `start_step` on (`streams.indexed_epochs`, `streams.record_epochs`).
      eval: () -> the held-out split's records, each once, in a fixed order.
      parse: record -> (decoded image [height, width, 3] uint8, int32 label), in `tf.data`.
      num_classes: the number of classes, which mixup and cutmix need (None if unknown).
      prep: the image settings.
      seed: keys the order and every random draw.
    """

    name: str
    train: Callable[[sharding.Share, int], tf.data.Dataset]
    eval: Callable[[], tf.data.Dataset]
    parse: Callable[[object], tuple[tf.Tensor, tf.Tensor]]
    num_classes: int | None
    prep: image_ops.Preprocessing
    seed: int


def check_split_and_seed(source: str, split: str, seed: object) -> None:
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    checks.integer(f"data.{source}.seed", seed, minimum=0)


def labelled_images(
    split: str,
    input_context: tf.distribute.InputContext | None,
    global_batch_size: int,
    start_step: int,
    source: ImageSource,
) -> tf.data.Dataset:
    """The pipeline of the module docstring over `source`: batches of (images, labels) for
    "train" (labels [batch, classes] float32 probabilities with mixup/cutmix, else int32), of
    (images, labels, weights) for "eval"."""
    prep, seed = source.prep, source.seed
    part = sharding.share(global_batch_size, input_context)
    if prep.mixes:  # checked for both splits: the trainer builds eval first
        _check_mixing(source, part)
    if split == "eval":
        return _eval_batches(source, part)

    def example(position, record):
        image, label = source.parse(record)
        key = tf.stack([tf.cast(seed, tf.int64), position])
        image = image_ops.train_image(image, key, prep)
        if not prep.mixes:
            return image, label
        mix = augment.pair_mix(position, seed, prep.image_size, prep.mixup_alpha, prep.cutmix_alpha)
        return image, label, mix

    def finish(images, labels, mix=None):
        if mix is not None:
            images, labels = augment.mix_batch(images, labels, mix, source.num_classes)
        return tf.cast(images, prep.dtype), labels

    dataset = source.train(part, start_step)
    dataset = dataset.map(example, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    dataset = dataset.batch(part.per_replica, drop_remainder=True).map(finish)
    return dataset.prefetch(tf.data.AUTOTUNE)


def _check_mixing(source: ImageSource, part: sharding.Share) -> None:
    if source.num_classes is None:
        raise ValueError(
            f"data.{source.name}.num_classes is needed for mixup and cutmix (their labels are "
            "class probabilities of that length)"
        )
    if part.per_replica % 2:
        raise ValueError(
            "mixup and cutmix mix pairs of rows within a replica's batch: the per-replica batch "
            f"must be even, got {part.per_replica}"
        )


def _eval_batches(source: ImageSource, part: sharding.Share) -> tf.data.Dataset:
    def example(record, weight):
        image, label = source.parse(record)
        return image_ops.eval_image(image, source.prep), label, weight

    dataset = streams.eval_rows(source.eval(), part)
    dataset = dataset.map(example, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return dataset.batch(part.per_replica, drop_remainder=True).prefetch(tf.data.AUTOTUNE)


def folder_examples(directory: str) -> tuple[list[str], list[int], list[str]]:
    """(files, labels, class names) of a folder with one sub-directory of images per class,
    sorted, so that every host and every run sees the same list."""
    if not tf.io.gfile.isdir(directory):
        raise ValueError(f"image folder {directory!r} not found")
    classes = sorted(
        name.rstrip("/")
        for name in tf.io.gfile.listdir(directory)
        if tf.io.gfile.isdir(f"{directory.rstrip('/')}/{name}")
    )
    files, labels = [], []
    for label, name in enumerate(classes):
        for file in sorted(tf.io.gfile.listdir(f"{directory.rstrip('/')}/{name}")):
            if file.endswith(IMAGE_EXTENSIONS):
                files.append(f"{directory.rstrip('/')}/{name}/{file}")
                labels.append(label)
    if not files:
        raise ValueError(
            f"image folder {directory!r} holds no images: it needs one sub-directory per class "
            f"with {', '.join(IMAGE_EXTENSIONS[:3])} files"
        )
    return files, labels, classes


def image_folder(
    split: str,
    input_context: tf.distribute.InputContext | None = None,
    *,
    global_batch_size: int,
    start_step: int = 0,
    train_directory: str,
    eval_directory: str,
    seed: int = 0,
    **preprocessing: object,
) -> tf.data.Dataset:
    """A data set function (`sharding.DatasetFn`) over folders of JPEG/PNG files, one
    sub-directory per class (the class names, sorted, give the labels); `eval_directory` must
    hold the same classes. `preprocessing`: the settings of `image_ops.Preprocessing`.

    Training takes the files epoch after epoch, each epoch a permutation drawn from (seed,
    epoch); each pipeline reads only the files of its rows, and a resumed run starts at its
    step without reading the files before it.
    """
    check_split_and_seed("image_folder", split, seed)
    prep = image_ops.preprocessing("image_folder", preprocessing)
    files, labels, classes = folder_examples(train_directory)
    if split == "eval":
        files, labels, eval_classes = folder_examples(eval_directory)
        if eval_classes != classes:
            only_eval = sorted(set(eval_classes) - set(classes))[:5]
            only_train = sorted(set(classes) - set(eval_classes))[:5]
            raise ValueError(
                f"the eval folder's classes differ from the train folder's (only in eval: "
                f"{only_eval}; only in train: {only_train}): both need the same sub-directories"
            )
    files_t, labels_t = tf.constant(files), tf.constant(labels, tf.int32)

    def parse(index):
        return image_ops.decode(tf.io.read_file(files_t[index])), labels_t[index]

    source = ImageSource(
        name="image_folder",
        train=lambda part, start: streams.indexed_epochs(len(files), seed, part, start),
        eval=lambda: tf.data.Dataset.range(len(files)),
        parse=parse,
        num_classes=len(classes),
        prep=prep,
        seed=seed,
    )
    return labelled_images(split, input_context, global_batch_size, start_step, source)
