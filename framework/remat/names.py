"""`checkpoint_name`: tags a value for the policies that select values by name."""

from __future__ import annotations

import contextlib
from typing import TypeVar

import tensorflow as tf

from framework.core import tf_internals
from framework.remat.op_callbacks import tagging
from framework.remat.thread_state import ThreadSetting

T = TypeVar("T")
TAG_ATTR = "_remat_checkpoint_name"  # on the tagged identity, for `saved_residuals`' report
_tagging_off = ThreadSetting(False)


def without_checkpoint_names() -> contextlib.AbstractContextManager:
    """In this thread, `checkpoint_name` is a plain `tf.identity` that tags nothing.

    For graphs no policy will ever read, such as a model's serving function in a SavedModel
    (`framework.export`): they then carry no attribute of the remat library.
    """
    return _tagging_off.set(True)


def checkpoint_name(x: T, name: str) -> T:
    """Identity that tags `x` (a tensor or nested structure of tensors) for name-based policies.

    Outside a checkpointed region it is a plain `tf.identity`.
    """
    if _tagging_off.value:
        return tf.nest.map_structure(tf.identity, x)

    def tag(t):
        with tagging(name):
            out = tf.identity(t)
        if not tf_internals.executing_eagerly():
            tf_internals.set_string_attr(out.op, TAG_ATTR, name)
        return out

    return tf.nest.map_structure(tag, x)
