"""RandAugment and mixup/cutmix, with every random draw keyed by stream position.

- **RandAugment** (Cubuk et al. 2019): `num_ops` ops drawn uniformly per image from a small set
  that plain TensorFlow ops run cheaply on the host: identity, autocontrast, equalize, solarize,
  posterize, brightness, contrast, colour, sharpness, horizontal and vertical translation. The
  geometric ops that need a projective transform (rotate, shear) are left out. One magnitude
  (0 to 10, RandAugment's scale) sets every op's strength; signed ops take a random sign.
- **mixup** (Zhang et al. 2018) and **cutmix** (Yun et al. 2019) mix the two examples of each pair
  of consecutive rows of the global batch: (x_a, x_b) -> (l x_a + (1 - l) x_b, l x_b + (1 - l) x_a)
  for mixup, a box of area 1 - l swapped between them for cutmix, with l ~ Beta(alpha, alpha) per
  pair, and the labels mixed by the same l. Pairs never cross replicas (the per-replica batch is
  even), so step s mixes the same pairs whatever the device layout. With both on, each pair takes
  one of them with probability 1/2.

A pair's draws are made per example from the key of the pair's first position, so both examples
of a pair draw the same numbers and the batch step is plain arithmetic.
"""

from __future__ import annotations

import functools

import tensorflow as tf

# Translation at magnitude 10, as a fraction of the image side (100 px of 224 in the reference).
MAX_TRANSLATE = 0.45
# Enhance factors (brightness, contrast, colour, sharpness) span 1 +- 0.9 at magnitude 10.
MAX_ENHANCE = 0.9
MIX_PARAMS = 6  # lambda, box (y0, x0, y1, x1), 1 for cutmix / 0 for mixup


def _blend(image: tf.Tensor, degenerate: tf.Tensor, factor: tf.Tensor) -> tf.Tensor:
    """PIL's ImageEnhance: factor 0 gives `degenerate`, 1 the image, beyond extrapolates."""
    return tf.clip_by_value(degenerate + factor * (image - degenerate), 0.0, 255.0)


def _grey(image: tf.Tensor) -> tf.Tensor:
    return tf.image.grayscale_to_rgb(tf.image.rgb_to_grayscale(image))


def _factor(level: float, sign: tf.Tensor) -> tf.Tensor:
    return 1.0 + sign * level * MAX_ENHANCE


def identity(image: tf.Tensor, level: float, sign: tf.Tensor) -> tf.Tensor:
    return image


def autocontrast(image: tf.Tensor, level: float, sign: tf.Tensor) -> tf.Tensor:
    """Each channel stretched to span [0, 255] (a flat channel is left alone)."""
    low = tf.reduce_min(image, axis=[0, 1])
    high = tf.reduce_max(image, axis=[0, 1])
    stretched = (image - low) * 255.0 / tf.maximum(high - low, 1e-3)
    return tf.where(high > low, stretched, image)


def _equalize_channel(channel: tf.Tensor) -> tf.Tensor:
    """PIL's ImageOps.equalize of one [height, width] channel."""
    pixels = tf.cast(tf.round(channel), tf.int32)
    histogram = tf.math.bincount(tf.reshape(pixels, [-1]), minlength=256, maxlength=256)
    last = tf.gather(histogram, tf.reduce_max(tf.where(histogram > 0)))
    step = (tf.reduce_sum(histogram) - last) // 255
    lookup = (tf.cumsum(histogram) + step // 2) // tf.maximum(step, 1)
    lookup = tf.clip_by_value(tf.concat([[0], lookup[:-1]], 0), 0, 255)
    equalized = tf.cast(tf.gather(lookup, pixels), tf.float32)
    return tf.where(step > 0, equalized, channel)


def equalize(image: tf.Tensor, level: float, sign: tf.Tensor) -> tf.Tensor:
    """Histogram equalisation per channel."""
    return tf.stack([_equalize_channel(image[..., c]) for c in range(3)], axis=-1)


def solarize(image: tf.Tensor, level: float, sign: tf.Tensor) -> tf.Tensor:
    """Pixels at or above a threshold (256 at magnitude 0, 0 at 10) inverted."""
    return tf.where(image >= 256.0 * (1.0 - level), 255.0 - image, image)


def posterize(image: tf.Tensor, level: float, sign: tf.Tensor) -> tf.Tensor:
    """The low bits dropped: 8 bits kept at magnitude 0, 4 at 10."""
    step = 2.0 ** int(level * 4)
    return tf.floor(tf.round(image) / step) * step


def brightness(image: tf.Tensor, level: float, sign: tf.Tensor) -> tf.Tensor:
    return _blend(image, tf.zeros_like(image), _factor(level, sign))


def contrast(image: tf.Tensor, level: float, sign: tf.Tensor) -> tf.Tensor:
    mean = tf.reduce_mean(tf.image.rgb_to_grayscale(image))
    return _blend(image, tf.fill(tf.shape(image), mean), _factor(level, sign))


def color(image: tf.Tensor, level: float, sign: tf.Tensor) -> tf.Tensor:
    return _blend(image, _grey(image), _factor(level, sign))


def sharpness(image: tf.Tensor, level: float, sign: tf.Tensor) -> tf.Tensor:
    """Blend with PIL's smoothing filter (the border pixels are kept, as PIL keeps them)."""
    kernel = tf.constant([[1.0, 1.0, 1.0], [1.0, 5.0, 1.0], [1.0, 1.0, 1.0]]) / 13.0
    kernel = tf.tile(kernel[:, :, None, None], [1, 1, 3, 1])
    smooth = tf.nn.depthwise_conv2d(image[None], kernel, [1, 1, 1, 1], "VALID")[0]
    smooth = tf.pad(smooth, [[1, 1], [1, 1], [0, 0]])
    height, width = tf.shape(image)[0], tf.shape(image)[1]
    interior = tf.pad(tf.ones([height - 2, width - 2, 1]), [[1, 1], [1, 1], [0, 0]]) > 0
    return _blend(image, tf.where(interior, smooth, image), _factor(level, sign))


def _translate(image: tf.Tensor, level: float, sign: tf.Tensor, axis: int) -> tf.Tensor:
    """Shifted along `axis` by up to MAX_TRANSLATE of the side, the uncovered part grey."""
    size = tf.shape(image)[axis]
    shift = tf.cast(sign * tf.round(level * MAX_TRANSLATE * tf.cast(size, tf.float32)), tf.int32)
    moved = tf.roll(image, shift, axis=axis)
    source = tf.range(size) - shift  # where each pixel came from
    valid = tf.logical_and(source >= 0, source < size)
    valid = tf.reshape(valid, [-1, 1, 1] if axis == 0 else [1, -1, 1])
    return tf.where(valid, moved, 128.0)


def translate_x(image: tf.Tensor, level: float, sign: tf.Tensor) -> tf.Tensor:
    return _translate(image, level, sign, axis=1)


def translate_y(image: tf.Tensor, level: float, sign: tf.Tensor) -> tf.Tensor:
    return _translate(image, level, sign, axis=0)


OPS = (
    identity,
    autocontrast,
    equalize,
    solarize,
    posterize,
    brightness,
    contrast,
    color,
    sharpness,
    translate_x,
    translate_y,
)


def rand_augment(image: tf.Tensor, key: tf.Tensor, num_ops: int, magnitude: float) -> tf.Tensor:
    """`num_ops` ops of `OPS`, each drawn uniformly, at `magnitude` (0 to 10), on a float32
    [height, width, 3] image in [0, 255]; the draws are keyed by `key` (seed, position)."""
    level = magnitude / 10.0

    def apply_one(i, image):
        op_key = tf.random.experimental.stateless_fold_in(key, 1000 + i)
        choice = tf.random.stateless_uniform([], op_key, 0, len(OPS), tf.int32)
        coin = tf.random.stateless_uniform([], op_key + 1)
        sign = tf.where(coin < 0.5, -1.0, 1.0)
        branches = [functools.partial(op, image, level, sign) for op in OPS]
        return i + 1, tf.ensure_shape(tf.switch_case(choice, branches), image.shape)

    # A loop rather than num_ops copies of the ops: tf.data traces and optimises one.
    _, image = tf.while_loop(lambda i, _: i < num_ops, apply_one, (tf.constant(0), image))
    return image


def _beta(key: tf.Tensor, alpha: float) -> tf.Tensor:
    gammas = tf.random.stateless_gamma([2], key, alpha)
    return tf.math.divide_no_nan(gammas[0], gammas[0] + gammas[1])


def pair_mix(
    position: tf.Tensor, seed: int, size: int, mixup_alpha: float, cutmix_alpha: float
) -> tf.Tensor:
    """The mixing of the pair holding stream `position`, as MIX_PARAMS floats: (lambda, y0, x0,
    y1, x1, cutmix); both examples of a pair compute the same values."""
    key = tf.stack([tf.cast(seed, tf.int64), position - position % 2])
    key = tf.random.experimental.stateless_fold_in(key, 2000)
    uniform = tf.random.stateless_uniform([3], key)
    if mixup_alpha and cutmix_alpha:
        cutmix = uniform[0] < 0.5
    else:
        cutmix = tf.constant(bool(cutmix_alpha))
    mix_lambda = _beta(key + 1, mixup_alpha) if mixup_alpha else tf.constant(1.0)
    cut_lambda = _beta(key + 2, cutmix_alpha) if cutmix_alpha else tf.constant(1.0)
    # The box: sides sqrt(1 - lambda) of the image's, centred at a uniform point, clipped.
    side = tf.sqrt(1.0 - cut_lambda) * size
    centre = uniform[1:] * size
    low = tf.round(tf.clip_by_value(centre - side / 2, 0.0, size))
    high = tf.round(tf.clip_by_value(centre + side / 2, 0.0, size))
    cut_lambda = 1.0 - tf.reduce_prod(high - low) / size**2  # what the clipped box swaps
    return tf.stack(
        [
            tf.where(cutmix, cut_lambda, mix_lambda),
            low[0],
            low[1],
            high[0],
            high[1],
            tf.cast(cutmix, tf.float32),
        ]
    )


def mix_batch(
    images: tf.Tensor, labels: tf.Tensor, mix: tf.Tensor, num_classes: int
) -> tuple[tf.Tensor, tf.Tensor]:
    """Mixes rows (0, 1), (2, 3), ... of a batch by `mix` (`pair_mix` of each row); returns the
    images and the labels as [batch, num_classes] float32 class probabilities."""
    batch, height, width, channels = images.shape
    pairs = tf.reshape(images, [batch // 2, 2, height, width, channels])
    first, second = pairs[:, 0], pairs[:, 1]
    targets = tf.reshape(tf.one_hot(labels, num_classes), [batch // 2, 2, num_classes])
    params = mix[0::2]
    mix_lambda = params[:, 0]
    y = tf.range(height, dtype=tf.float32)[None, :, None, None]
    x = tf.range(width, dtype=tf.float32)[None, None, :, None]

    def column(i):
        return params[:, i][:, None, None, None]

    box = tf.cast(
        (y >= column(1)) & (y < column(3)) & (x >= column(2)) & (x < column(4)), tf.float32
    )
    cutmix = column(5) > 0
    weight = mix_lambda[:, None, None, None]
    mixed_first = tf.where(
        cutmix, first * (1 - box) + second * box, weight * first + (1 - weight) * second
    )
    mixed_second = tf.where(
        cutmix, second * (1 - box) + first * box, weight * second + (1 - weight) * first
    )
    weight = mix_lambda[:, None]
    label_first = weight * targets[:, 0] + (1 - weight) * targets[:, 1]
    label_second = weight * targets[:, 1] + (1 - weight) * targets[:, 0]
    images = tf.reshape(tf.stack([mixed_first, mixed_second], 1), [batch, height, width, channels])
    labels = tf.reshape(tf.stack([label_first, label_second], 1), [batch, num_classes])
    return images, labels
