"""Per-image preprocessing shared by the image sources, and its settings.

Train: Inception-style random resized crop, random flip, optional RandAugment (`augment.py`),
normalisation. Eval: the shorter side resized to `image_size / crop_fraction`, the centre square
kept, normalisation. Every random draw is keyed by (seed, position in the stream), so a resumed run
redraws exactly what the uninterrupted one would have, whatever the order tf.data runs them in.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping, Sequence

import tensorflow as tf

from framework.core import checks
from framework.data.images import augment

# ImageNet's channel means and standard deviations, for images scaled to [0, 1].
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Preprocessing:
    """The image settings every source takes as keyword arguments (`data.tfds.image_size = 32`).

    Attributes:
      image_size: side of the square images the model gets.
      crop_fraction: eval keeps the centre `crop_fraction` of the image resized to
        `image_size / crop_fraction` (0.875: 256 -> 224).
      mean, std: per-channel normalisation of images scaled to [0, 1] (ImageNet's by default;
        (0.5,) * 3 twice gives [-1, 1]).
      dtype: of the images sent to the devices; 'bfloat16' halves the bytes on TPUs.
      randaugment_ops: RandAugment ops applied to each training image (0: off).
      randaugment_magnitude: their strength, 0 to 10 (RandAugment's scale; 9 in DeiT).
      mixup_alpha, cutmix_alpha: Beta(alpha, alpha) mixing of pairs of training examples (0:
        off); labels become class probabilities.
    """

    image_size: int = 224
    crop_fraction: float = 0.875
    mean: tuple[float, ...] = MEAN
    std: tuple[float, ...] = STD
    dtype: str = "float32"
    randaugment_ops: int = 0
    randaugment_magnitude: float = 9.0
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0

    @property
    def mixes(self) -> bool:
        return bool(self.mixup_alpha or self.cutmix_alpha)


SETTINGS = tuple(field.name for field in dataclasses.fields(Preprocessing))


def preprocessing(source: str, settings: Mapping[str, object]) -> Preprocessing:
    """The `Preprocessing` of a source's keyword arguments, each checked and named as the user
    binds it (`data.tfds.mixup_alpha`); an unknown name is an error listing the known ones."""
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise TypeError(
            f"data.{source} has no setting {unknown[0]!r}; its image settings are "
            f"{', '.join(SETTINGS)}"
        )
    prep = Preprocessing(**settings)

    def name(setting: str) -> str:
        return f"data.{source}.{setting}"

    checks.integer(name("image_size"), prep.image_size)
    checks.number(name("crop_fraction"), prep.crop_fraction, maximum=1.0 + 1e-9)
    _check_channels(name("mean"), prep.mean, positive=False)
    _check_channels(name("std"), prep.std, positive=True)
    if prep.dtype not in DTYPES:
        raise ValueError(f"{name('dtype')} must be one of {DTYPES}, got {prep.dtype!r}")
    checks.integer(name("randaugment_ops"), prep.randaugment_ops, minimum=0)
    checks.number(
        name("randaugment_magnitude"),
        prep.randaugment_magnitude,
        maximum=10.0 + 1e-9,
        inclusive=True,
    )
    checks.number(name("mixup_alpha"), prep.mixup_alpha, inclusive=True)
    checks.number(name("cutmix_alpha"), prep.cutmix_alpha, inclusive=True)
    return dataclasses.replace(prep, mean=tuple(prep.mean), std=tuple(prep.std))


def _check_channels(name: str, values: object, *, positive: bool) -> None:
    wanted = "3 positive numbers" if positive else "3 numbers"
    if (
        not isinstance(values, Sequence)
        or len(values) != 3
        or not all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in values)
        or (positive and min(values) <= 0)
    ):
        raise ValueError(
            f"{name} must be {wanted} (one per channel, images in [0, 1]), got {values!r}"
        )


def decode(image: tf.Tensor) -> tf.Tensor:
    """A [height, width, 3] uint8 image from encoded JPEG/PNG/GIF/BMP bytes or a decoded image
    (grey images become RGB), so every source hands the same kind of image on."""
    if image.dtype == tf.string:
        return tf.io.decode_image(image, channels=3, expand_animations=False)
    if image.shape.rank != 3 or image.shape[-1] not in (1, 3):
        raise ValueError(f"images must be [height, width, 1 or 3], got shape {image.shape}")
    image = tf.image.convert_image_dtype(image, tf.uint8, saturate=True)
    return tf.image.grayscale_to_rgb(image) if image.shape[-1] == 1 else image


def random_resized_crop(image: tf.Tensor, key: tf.Tensor, size: int) -> tf.Tensor:
    """Inception's crop (8% to 100% of the area, aspect ratio 3/4 to 4/3) resized to `size`,
    flipped left-right with probability 1/2; float32 in [0, 255]."""
    begin, crop, _ = tf.image.stateless_sample_distorted_bounding_box(
        tf.shape(image),
        bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]),
        seed=key,
        area_range=(0.08, 1.0),
        aspect_ratio_range=(3 / 4, 4 / 3),
        max_attempts=10,
        use_image_if_no_bounding_boxes=True,
    )
    image = tf.slice(image, begin, crop)
    image = tf.image.resize(image, [size, size], method="bilinear", antialias=True)
    image = tf.image.stateless_random_flip_left_right(image, seed=key + 1)
    return tf.ensure_shape(tf.clip_by_value(image, 0.0, 255.0), [size, size, 3])


def center_crop(image: tf.Tensor, size: int, crop_fraction: float) -> tf.Tensor:
    """The shorter side resized to `size / crop_fraction`, the centre `size` square kept;
    float32 in [0, 255]."""
    height, width = tf.shape(image)[0], tf.shape(image)[1]
    scale = size / crop_fraction / tf.cast(tf.minimum(height, width), tf.float32)
    new = tf.cast(tf.math.ceil(tf.cast(tf.stack([height, width]), tf.float32) * scale), tf.int32)
    image = tf.image.resize(image, tf.maximum(new, size), method="bilinear", antialias=True)
    image = tf.image.resize_with_crop_or_pad(image, size, size)
    return tf.ensure_shape(tf.clip_by_value(image, 0.0, 255.0), [size, size, 3])


def normalize(image: tf.Tensor, prep: Preprocessing) -> tf.Tensor:
    """Pixels in [0, 255] to (x / 255 - mean) / std per channel, float32."""
    return (image / 255.0 - prep.mean) / prep.std


def train_image(image: tf.Tensor, key: tf.Tensor, prep: Preprocessing) -> tf.Tensor:
    """A decoded image made a training example: crop, flip, RandAugment, normalise (float32;
    the batch is cast to `prep.dtype` after mixing)."""
    image = random_resized_crop(image, key, prep.image_size)
    if prep.randaugment_ops:
        image = augment.rand_augment(image, key, prep.randaugment_ops, prep.randaugment_magnitude)
    return normalize(image, prep)


def eval_image(image: tf.Tensor, prep: Preprocessing) -> tf.Tensor:
    """A decoded image made an eval example: centre crop, normalise, cast to `prep.dtype`."""
    return tf.cast(
        normalize(center_crop(image, prep.image_size, prep.crop_fraction), prep), prep.dtype
    )
