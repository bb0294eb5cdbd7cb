"""Labelled images from the user's files: a folder of JPEG/PNG files per class.

Both sources share one pipeline, in `tf.data` on the host CPU:

    examples (encoded image, label) -> train: a stream of epochs, each a permutation drawn from
    (seed, epoch); this pipeline's rows of each global batch -> decode -> Inception-style random
    resized crop + flip, keyed by (seed, position in the stream) | eval: resize + centre crop
    -> normalise -> per-replica batches of a static shape.

- **Resume**: global step `s` holds stream positions `[s * G, (s + 1) * G)` whatever the device
  layout (G: the global batch); a resumed run skips the positions before `start_step` without
  decoding them, and its crops and flips are the ones an uninterrupted run would have drawn.
- **Sharding**: each input pipeline (one per host) takes its rows of every global batch
  (`sharding.share`) and reads only those files.
- **Eval**: every example once. The last global batch is padded with weight-0 examples, and every
  pipeline yields the same number of batches, so all replicas run the same number of steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import tensorflow as tf

from framework import checks
from framework.data import sharding

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".JPG", ".JPEG", ".PNG")
# ImageNet's channel means and standard deviations, for images scaled to [0, 1].
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


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


def _normalize(image: tf.Tensor, dtype: str) -> tf.Tensor:
    image = (tf.cast(image, tf.float32) / 255.0 - MEAN) / STD
    return tf.cast(image, dtype)


def train_image(encoded: tf.Tensor, seed: tf.Tensor, size: int, dtype: str) -> tf.Tensor:
    """Random resized crop (8% to 100% of the area, aspect 3/4 to 4/3), flip, normalise."""
    image = tf.io.decode_image(encoded, channels=3, expand_animations=False)
    begin, crop, _ = tf.image.stateless_sample_distorted_bounding_box(
        tf.shape(image),
        bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]),
        seed=seed,
        area_range=(0.08, 1.0),
        aspect_ratio_range=(3 / 4, 4 / 3),
        max_attempts=10,
        use_image_if_no_bounding_boxes=True,
    )
    image = tf.slice(image, begin, crop)
    image = tf.image.resize(image, [size, size], method="bilinear", antialias=True)
    image = tf.image.stateless_random_flip_left_right(image, seed=seed + 1)
    return _normalize(image, dtype)


def eval_image(encoded: tf.Tensor, size: int, dtype: str, crop_fraction: float) -> tf.Tensor:
    """Resize the shorter side to `size / crop_fraction`, take the centre `size` square."""
    image = tf.io.decode_image(encoded, channels=3, expand_animations=False)
    height, width = tf.shape(image)[0], tf.shape(image)[1]
    scale = size / crop_fraction / tf.cast(tf.minimum(height, width), tf.float32)
    new = tf.cast(tf.math.ceil(tf.cast(tf.stack([height, width]), tf.float32) * scale), tf.int32)
    image = tf.image.resize(image, tf.maximum(new, size), method="bilinear", antialias=True)
    return _normalize(tf.image.resize_with_crop_or_pad(image, size, size), dtype)


def _train_stream(count: int, seed: int) -> tf.data.Dataset:
    """Epoch after epoch over `count` examples, each epoch in a permutation of its own drawn
    from (seed, epoch); elements are (stream position, example index)."""
    positions = tf.data.Dataset.range(2**62)

    def index(position):
        epoch, offset = position // count, position % count
        order = tf.random.experimental.stateless_shuffle(
            tf.range(count, dtype=tf.int64), seed=tf.stack([tf.cast(seed, tf.int64), epoch])
        )
        return position, order[offset]

    return positions.map(index, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def _pipeline_rows(dataset: tf.data.Dataset, part: sharding.Share) -> tf.data.Dataset:
    """This pipeline's rows of each global batch of a stream of examples."""
    if part.rows == part.global_batch:
        return dataset

    def rows(*batch):
        batch = batch if len(batch) > 1 else batch[0]
        return tf.nest.map_structure(lambda x: x[part.first : part.first + part.rows], batch)

    return dataset.batch(part.global_batch, drop_remainder=True).map(rows).unbatch()


def labelled_images(
    split: str,
    input_context: tf.distribute.InputContext | None,
    *,
    global_batch_size: int,
    start_step: int,
    load: Callable[[tf.Tensor], tuple[tf.Tensor, tf.Tensor]],
    count: int,
    image_size: int,
    seed: int,
    dtype: str,
    crop_fraction: float,
) -> tf.data.Dataset:
    """The pipeline of the module docstring over `count` examples: `load(index)` returns the
    index-th (encoded image, label) of the split."""
    part = sharding.share(global_batch_size, input_context)
    if split == "train":
        stream = _pipeline_rows(_train_stream(count, seed), part)
        stream = stream.skip(start_step * part.rows)

        def example(position, index):
            encoded, label = load(index)
            key = tf.stack([tf.cast(seed, tf.int64), position])
            return train_image(encoded, key, image_size, dtype), label

        dataset = stream.map(example, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        return dataset.batch(part.per_replica, drop_remainder=True).prefetch(tf.data.AUTOTUNE)
    steps = math.ceil(count / part.global_batch)
    indices = _pipeline_rows(tf.data.Dataset.range(steps * part.global_batch), part)

    def example(index):
        real = index < count
        encoded, label = load(tf.minimum(index, count - 1))
        image = eval_image(encoded, image_size, dtype, crop_fraction)
        return image, label, tf.cast(real, tf.float32)  # the padding weighs 0

    dataset = indices.map(example, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return dataset.batch(part.per_replica, drop_remainder=True).prefetch(tf.data.AUTOTUNE)


def _check(split: str, image_size: int, seed: int, dtype: str, crop_fraction: float) -> None:
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    checks.integer("images.image_size", image_size)
    checks.integer("images.seed", seed, minimum=0)
    checks.number("images.crop_fraction", crop_fraction, maximum=1.0 + 1e-9)
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"images.dtype must be 'float32' or 'bfloat16', got {dtype!r}")


def image_folder(
    split: str,
    input_context: tf.distribute.InputContext | None = None,
    *,
    global_batch_size: int,
    start_step: int = 0,
    train_directory: str,
    eval_directory: str,
    image_size: int = 224,
    seed: int = 0,
    dtype: str = "float32",
    crop_fraction: float = 0.875,
) -> tf.data.Dataset:
    """A data set function (`sharding.DatasetFn`) over folders of JPEG/PNG files, one
    sub-directory per class (the class names, sorted, give the labels); `eval_directory` must
    hold the same classes. `dtype='bfloat16'` halves the host-to-device bytes on TPUs."""
    _check(split, image_size, seed, dtype, crop_fraction)
    files, labels, classes = folder_examples(train_directory)
    if split == "eval":
        files, labels, eval_classes = folder_examples(eval_directory)
        if eval_classes != classes:
            raise ValueError(
                f"the eval folder's classes {eval_classes[:5]} differ from the train folder's "
                f"{classes[:5]}: both need the same sub-directories"
            )
    files_t, labels_t = tf.constant(files), tf.constant(labels, tf.int32)

    def load(index):
        return tf.io.read_file(files_t[index]), labels_t[index]

    return labelled_images(
        split,
        input_context,
        global_batch_size=global_batch_size,
        start_step=start_step,
        load=load,
        count=len(files),
        image_size=image_size,
        seed=seed,
        dtype=dtype,
        crop_fraction=crop_fraction,
    )
