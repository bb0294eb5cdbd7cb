"""The structure of a region's arguments and results: which leaves are tensors, which tensors
carry a Keras mask, and the key under which an eager call's traced function is reused.

A region runs as a function of tensors alone; everything else (Python values, the nesting, Keras
masks, which ride on tensors as attributes that a function's inputs and outputs do not carry) is
taken apart here and put back around the call - and a mask the call takes off an input is taken
off the caller's tensor too.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from framework.core import tf_internals


def is_tensor(x: Any) -> bool:
    return isinstance(x, tf.Tensor)


def keras_mask(t: Any) -> tf.Tensor | None:
    """The Keras mask `t` carries, if any."""
    mask = tf_internals.keras_mask(t)
    return mask if is_tensor(mask) else None


class CallStructure:
    """A nested structure taken apart: its tensors (then the masks some of them carry) as a flat
    list, and `pack` to build the structure again from such a list."""

    def __init__(self, structure: Any, expand_composites: bool = True):
        self.structure = structure
        self.expand_composites = expand_composites
        self.flat = tf.nest.flatten(structure, expand_composites=expand_composites)
        self.positions = [i for i, x in enumerate(self.flat) if is_tensor(x)]
        self.masked = [
            k for k, i in enumerate(self.positions) if keras_mask(self.flat[i]) is not None
        ]

    def tensors(self) -> list[tf.Tensor]:
        """The structure's tensors, then the masks of those that carry one."""
        tensors = [self.flat[i] for i in self.positions]
        return tensors + [keras_mask(tensors[k]) for k in self.masked]

    def pack(self, tensors: list[tf.Tensor]) -> Any:
        """The structure with `tensors` (as `tensors()` lists them) in place of its own, each
        carrying its mask again."""
        flat = list(self.flat)
        for i, t in zip(self.positions, tensors):
            flat[i] = t
        n = len(self.positions)
        for k, mask in zip(self.masked, tensors[n:], strict=True):
            tf_internals.set_keras_mask(flat[self.positions[k]], mask)
        return tf.nest.pack_sequence_as(
            self.structure, flat, expand_composites=self.expand_composites
        )

    def masks_cleared(self, tensors: list[tf.Tensor]) -> list[int]:
        """Which of `tensors` (as `pack` was given them) carried a mask when packed and carry
        none now: a call may take the masks off its inputs (Keras' `MultiHeadAttention` does,
        so that the layers after it see none)."""
        return [k for k in self.masked if keras_mask(tensors[k]) is None]

    def clear_masks(self, cleared: list[int]) -> None:
        """Takes the masks off this structure's own tensors that a call on stand-ins for them
        (a traced function's inputs) took off the stand-ins (`masks_cleared`)."""
        for k in cleared:
            tf_internals.set_keras_mask(self.flat[self.positions[k]], None)

    def eager_key(self, state: tf_internals.KerasCallState) -> tuple | None:
        """A hashable key for an eager call with these arguments: their structure, tensor shapes
        and dtypes (and Keras masks), the other values as they are, the Keras call state (None
        when one of them cannot be hashed: such calls are traced every time)."""

        def leaf(x):
            if is_tensor(x):
                mask = keras_mask(x)
                return (tuple(x.shape), x.dtype, None if mask is None else tuple(mask.shape))
            if isinstance(x, tf.Variable):
                return (type(x), x.ref())
            return (type(x), x)

        structure = repr(tf.nest.map_structure(lambda _: None, self.structure))
        key = (structure, tuple(leaf(x) for x in self.flat), state)
        try:
            hash(key)
        except TypeError:
            return None
        return key
