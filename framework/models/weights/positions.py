"""Position embeddings for another image size: the grid part resized as an image, the class
token's row kept."""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from framework.models.weights.files import WeightsError

INTERPOLATIONS = ("bilinear", "bicubic")


def grid_side(tokens: int) -> int:
    """The side of the square patch grid of `tokens` position embeddings, with or without a
    class token's first."""
    for grid_tokens in (tokens, tokens - 1):
        if grid_tokens > 0 and math.isqrt(grid_tokens) ** 2 == grid_tokens:
            return math.isqrt(grid_tokens)
    raise WeightsError(
        f"position embeddings for {tokens} tokens are neither a square grid nor a class token "
        "and a square grid"
    )


def resize_positions(
    positions: np.ndarray, grid: int, interpolation: str = "bilinear"
) -> np.ndarray:
    """Position embeddings [1, 1 + g * g, dim] for a `grid` x `grid` patch grid.

    `positions` is [1, 1 + g0 * g0, dim] (the class token's first) or [1, g0 * g0, dim] (none
    for the class token, as big_vision's: it gets zeros, which is the same model). The grid part
    is resized as an image (half-pixel centres, as PyTorch's `align_corners=False`), the class
    token's row kept; an equal grid is returned unchanged.
    """
    if interpolation not in INTERPOLATIONS:
        raise WeightsError(f"interpolation must be one of {INTERPOLATIONS}, got {interpolation!r}")
    if positions.ndim != 3 or positions.shape[0] != 1:
        raise WeightsError(f"position embeddings must be [1, tokens, dim], got {positions.shape}")
    tokens, dim = positions.shape[1:]
    side = grid_side(tokens)
    if tokens == side**2:
        positions = np.concatenate([np.zeros((1, 1, dim), positions.dtype), positions], axis=1)
    if side == grid:
        return positions
    table = positions[:, 1:].reshape(1, side, side, dim).astype(np.float32)
    resized = tf.image.resize(table, (grid, grid), method=interpolation, antialias=False)
    resized = tf.reshape(resized, (1, grid * grid, dim)).numpy().astype(positions.dtype)
    return np.concatenate([positions[:, :1], resized], axis=1)
