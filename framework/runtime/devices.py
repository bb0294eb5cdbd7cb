"""Where a run executes: the strategy and its devices, the compiler's flags and the precision.

These settings change where and how fast a step runs, never what it computes (up to the
precision), so they are grouped apart from the model and the training settings: a run moves from
a laptop to a TPU pod by swapping its `Runtime` (`configs/runtime/*.gin`) and nothing
else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import gin
import keras
import tensorflow as tf

from framework.core import checks, tf_internals
from framework.memory import gpu, tpu, units
from framework.runtime import distribute, flops, xla

PRECISIONS = {"float32": "float32", "bfloat16": "mixed_bfloat16"}
# The Keras dtype policy the last Runtime set: another one found at start was the user's own.
_policy_set = ["float32"]


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
      peak_tflops: the peak TFLOP/s of one device, which model FLOPs utilisation (MFU) is
        measured against. None: the datasheet's for known GPUs (`memory.gpu.GPU_CARDS`; for
        float32, TensorFloat-32's where the card has it), measured on CPUs (a short matrix
        product benchmark), unknown on TPUs (then set it).
      xla_memory_limit: a byte size ("14GiB") under which XLA's own rematerialization pass keeps
        each compiled program, on TPUs and GPUs (`xla.remat_limit_flags`; docs/memory.md). XLA:CPU
        has no such pass: set here on a CPU runtime it is an error at start.
      accelerator_type: the Cloud TPU the run trains on, e.g. "v5litepod-16" (`launch/tpu_pod.py`
        binds it). `Trainer.remat_policy = "auto"` then plans with the TPU compiler for that
        chip, on any host (`memory.tpu`), and its HBM is the default memory budget.
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
    peak_tflops: float | None = None
    xla_memory_limit: str | None = None
    accelerator_type: str | None = None

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
        checks.number("Runtime.peak_tflops", self.peak_tflops, optional=True)
        checks.boolean("Runtime.tpu_node", self.tpu_node)
        if self.xla_memory_limit is not None:
            try:
                units.parse_bytes(self.xla_memory_limit)
            except ValueError as error:
                raise ValueError(f"Runtime.xla_memory_limit: {error}") from None
        if self.accelerator_type is not None:
            try:
                tpu.tpu_chip(self.accelerator_type)
            except ValueError as error:
                raise ValueError(f"Runtime.accelerator_type: {error}") from None

    def start(self) -> tf.distribute.Strategy:
        """Sets the compiler flags and the precision, then builds and returns the strategy.

        Call it before TensorFlow runs anything: XLA reads its flags once per process, and
        logical CPU devices cannot be made once devices are in use.
        """
        _check_global_policy(PRECISIONS[self.precision])
        limit = self.xla_memory_limit and units.parse_bytes(self.xla_memory_limit)
        libtpu_flags = list(self.libtpu_flags)
        if limit and self.strategy == "tpu":  # before TensorFlow loads libtpu
            libtpu_flags += xla.remat_limit_flags("TPU", limit)[1]
        xla.set_xla_flags(self.xla_flags, self.tf_xla_flags, libtpu_flags)
        strategy = distribute.create_strategy(
            self.strategy,
            self.cpu_devices,
            collectives=self.collectives,
            tpu=self.tpu,
            tpu_node=self.tpu_node,
        )
        if limit and self.strategy != "tpu":  # XLA reads XLA_FLAGS at the first compilation
            kind = distribute.device_type(strategy)
            device_bytes = tf_internals.device_memory_bytes(kind) if kind == "GPU" else None
            xla.set_xla_flags(xla.remat_limit_flags(kind, limit, device_bytes)[0])
        keras.config.set_dtype_policy(PRECISIONS[self.precision])
        _policy_set[0] = PRECISIONS[self.precision]
        return strategy

    def peak_flops_per_device(self, strategy: tf.distribute.Strategy) -> tuple[float | None, str]:
        """The peak FLOP/s of one of the strategy's devices, and where the figure comes from."""
        if self.peak_tflops:
            return self.peak_tflops * 1e12, "Runtime.peak_tflops"
        kind = distribute.device_type(strategy)
        if kind == "GPU":
            # The datasheet's dense peak for the run's precision (`memory.gpu.GPU_CARDS`).
            card = gpu.local_card()
            if card is None:
                found = tf.config.list_physical_devices("GPU")[0]
                name = tf.config.experimental.get_device_details(found).get("device_name", "")
                return None, f"no datasheet figure for {name!r}: set Runtime.peak_tflops"
            return card.peak(self.precision), f"datasheet of {card.device_name}, {self.precision}"
        if kind == "CPU":
            local = len(strategy.extended.worker_devices)  # logical devices share the cores
            return flops.measure_cpu_flops() / local, "measured float32 matmul on this CPU"
        return None, f"{kind} reports no type to TensorFlow: set Runtime.peak_tflops"


def _check_global_policy(wanted: str) -> None:
    """Raises ValueError when the user set Keras' global dtype policy to another than the run's
    precision: the run would replace it, silently training in another precision. Keras'
    default (float32) and the policy a Runtime set before are not the user's."""
    found = keras.config.dtype_policy().name
    if found not in (wanted, _policy_set[0], "float32"):
        choices = ", ".join(f"{name!r} ({policy})" for name, policy in PRECISIONS.items())
        raise ValueError(
            f"Keras' global dtype policy is {found!r}, which the run would replace with "
            f"{wanted!r}: set Runtime.precision instead ({choices}) and leave the global "
            "policy alone"
        )
