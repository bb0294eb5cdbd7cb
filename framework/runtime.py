"""Where a run executes: the strategy and its devices, the compiler's flags and the precision.

These settings change where and how fast a step runs, never what it computes (up to the
precision), so they are grouped apart from the model and the training settings: a run moves from
a laptop to a TPU pod by swapping its `Runtime` (`configs/runtime/*.gin`) and nothing else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import gin
import keras
import tensorflow as tf

from framework import checks, distribute, xla

PRECISIONS = {"float32": "float32", "bfloat16": "mixed_bfloat16"}


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Runtime:
    """The runtime of a run.

    Args:
      strategy: `one_device`, `mirrored`, `multi_worker_mirrored` or `tpu` (see
        `distribute.create_strategy`).
      cpu_devices: logical CPU devices for `mirrored` on a machine without accelerators.
      collectives: all-reduce of `multi_worker_mirrored`: `auto`, `ring` or `nccl`.
      tpu: for `tpu`, the TPU's name, `local` (a TPU VM) or `grpc://host:port`.
      tpu_node: a legacy TPU node (a separate TPU host) rather than a TPU VM.
      xla_flags, tf_xla_flags, libtpu_flags: flags for `XLA_FLAGS`, `TF_XLA_FLAGS` and
        `LIBTPU_INIT_ARGS`, set before anything compiles (see `xla.set_xla_flags`).
      precision: `float32`, or `bfloat16` (bfloat16 compute, float32 weights).
    """

    strategy: str = "one_device"
    cpu_devices: int | None = None
    collectives: str = "auto"
    tpu: str | None = None
    tpu_node: bool = False
    xla_flags: Sequence[str] = ()
    tf_xla_flags: Sequence[str] = ()
    libtpu_flags: Sequence[str] = ()
    precision: str = "float32"

    def __post_init__(self) -> None:
        # Gin passes any value: check before anything is set or built.
        if self.strategy not in distribute.STRATEGIES:
            raise ValueError(
                f"unknown strategy {self.strategy!r}; choose one of "
                f"{', '.join(distribute.STRATEGIES)}"
            )
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}"
            )
        checks.integer("Runtime.cpu_devices", self.cpu_devices, optional=True)
        checks.boolean("Runtime.tpu_node", self.tpu_node)

    def start(self) -> tf.distribute.Strategy:
        """Sets the compiler flags and the precision, then builds and returns the strategy.

        Call it before TensorFlow runs anything: XLA reads its flags once per process, and
        logical CPU devices cannot be made once devices are in use.
        """
        xla.set_xla_flags(self.xla_flags, self.tf_xla_flags, self.libtpu_flags)
        strategy = distribute.create_strategy(
            self.strategy,
            self.cpu_devices,
            collectives=self.collectives,
            tpu=self.tpu,
            tpu_node=self.tpu_node,
        )
        keras.config.set_dtype_policy(PRECISIONS[self.precision])
        return strategy
