"""The remat cost model: what keeping a value costs in bytes and what recomputing it costs in
FLOPs, per op. The memory budget ranks values by the ratio of the two.

A FLOP here is one of a matrix unit's. Vector work is slower per operation than that on every
backend, so work that is not a product is priced in matrix-unit FLOPs: a random op's draw (Philox
rounds and a conversion, some 50-100 vector operations per value) takes as long on XLA:CPU as
about 1000 FLOPs of a matrix product (11 ns per value against 108 GFLOP/s measured on one machine),
and matrix units outrun vector units by 10-30x on GPUs and TPUs too. A value computed from random
bits costs its draw's share (`OpInfo.random_flops`): a mask compared from a full-size draw about
1000 FLOPs, one hashed from a few random key words (`framework.models.Dropout`) a few dozen. Other
ops count one FLOP per value: XLA fuses them into the op that reads them, so recomputing them
costs about what reading them would.
"""

from __future__ import annotations

import math

import tensorflow as tf

from framework.remat.op_info import RANDOM_FLOPS_PER_VALUE, OpInfo

__all__ = [
    "ELEMENTWISE_FLOPS_PER_VALUE",
    "LAYOUT_OPS",
    "MASK_BITS",
    "RANDOM_FLOPS_PER_VALUE",
    "kept_bytes",
    "recompute_flops",
]

ELEMENTWISE_FLOPS_PER_VALUE = 1

# Ops that compute nothing (a new view of their input): keeping their output saves no work.
LAYOUT_OPS = frozenset({"Reshape", "ExpandDims", "Squeeze", "Identity", "StopGradient"})

# Bits a kept boolean value (a dropout mask) takes in each compiler's plan: remat packs kept masks
# into 32-bit words, which XLA:CPU and XLA:GPU store as they are; libtpu undoes the packing and
# stores a `pred` per value (ViT-B/16 at batch 64 with `random_masks_saveable`: 1.3 GiB over full
# remat on TPU v5e, 0.04 GiB on a P100).
MASK_BITS = {"CPU": 1, "GPU": 1, "TPU": 8}


def _elements(shape: tuple[int | None, ...]) -> int:
    """Values in `shape`, an unknown dimension counted as 1 (a region whose inputs' shapes are
    not all known is priced from a trace at static shapes instead: `backward.trace_forward`)."""
    return math.prod(1 if d is None else d for d in shape)


def _known(*sizes: int | None) -> int:
    """The first of `sizes` that is known, else 1."""
    return next((size for size in sizes if size is not None), 1)


def kept_bytes(op: OpInfo, mask_bits: int = 1) -> int:
    """What keeping `op`'s outputs costs: their bytes, a boolean as `mask_bits` bits (packed:
    1; see `MASK_BITS`)."""
    total = 0
    for shape, dtype in zip(op.shapes, op.dtypes, strict=False):
        values = _elements(shape)
        total += -(-values * mask_bits // 8) if dtype == tf.bool else values * dtype.size
    return total


def _contracted(op: OpInfo) -> int:
    """The size of the dimensions a product sums over (1 when the shapes do not say)."""
    a = op.input_shapes[0] if op.input_shapes else ()
    b = op.input_shapes[1] if len(op.input_shapes) > 1 else ()
    if op.op_type == "MatMul" and len(a) == 2:
        a_side = 0 if _flag(op, "transpose_a") else 1
        b_side = 1 if _flag(op, "transpose_b") else 0
        return _known(a[a_side], b[b_side] if len(b) == 2 else None)
    if op.op_type.startswith("BatchMatMul") and len(a) >= 2:
        a_side = -2 if _flag(op, "adj_x") else -1
        b_side = -1 if _flag(op, "adj_y") else -2
        return _known(a[a_side], b[b_side] if len(b) >= 2 else None)
    labels = op.einsum_labels()
    if labels is not None and "." not in "".join(labels[0]):
        operands, out = labels
        sizes: dict[str, int] = {}
        for letters, shape in zip(operands, op.input_shapes, strict=False):
            for label, size in zip(letters, shape, strict=False):
                if size is not None:
                    sizes[label] = size
        return math.prod(sizes.get(label, 1) for label in set("".join(operands)) - set(out))
    if op.op_type.startswith("Conv") and len(op.input_shapes) > 1:
        kernel = op.input_shapes[1]  # [spatial..., in, out]
        return math.prod(kernel[:-1]) if all(kernel[:-1]) else 1
    return 1


def _flag(op: OpInfo, key: str) -> bool:
    value = op.attr(key)
    return value is not None and value.b


def recompute_flops(op: OpInfo) -> int:
    """What recomputing `op` costs, roughly: 2 x values x contracted size for a matrix product or
    convolution (exact), a random mask's draw (`OpInfo.random_flops`), one FLOP per value
    otherwise; nothing for a layout op, and nothing for integer outputs (shapes and indices:
    cheap, and a kept shape would hide its static value from the recomputation)."""
    if op.op_type in LAYOUT_OPS or not all(d.is_floating or d == tf.bool for d in op.dtypes):
        return 0
    values = sum(_elements(shape) for shape in op.shapes)
    if op.is_product:
        return 2 * values * _contracted(op)
    if op.is_random_mask:
        return round(op.random_flops * values)
    return ELEMENTWISE_FLOPS_PER_VALUE * values
