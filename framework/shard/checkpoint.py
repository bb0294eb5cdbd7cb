"""Checkpoints of sharded state that do not depend on how it was sharded.

A checkpoint is written through a view of the objects it saves (`checkpoint_view`): the same
object graph, with each sharded variable replaced by a `WholeValue`, which saves the variable's
whole value gathered from its shards and restores by giving each replica its part. The keys and
shapes are then those of an unsharded run's checkpoint: it restores into any replica count, into
an unsharded run and back, and tools that read checkpoints (warm start, export, sampling) never
see a shard.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import tensorflow as tf

# The attribute under which a variable's value is saved (TensorFlow's and Keras' name).
VARIABLE_VALUE = "VARIABLE_VALUE"

Trackable = tf.__internal__.tracking.Trackable


class WholeValue(Trackable):
    """A checkpoint's stand-in for a sharded variable: saves `read()`, restores with
    `write(value)`."""

    def __init__(self, read: Callable[[], tf.Tensor], write: Callable[[tf.Tensor], None]):
        self.read = read
        self.write = write

    def _serialize_to_tensors(self):
        return {VARIABLE_VALUE: self.read()}

    def _restore_from_tensors(self, restored_tensors):
        self.write(restored_tensors[VARIABLE_VALUE])


class _View(Trackable):
    """An object of the saved graph, its children seen through the same view."""

    def __init__(self, original: Trackable, view: Callable[[Trackable], Trackable]):
        self._original = original
        self._view = view

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        children = self._original._trackable_children(save_type, **kwargs)
        return {name: self._view(child) for name, child in children.items()}


def _saves_values(obj: Trackable) -> bool:
    """Whether `obj` writes values of its own into a checkpoint (a variable does)."""
    return type(obj)._serialize_to_tensors is not Trackable._serialize_to_tensors


def checkpoint_view(root: Trackable, replaced: Mapping[int, Trackable]) -> Trackable:
    """`root` as a checkpoint should see it: every object reached from it whose `id` is a key of
    `replaced` is that key's value instead; each other object is itself when it saves values
    (a variable), else a view of it. One object reached twice is one object in the view.
    Nothing replaced: `root` itself."""
    if not replaced:
        return root
    views: dict[int, Trackable] = {}

    def view(obj: Trackable) -> Trackable:
        if id(obj) in replaced:
            return replaced[id(obj)]
        if _saves_values(obj):
            if obj._trackable_children():
                raise TypeError(
                    f"{type(obj).__name__} saves values and has children: a checkpoint view "
                    "cannot stand in for it"
                )
            return obj
        if id(obj) not in views:
            views[id(obj)] = _View(obj, view)
        return views[id(obj)]

    return view(root)
