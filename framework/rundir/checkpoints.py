"""What a checkpoint directory really holds, found from its files rather than from its index.

TensorFlow finds checkpoints through the small `checkpoint` index file, and when that file is
missing, garbled or cannot be read it quietly reports "no checkpoint": a trainer then starts from
scratch and overwrites the old run. Here the data files are the truth. A checkpoint `ckpt-N` is
committed once its `ckpt-N.index` exists (TensorFlow writes it last, after the data files);
`restore_newest` tries the committed checkpoints from the newest down, skips the ones that fail
(TensorFlow checks every tensor's checksum as it restores it), says which it skipped and why, and
raises `CheckpointError` rather than start over when none can be restored. Every read goes through
`tf.io.gfile`, so a `gs://` directory works the same, with bounded retries on transient errors.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Callable

import tensorflow as tf

from framework.core import files, tf_internals
from framework.core.errors import FrameworkError

PREFIX = "ckpt"  # tf.train.CheckpointManager's default checkpoint_name
INDEX_FILE = "checkpoint"  # the index of the checkpoints TensorFlow keeps in the directory
_COMMITTED = re.compile(rf"^{PREFIX}-(\d+)\.index$")
_PARTIAL = re.compile(rf"^{PREFIX}-(\d+)\.data-\d+-of-\d+$")
_TEMPORARY = re.compile(rf"^{PREFIX}-\d+_temp/?$")  # where a sharded save writes before it commits


class CheckpointError(FrameworkError):
    """The directory holds checkpoints, but none can be restored: starting over would lose them."""


@dataclasses.dataclass(frozen=True)
class Listing:
    """The checkpoints of one directory: committed ones oldest first, and what else is there."""

    directory: str
    committed: list[str]  # checkpoint prefixes (`DIR/ckpt-N`), by step
    uncommitted: list[str]  # data files of saves that never wrote their .index
    temporary: list[str]  # `ckpt-N_temp` directories left by an interrupted save
    has_index: bool  # whether the `checkpoint` index file exists (readable or not)
    in_the_way: list[str] = dataclasses.field(default_factory=list)  # see `check_saves_fit`

    @property
    def uncommitted_steps(self) -> list[int]:
        """The steps of the saves whose data files are here without their .index file."""
        return sorted({int(_PARTIAL.match(name)[1]) for name in self.uncommitted})

    @property
    def empty(self) -> bool:
        """True when nothing here could be a checkpoint of an earlier run. The data of one save
        without its .index is what a run killed in its first save leaves; of several, a run
        whose .index files were lost."""
        return not self.committed and not self.has_index and len(self.uncommitted_steps) <= 1


def step_of(prefix: str) -> int:
    """The step number N of a checkpoint prefix `.../ckpt-N`."""
    return int(prefix.rsplit("-", 1)[1])


def reader(prefix: str) -> tf_internals.CheckpointReader:
    """A reader of the checkpoint at `prefix` itself. (`tf.train.load_checkpoint` takes a path
    that lists as a directory for that directory's newest checkpoint, and on `ram://` and some
    object stores a prefix lists as a directory of its files.)"""
    return tf.compat.v1.train.NewCheckpointReader(prefix)


def list_checkpoints(directory: str) -> Listing:
    """Lists `directory` (which may not exist yet) and sorts what a checkpoint save leaves there."""
    try:  # (not gfile.isdir: it answers False for any storage error, a flaky read included)
        names = files.with_retries(lambda: tf.io.gfile.listdir(directory), f"listing {directory}")
    except tf.errors.NotFoundError:
        return Listing(directory, [], [], [], has_index=False)
    in_the_way = [
        name.rstrip("/")
        for name in names
        if (name.rstrip("/") == INDEX_FILE or _COMMITTED.match(name.rstrip("/")))
        and _is_directory(directory, name)
    ]
    names = [name for name in names if name.rstrip("/") not in in_the_way]
    committed = {int(m[1]) for m in map(_COMMITTED.match, names) if m}
    partial = [name for name in names if (m := _PARTIAL.match(name)) and int(m[1]) not in committed]
    return Listing(
        directory,
        committed=[f"{directory.rstrip('/')}/{PREFIX}-{n}" for n in sorted(committed)],
        uncommitted=sorted(partial),
        temporary=sorted(name.rstrip("/") for name in names if _TEMPORARY.match(name)),
        has_index=INDEX_FILE in names,
        in_the_way=sorted(in_the_way),
    )


def _is_directory(directory: str, name: str) -> bool:
    """Whether the entry `name` that listing `directory` gave is a directory: object stores list
    one with a trailing "/", a local filesystem needs asking."""
    if name.endswith("/"):
        return True
    return files.is_local(directory) and tf.io.gfile.isdir(files.join(directory, name))


def check_saves_fit(listing: Listing) -> None:
    """Raises `CheckpointError` when directories sit where a save writes its files (the
    `checkpoint` index file, a `ckpt-N.index`): the run would train up to that save and fail
    there. Nothing is deleted: they may hold what someone put there."""
    if listing.in_the_way:
        paths = ", ".join(files.join(listing.directory, name) for name in listing.in_the_way)
        raise CheckpointError(
            f"{paths}: a directory where checkpoint saves write a file. Nothing was deleted: "
            "move it out of the checkpoint directory and run again."
        )


def committed_of_run(model_dir: str) -> list[str] | None:
    """The committed checkpoints of the run in `model_dir` (its `checkpoints/`), or None when its
    storage is out of reach: for checks before a run starts, which leave that case to the run."""
    try:
        return list_checkpoints(files.join(model_dir, "checkpoints")).committed
    except tf.errors.OpError:
        return None


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def restore_newest(listing: Listing, restore: Callable[[str], None]) -> str | None:
    """Restores the newest committed checkpoint that `restore(prefix)` accepts; returns its prefix.

    `restore` raises when a checkpoint is unusable (a checksum or shape mismatch, a truncated file,
    non-finite values): the next older one is tried, and each skipped one is logged with its
    reason. Returns None only when the directory holds no checkpoint at all; raises
    `CheckpointError` when it holds checkpoints none of which can be restored.
    """
    for name in listing.uncommitted if listing.committed or listing.empty else ():
        logging.warning(
            "ignoring %s/%s: its save never completed (no .index file)", listing.directory, name
        )
    if listing.empty:
        return None
    skipped = []
    for prefix in reversed(listing.committed):
        try:
            files.with_retries(lambda prefix=prefix: restore(prefix), f"restoring {prefix}")
        except Exception as error:  # noqa: BLE001 (TF raises many types for a bad file)
            skipped.append(f"{prefix}: {_first_line(error)}")
            logging.warning("skipping checkpoint %s", skipped[-1])
            continue
        if skipped:
            logging.warning("restored the older checkpoint %s instead", prefix)
        return prefix
    if skipped:
        found = "; ".join(skipped)
    elif listing.has_index:
        found = f"its {INDEX_FILE} index file names checkpoints but no ckpt-N.index file is there"
    else:
        steps = ", ".join(f"{PREFIX}-{n}" for n in listing.uncommitted_steps)
        found = f"the data files of {steps} without their .index files"
    raise CheckpointError(
        f"{listing.directory} holds a run that cannot be restored ({found}). Nothing was deleted. "
        "If this run's settings differ from those that wrote them (another model, size or "
        "optimizer: config.gin beside them holds the run's), run with those; otherwise copy back "
        "the missing or damaged files, or move the checkpoints away (or use another "
        "--model_dir) to start a new run."
    )


def repair_index(listing: Listing, newest: str) -> bool:
    """Points the index file at `newest` (and the committed checkpoints before it) unless it
    already does; returns whether it was rewritten.

    TensorFlow's CheckpointManager and `tf.train.latest_checkpoint` know checkpoints from this
    file only. Paths are written relative, as the manager writes them, so a copied run stays
    readable; the file is replaced in one rename.
    """
    try:
        state = tf.train.get_checkpoint_state(listing.directory)
    except ValueError:  # an empty index file
        state = None
    if state is not None and _name(state.model_checkpoint_path) == _name(newest):
        return False
    kept = [prefix for prefix in listing.committed if step_of(prefix) <= step_of(newest)]
    lines = [f"model_checkpoint_path: {json.dumps(_name(newest))}"]
    lines += [f"all_model_checkpoint_paths: {json.dumps(_name(prefix))}" for prefix in kept]
    # With their times the manager rotates these as its own; without, it keeps them forever.
    lines += [
        f"all_model_checkpoint_timestamps: {files.modified_time(prefix + '.index')}"
        for prefix in kept
    ]
    files.write_bytes(files.join(listing.directory, INDEX_FILE), "\n".join(lines) + "\n")
    return True


def _name(prefix: str) -> str:
    return prefix.rstrip("/").rsplit("/", 1)[-1]


def remove_temporary(listing: Listing) -> list[str]:
    """Removes the `ckpt-N_temp` directories that interrupted saves left; returns their paths.
    Only call this while holding the directory's lock: a running save writes there."""
    removed = []
    for name in listing.temporary:
        path = f"{listing.directory.rstrip('/')}/{name}"
        tf.io.gfile.rmtree(path)
        removed.append(path)
    return removed
