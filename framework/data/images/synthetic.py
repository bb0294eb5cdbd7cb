"""Generated images of shapes: a learnable image task that needs no download.

Each example is drawn from a stateless RNG keyed by (seed, example index), so the stream is the same
on every run and on every worker, a resumed run continues exactly where it stopped, and any device
layout that consumes the same global batches sees the same examples. Images are made by TensorFlow
ops inside `tf.data`, so the pipeline runs in C++ without Python per example.
"""

from __future__ import annotations

import tensorflow as tf

from framework.core import checks
from framework.data import sharding

SHAPES = ("disk", "square", "ring", "plus", "diamond", "triangle", "h_stripes", "v_stripes")
HELD_OUT_SEED_OFFSET = 1_000_003


def _draw(shape_id: tf.Tensor, image_size: int, seed: tf.Tensor) -> tf.Tensor:
    """A [size, size, 3] float32 image of shape `shape_id` at a random place, size and colour."""
    uniform = tf.random.stateless_uniform([10], seed=seed)
    size = float(image_size)
    radius = size * (0.18 + 0.14 * uniform[0])
    cx = radius + (size - 2 * radius) * uniform[1]
    cy = radius + (size - 2 * radius) * uniform[2]
    coords = tf.range(image_size, dtype=tf.float32) + 0.5
    y, x = tf.meshgrid(coords, coords, indexing="ij")
    dx, dy = x - cx, y - cy
    dist = tf.sqrt(dx * dx + dy * dy)
    inside = tf.logical_and(tf.abs(dx) < radius, tf.abs(dy) < radius)
    period = radius / 2.0
    masks = [
        dist < radius,
        inside,
        tf.logical_and(dist < radius, dist > 0.55 * radius),
        tf.logical_and(inside, tf.logical_or(tf.abs(dx) < radius / 3, tf.abs(dy) < radius / 3)),
        tf.abs(dx) + tf.abs(dy) < radius,
        tf.logical_and(inside, tf.abs(dx) < (dy + radius) / 2),
        tf.logical_and(inside, tf.math.floormod(dy, period) < period / 2),
        tf.logical_and(inside, tf.math.floormod(dx, period) < period / 2),
    ]
    mask = tf.cast(tf.gather(tf.stack(masks), shape_id), tf.float32)[..., None]
    foreground = 0.5 + 0.5 * uniform[3:6]
    background = 0.4 * uniform[6:9]
    noise = 0.1 * tf.random.stateless_normal([image_size, image_size, 3], seed=seed + 1)
    return mask * foreground + (1.0 - mask) * background + noise


def make_example(index: tf.Tensor, seed: int, image_size: int, num_classes: int):
    """The example at position `index` of the stream `seed`: (image, label)."""
    key = tf.stack([tf.cast(seed, tf.int64), tf.cast(index, tf.int64)])
    label = tf.random.stateless_uniform([], seed=key, minval=0, maxval=num_classes, dtype=tf.int32)
    image = _draw(label, image_size, key + 7)
    return image, label


def shapes(
    split: str,
    input_context: tf.distribute.InputContext | None = None,
    *,
    global_batch_size: int,
    start_step: int = 0,
    image_size: int = 32,
    num_classes: int = len(SHAPES),
    seed: int = 0,
    eval_examples: int = 1024,
) -> tf.data.Dataset:
    """Batches of (image [B, S, S, 3] float32, label [B] int32) from the shapes task.

    `split="train"` is an endless stream starting at global step `start_step`; `split="eval"` is
    a fixed held-out set of `eval_examples` drawn from another seed, cut to whole global batches.
    A data set function (`sharding.DatasetFn`): each input pipeline makes its replicas' batches,
    so that global step `s` always holds the examples `[s * G, (s + 1) * G)` of the stream,
    whatever the device layout (G is `global_batch_size`).
    """
    checks.integer("shapes.image_size", image_size)
    checks.integer("shapes.num_classes", num_classes)
    checks.integer("shapes.seed", seed, minimum=0)
    checks.integer("shapes.eval_examples", eval_examples)
    if num_classes > len(SHAPES):
        raise ValueError(
            f"shapes.num_classes must be between 1 and {len(SHAPES)}, got {num_classes}"
        )
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    part = sharding.share(global_batch_size, input_context)
    global_batch = part.global_batch
    if split == "train":
        steps = tf.data.Dataset.range(start_step, 2**62)
        stream_seed = seed
    else:
        num_steps = eval_examples // global_batch
        if num_steps == 0:
            raise ValueError(
                f"eval_examples={eval_examples} is smaller than the global batch {global_batch}: "
                "the held-out set would be empty"
            )
        steps = tf.data.Dataset.range(num_steps)
        stream_seed = seed + HELD_OUT_SEED_OFFSET
    indices = steps.flat_map(
        lambda step: tf.data.Dataset.range(
            step * global_batch + part.first, step * global_batch + part.first + part.rows
        )
    )
    dataset = indices.map(
        lambda i: make_example(i, stream_seed, image_size, num_classes),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )
    return dataset.batch(part.per_replica, drop_remainder=True).prefetch(tf.data.AUTOTUNE)


def chance_accuracy(num_classes: int = len(SHAPES)) -> float:
    """Accuracy of guessing: labels are uniform over the classes."""
    return 1.0 / num_classes
