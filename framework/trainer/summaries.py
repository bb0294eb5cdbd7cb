"""A run's TensorBoard summaries: scalars and text under `model_dir/train` and `model_dir/eval`.

Only the chief writes (another worker, or a run without a model_dir, gets writers that drop
everything), and each call flushes, so TensorBoard shows a loop's metrics as soon as it ends.
"""

from __future__ import annotations

import os

import tensorflow as tf

SPLITS = ("train", "eval")


class Summaries:
    """The `train` and `eval` summary writers of a run in `model_dir` (None: write nothing)."""

    def __init__(self, model_dir: str | None):
        self._writers = {
            split: tf.summary.create_file_writer(os.path.join(model_dir, split))
            if model_dir is not None
            else tf.summary.create_noop_writer()
            for split in SPLITS
        }

    def scalars(self, split: str, step: int, metrics: dict[str, float]) -> None:
        """Each of `metrics` as a scalar of `split` at `step`."""
        with self._writers[split].as_default(step=step):
            for name, value in metrics.items():
                tf.summary.scalar(name, value)
        self._writers[split].flush()

    def text(self, step: int, name: str, text: str) -> None:
        """`text` as a text summary under `train`, shown verbatim (as a code block)."""
        with self._writers["train"].as_default(step=step):
            tf.summary.text(name, "\n".join("    " + line for line in text.splitlines()))
        self._writers["train"].flush()
