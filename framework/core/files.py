"""The small files of a run directory, read and written through `tf.io.gfile`.

TPU pods need their model_dir on Cloud Storage, so nothing that reads or writes a run directory
may use `open`, `os` or `pathlib`: those would create `./gs:/BUCKET/...` in the working directory.
These helpers go through `tf.io.gfile`, which serves local paths, `gs://` and TensorFlow's other
filesystems (`ram://` in the tests) the same way; `with_retries` repeats a read that failed
on a transient storage error, so a flaky bucket is not taken for a missing file. `list_files`
expands the file names and globs a data source is given, for its errors to name the setting.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TypeVar

import tensorflow as tf

TRANSIENT_ERRORS = (
    tf.errors.UnavailableError,
    tf.errors.DeadlineExceededError,
    tf.errors.AbortedError,
)
RETRIES = 4
FIRST_RETRY_SECONDS = 1.0

T = TypeVar("T")


def is_local(path: str) -> bool:
    """Whether `path` is on this host's filesystem (no URL scheme, or file://)."""
    return "://" not in path or path.startswith("file://")


def join(directory: str, name: str) -> str:
    """`directory/name` for a local path or a URL alike."""
    return f"{directory.rstrip('/')}/{name}"


def read_bytes(path: str) -> bytes:
    with tf.io.gfile.GFile(path, "rb") as file:
        return file.read()


def read_text(path: str) -> str:
    """The UTF-8 text of `path`; a file that is not UTF-8 (another encoding, a flipped bit) is a
    ValueError that names it."""
    data = read_bytes(path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{path} is not UTF-8 text (byte {data[error.start]:#04x} at offset {error.start})"
        ) from None


def write_bytes(path: str, data: bytes | str) -> None:
    """Writes `path` whole: to a temporary name beside it, then renamed over it, so a reader
    never sees half a file (on object stores, where a rename is a copy, the object appears
    whole anyway); a write that fails leaves `path` as it was and no temporary file."""
    temporary = f"{path}.tmp-{uuid.uuid4().hex}"
    try:
        with tf.io.gfile.GFile(temporary, "wb") as file:
            file.write(data.encode() if isinstance(data, str) else data)
        tf.io.gfile.rename(temporary, path, overwrite=True)
    except BaseException:  # a full disk, say: leave nothing half-written behind
        if tf.io.gfile.exists(temporary):
            tf.io.gfile.remove(temporary)
        raise


def modified_time(path: str) -> float:
    """Seconds since the epoch of the last change of `path`."""
    return tf.io.gfile.stat(path).mtime_nsec / 1e9


def remove_if_unused(directory: str, leftovers: Sequence[str] = ()) -> bool:
    """Removes `directory` when it holds nothing but files named in `leftovers` (a run's lock
    file, say); returns whether it did. For a directory a run created and then refused to use:
    anything else in it stays, so nothing a run wrote is ever deleted."""
    if not tf.io.gfile.isdir(directory):
        return False
    names = tf.io.gfile.listdir(directory)
    if any(name.rstrip("/") not in leftovers for name in names):
        return False
    for name in names:
        tf.io.gfile.remove(join(directory, name))
    tf.io.gfile.rmtree(directory)  # empty now: this removes the directory alone
    return True


def check_writable(directory: str) -> None:
    """Creates `directory` and writes and removes a real file in it; raises what the storage
    raises (tf.errors.OpError for a bucket out of reach, PermissionDeniedError, ...)."""
    tf.io.gfile.makedirs(directory)
    probe = join(directory, f".write_test-{uuid.uuid4().hex}")
    with tf.io.gfile.GFile(probe, "w") as file:
        file.write("probe")
    tf.io.gfile.remove(probe)


def with_retries(read: Callable[[], T], what: str) -> T:
    """`read()`, retried with exponential back-off on transient storage errors (a flaky `gs://`
    read must not look like a missing file); other errors and the last failure propagate."""
    for attempt in range(RETRIES):
        try:
            return read()
        except TRANSIENT_ERRORS as error:
            if attempt == RETRIES - 1:
                raise
            wait = FIRST_RETRY_SECONDS * 2**attempt
            logging.warning("%s failed (%s); retrying in %.0f s", what, error.message, wait)
            time.sleep(wait)
    raise AssertionError("unreachable")


def list_files(patterns: str | Sequence[str], setting: str) -> list[str]:
    """The sorted files matching `patterns` (file names or globs, local or gs://), for the
    setting named `setting` in errors. Directories a pattern matches are left out (they would
    fail later, inside tf.data, as "Is a directory"); a pattern matching no file is a ValueError.
    """
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    if not patterns:
        raise ValueError(f"{setting} is empty: give one or more file names or glob patterns")
    found = set()
    for pattern in patterns:
        matches = tf.io.gfile.glob(pattern)
        if not matches:
            raise ValueError(f"{setting}: {pattern!r} not found (no file matches it)")
        # Cloud Storage has no directories, only names: a match ending in '/' stands for one.
        kept = [
            path
            for path in matches
            if not path.endswith("/") and not (is_local(path) and tf.io.gfile.isdir(path))
        ]
        if not kept:
            raise ValueError(
                f"{setting}: {pattern!r} is a directory, not a file: name the files in it, "
                f"e.g. '{pattern.rstrip('/')}/*'"
            )
        found.update(kept)
    return sorted(found)
