"""Where each training batch begins in a stream that a step number cannot address.

An image stream is addressed by its step: global step `s` holds examples `[s * G, (s + 1) * G)`
of a computed order, so a resumed run starts there without reading anything. A language-model
stream cannot be: its rows are packed from documents of every length, so which document step
`s` starts in is known only by reading the stream up to it. Its pipeline therefore writes down
where each batch it makes begins (a few integers: `WIDTH` at most, the source's own meaning),
the trainer keeps the one of the step it saves, and the resumed pipeline seeks there.

tf.data could checkpoint an iterator itself, but not the iterators `tf.distribute` makes (its
multi-device prefetching keeps no state it can save), and the pipeline runs ahead of the step
(prefetching), so its iterator is never at the step being saved. Hence a log of positions per
step: `record` in the pipeline, `of_step` in the trainer.

The log is a variable on this process's CPU, so it serves pipelines that run in the trainer's
process: one device, a multi-GPU host, each worker of a multi-worker run, a single-host TPU VM
(whose client runs the pipeline; tested here on CPUs only). A TPU pod's client builds pipelines
that run on other hosts; those resume by reading.
"""

from __future__ import annotations

import time

import numpy as np
import tensorflow as tf

WIDTH = 6  # int64 words of one position
_UNKNOWN = -1


class StreamPositions:
    """The position of each step's batch in this process's training stream, and the positions
    the run was restored with.

    `saved`: [pipelines, 1 + WIDTH] int64, one row per input pipeline: the step and its
    position, as the checkpoint holds them (None: a fresh start, or none saved).
    """

    def __init__(self, saved: np.ndarray | None = None, slots: int = 4096):
        self.saved = saved
        self._slots = slots
        with tf.init_scope(), tf.device("CPU:0"):
            self._log = tf.Variable(
                tf.fill([slots, 1 + WIDTH], tf.constant(_UNKNOWN, tf.int64)),
                trainable=False,
                name="stream_positions",
            )

    def saved_position(self, pipeline: int, pipelines: int, step: int) -> np.ndarray | None:
        """Pipeline `pipeline`'s saved position of `step`, if the checkpoint holds one for this
        many pipelines at this step."""
        if self.saved is None or len(self.saved) != pipelines:
            return None
        row = self.saved[pipeline]
        return row[1:] if row[0] == step else None

    def record(self, step: tf.Tensor, position: tf.Tensor) -> tf.Tensor:
        """Notes, in a tf.data function, that batch `step` begins at `position` (int64, at most
        WIDTH words); returns `step` once noted."""
        position = tf.cast(position, tf.int64)
        padding = tf.fill([WIDTH - tf.size(position)], tf.constant(_UNKNOWN, tf.int64))
        row = tf.concat([[tf.cast(step, tf.int64)], position, padding], 0)
        update = self._log.scatter_nd_update([[step % self._slots]], row[None])
        with tf.control_dependencies([update]):
            return tf.identity(step)

    def of_step(self, step: int, wait_seconds: float = 10.0) -> np.ndarray:
        """[1 + WIDTH]: `step` and where its batch begins; the position is all -1 when the
        pipeline has not made that batch within `wait_seconds` (it prefetches ahead of the
        step, so it normally has) or records none."""
        deadline = time.monotonic() + wait_seconds
        row = self._log[step % self._slots].numpy()
        while row[0] != step and self.recorded_any() and time.monotonic() < deadline:
            time.sleep(0.05)
            row = self._log[step % self._slots].numpy()
        if row[0] != step:
            row = np.full([1 + WIDTH], _UNKNOWN, np.int64)
        row[0] = step
        return row

    def recorded_any(self) -> bool:
        """Whether the pipeline has recorded a position (a source that records none never does)."""
        return bool((self._log[:, 0].numpy() != _UNKNOWN).any())
