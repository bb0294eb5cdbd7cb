"""Warm start: a model's weights from another run's checkpoint (not its optimizer, not its step).

Fine-tuning starts from a pretrained run with a new head: the weights whose shapes match are
taken, the ones whose shapes differ (a classifier for another number of classes) keep their fresh
initialisation and are listed, and a weight the checkpoint lacks is an error that names it, as is
a checkpoint that would leave most of the model re-initialised (it is of another model).

TensorFlow restores a checkpoint whole or fails on the first shape it cannot take. So the model's
own variables are first written to a scratch checkpoint on the local disk to learn their keys and
shapes. Each is found in the source by following its path of objects in the source's object graph
(a key alone would not do: a checkpoint names a variable by its shortest path from the root, which
in a trainer's checkpoint runs through the optimizer). A merged checkpoint is written beside the
scratch one with the source's value wherever the shape matches and the fresh value elsewhere,
under the model's own object graph, and the model restores it, which checks that every variable
is matched. (TensorFlow's `ram://` filesystem would spare the disk, but it takes a checkpoint's
prefix for a directory.)

A published ViT weights file (`.npz`, `.safetensors`) is read by `framework.models.weights`
instead, under the same rules: a new head is re-initialised and listed, anything else missing
or of another shape is an error.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import shutil
import tempfile

import keras
import numpy as np
import tensorflow as tf

from framework.core import files, tf_internals
from framework.core.errors import FrameworkError
from framework.models import weights
from framework.rundir import checkpoints

# The checkpoint key TensorFlow stores the object graph under (it maps objects to keys).
OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
# Warm starting that re-initialises more than this fraction of the parameters is refused.
MOST_OF_THE_MODEL = 0.5


class WarmStartError(FrameworkError, ValueError):
    """The checkpoint cannot initialise this model: what is missing or why, in one message."""


@dataclasses.dataclass(frozen=True)
class WarmStart:
    """What `warm_start` did: the checkpoint read, the keys taken and those re-initialised
    (each with the checkpoint's shape and the model's)."""

    source: str
    taken: tuple[str, ...]
    reinitialized: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]


def resolve(source: str) -> str:
    """A checkpoint prefix from `source`: a prefix (`.../ckpt-100`), or a run's model_dir or
    checkpoints directory, whose newest committed checkpoint is taken."""
    if tf.io.gfile.exists(source + ".index"):
        return source
    for directory in (files.join(source, "checkpoints"), source):
        if tf.io.gfile.isdir(directory):
            committed = checkpoints.list_checkpoints(directory).committed
            if committed:
                return committed[-1]
    raise WarmStartError(
        f"init_checkpoint {source!r} is neither a checkpoint (PREFIX.index) nor a directory "
        "holding one (a run's model_dir or its checkpoints/)"
    )


def _model_keys(path: str) -> dict[str, tuple[int, ...]]:
    """The variable keys under `model/` of a checkpoint written as `Checkpoint(model=...)`,
    with their shapes."""
    return {
        name: tuple(shape)
        for name, shape in tf.train.list_variables(path)
        if name.startswith("model/") and name != OBJECT_GRAPH_KEY
    }


def _unescape(part: str) -> str:
    """A key's path component as the object's name (TensorFlow writes "/" as ".S", "." as "..")."""
    out, i = [], 0
    while i < len(part):
        if part[i] == "." and i + 1 < len(part):
            out.append("/" if part[i + 1] == "S" else part[i + 1])
            i += 2
        else:
            out.append(part[i])
            i += 1
    return "".join(out)


def _keys_in(reader, own_keys: list[str]) -> dict[str, str]:
    """Where each of the model's variables (by its key in a `Checkpoint(model=...)`) is in the
    checkpoint `reader` reads. A checkpoint stores a variable once, under its shortest path
    from the root (the trainer's go through the optimizer's list of variables), so the path of
    objects is followed in the checkpoint's object graph instead of comparing keys."""
    graph = tf_internals.trackable_object_graph_pb2.TrackableObjectGraph()
    graph.ParseFromString(reader.get_tensor(OBJECT_GRAPH_KEY))
    found = {}
    for key in own_keys:
        node = graph.nodes[0]
        for name in key.split("/.ATTRIBUTES/")[0].split("/"):
            child = next((c for c in node.children if c.local_name == _unescape(name)), None)
            if child is None:
                break
            node = graph.nodes[child.node_id]
        else:
            for attribute in node.attributes:
                if attribute.name == "VARIABLE_VALUE":
                    found[key] = attribute.checkpoint_key
    return found


def warm_start(model: keras.Model, source: str) -> WarmStart | weights.Imported:
    """Initialises `model`'s weights from the checkpoint `source` (see the module docstring).

    The checkpoint must have been written as `tf.train.Checkpoint(model=...)` (the trainer's
    are), of the same model class: keys are the paths of the weights in the model. A `.npz` or
    `.safetensors` file holds published ViT weights instead (`weights.load_weights`).
    """
    if weights.is_weights_file(source):
        try:
            imported = weights.load_weights(model, source)
        except weights.WeightsError as error:
            raise WarmStartError(f"init_checkpoint: {error}") from None
        logging.info("warm start from %s", imported.summary())
        return imported
    source = resolve(source)
    scratch_dir = tempfile.mkdtemp(prefix="warm_start-")
    try:
        return _warm_start(model, source, os.path.join(scratch_dir, "ckpt"))
    finally:
        shutil.rmtree(scratch_dir, ignore_errors=True)


def _warm_start(model: keras.Model, source: str, scratch: str) -> WarmStart:
    own = tf.train.Checkpoint(model=model).write(scratch)
    ours = _model_keys(own)
    reader, own_reader = checkpoints.reader(source), checkpoints.reader(own)
    where = _keys_in(reader, list(ours))
    shapes = reader.get_variable_to_shape_map()
    theirs = {key: tuple(shapes[where[key]]) for key in ours if key in where}
    missing = sorted(set(ours) - set(theirs))
    if missing:
        shown = ", ".join(_short(name) for name in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise WarmStartError(
            f"init_checkpoint {source} lacks {len(missing)} of the model's weights "
            f"({shown}{more}): is it a checkpoint of the same model?"
        )
    differ = [(k, theirs[k], ours[k]) for k in sorted(ours) if theirs[k] != ours[k]]
    fresh = sum(math.prod(shape) for _, _, shape in differ)
    if fresh > MOST_OF_THE_MODEL * sum(math.prod(shape) for shape in ours.values()):
        raise WarmStartError(
            f"init_checkpoint {source}: {len(differ)} weights ({fresh:,} values) differ in shape, "
            f"more than half the model (e.g. {_short(differ[0][0])}: {differ[0][1]} in the "
            f"checkpoint, {differ[0][2]} here): is it a checkpoint of this model size?"
        )
    names = [name for name, _ in tf.train.list_variables(own)]  # the object graph too
    values = [
        reader.get_tensor(where[name])
        if name in ours and theirs[name] == ours[name]
        else own_reader.get_tensor(name)
        for name in names
    ]
    merged = scratch + "-merged"
    tf.raw_ops.SaveV2(
        prefix=merged,
        tensor_names=names,
        shape_and_slices=[""] * len(names),
        tensors=[tf.constant(np.asarray(v)) for v in values],
    )
    tf.train.Checkpoint(model=model).read(merged).assert_existing_objects_matched()
    result = WarmStart(source, tuple(k for k in ours if theirs[k] == ours[k]), tuple(differ))
    logging.info(
        "warm start from %s: %d weights taken, %d re-initialised%s",
        source,
        len(result.taken),
        len(differ),
        "".join(f"\n  {_short(k)}: {a} in the checkpoint, {b} here" for k, a, b in differ),
    )
    return result


def _short(key: str) -> str:
    """`model/blocks/0/kernel/.ATTRIBUTES/VARIABLE_VALUE` as `blocks/0/kernel`."""
    return key.removeprefix("model/").removesuffix("/.ATTRIBUTES/VARIABLE_VALUE")
