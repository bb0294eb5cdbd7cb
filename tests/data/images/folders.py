"""Image folders for the tests: generated shapes written as PNG and JPEG files."""

import tensorflow as tf

from framework.data.images import synthetic


def write_folder(root, per_class: int, classes: int = 3, size: int = 20, seed: int = 0):
    """`classes` sub-directories of `per_class` generated shape images each (the shapes task's
    images of that class), JPEG and PNG alternately."""
    counts = [0] * classes
    index = 0
    while min(counts) < per_class:
        image, label = (x.numpy() for x in synthetic.make_example(index, seed, size, classes))
        index += 1
        if counts[label] == per_class:
            continue
        counts[label] += 1
        pixels = tf.cast(tf.clip_by_value(image, 0.0, 1.0) * 255, tf.uint8)
        folder = root / f"class_{label}"
        folder.mkdir(parents=True, exist_ok=True)
        if index % 2:
            (folder / f"{index}.png").write_bytes(tf.io.encode_png(pixels).numpy())
        else:
            (folder / f"{index}.jpg").write_bytes(tf.io.encode_jpeg(pixels).numpy())
    return str(root)
