"""The allocator's peak during one call of a step function, on CPU, GPU or TPU.

This is the memory the step really took on this machine, as opposed to XLA's plan for it
(`compiled.compiled_bytes`). GPU and TPU allocators always keep statistics. On CPU only
the BFC allocator does. TensorFlow picks it when its runtime starts: with
`TF_CPU_ALLOCATOR_USE_BFC=true` in the environment, and (measured with TensorFlow 2.21 on x86)
by default while oneDNN is on, but not with `TF_ENABLE_ONEDNN_OPTS=0`. Without it there is no
peak to read, and this module says how to get one rather than report a misleading 0.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from framework.core import tf_internals
from framework.core.errors import FrameworkError

BFC_ENV_VAR = "TF_CPU_ALLOCATOR_USE_BFC"


class AllocatorNotTrackedError(FrameworkError, RuntimeError):
    """The device's allocator keeps no statistics, so a peak cannot be measured."""


_HOW_TO_ENABLE = (
    f"Set {BFC_ENV_VAR}=true in the environment before TensorFlow starts (e.g. "
    f"`{BFC_ENV_VAR}=true python ...`, or call framework.memory.enable_cpu_bfc_allocator() "
    "before the first TensorFlow op runs)."
)


@dataclasses.dataclass(frozen=True)
class PeakMemory:
    """Allocator figures around one call.

    Attributes:
      device: the device measured, e.g. "CPU:0".
      peak_bytes: the allocator's peak during the call, including what was live before it.
      live_before_bytes: bytes the allocator held when the call started (weights, optimizer
        slots, inputs, anything else alive in the process).
    """

    device: str
    peak_bytes: int
    live_before_bytes: int

    @property
    def step_bytes(self) -> int:
        """Peak during the call minus what was live before it: what the step itself added.

        This is the figure to compare remat policies or batch sizes with, since weights and
        optimizer state are the same for all of them.
        """
        return self.peak_bytes - self.live_before_bytes


def _not_tracked(device: str) -> AllocatorNotTrackedError:
    return AllocatorNotTrackedError(
        f"The allocator of {device} keeps no statistics, so its peak cannot be measured. On CPU "
        f"this means TensorFlow started without its BFC allocator. {_HOW_TO_ENABLE}"
    )


def _memory_info(device: str, reset: bool = False) -> dict[str, int]:
    try:
        if reset:
            tf.config.experimental.reset_memory_stats(device)
        return tf.config.experimental.get_memory_info(device)
    except ValueError as error:
        # TensorFlow's words for an allocator without statistics ("Cannot reset memory stats",
        # "Allocator stats not available", "Memory statistics not tracked").
        if any(s in str(error) for s in ("stats", "statistics")):
            raise _not_tracked(device) from error
        raise


def keeps_statistics(device: str) -> bool:
    """Whether the allocator of `device` keeps the statistics `peak_bytes` reads."""
    try:
        _memory_info(device)
    except AllocatorNotTrackedError:
        return False
    return True


def counting_device(device: str) -> str | None:
    """`device` if its allocator keeps statistics, else None (and a log line saying so)."""
    if keeps_statistics(device):
        return device
    logging.info("peak memory not logged: %s keeps no statistics", device)
    return None


def enable_cpu_bfc_allocator() -> None:
    """Makes TensorFlow use the CPU BFC allocator, whose peak `peak_bytes` reads.

    TensorFlow chooses the allocator when its runtime creates the CPU device (at the first op,
    not at import), so this works after `import tensorflow` but not after anything has run.
    Once the runtime started it only checks that the allocator in use keeps statistics.

    Raises:
      AllocatorNotTrackedError: when the runtime already started without the BFC allocator.
    """
    if tf_internals.runtime_started():
        _memory_info("CPU:0")
    else:
        os.environ[BFC_ENV_VAR] = "true"


def default_device() -> str:
    """The device a step runs on by default: the first GPU, else the first TPU, else CPU:0."""
    for device_type in ("GPU", "TPU"):
        if tf.config.list_logical_devices(device_type):
            return f"{device_type}:0"
    return "CPU:0"


class PeakTracker:
    """Measures the allocator's peak over a block: `with PeakTracker() as t: ...; t.result`.

    For code that needs the block's results too (a trainer's loop); `peak_bytes` uses it for a
    single call. Checks before the block runs that the allocator keeps statistics. An allocator
    that counted nothing during the block raises, or with `strict=False` leaves `result` None.
    """

    def __init__(self, device: str | None = None, strict: bool = True):
        self.device = device or default_device()
        self.strict = strict
        self.result: PeakMemory | None = None

    def __enter__(self) -> PeakTracker:
        self._live_before = _memory_info(self.device, reset=True)["current"]
        return self

    def __exit__(self, *exc_info) -> None:
        if exc_info[0] is not None:
            return
        if not self.device.startswith("CPU"):
            # Accelerators run asynchronously: wait for the block's work before reading the peak.
            # (CPU work has finished when the call returns; syncing there also fails in a
            # multi-worker eager context.)
            tf.test.experimental.sync_devices()
        peak = _memory_info(self.device)["peak"]
        if peak == 0:
            # An allocator that counts nothing while a step runs is not measuring it.
            if self.strict:
                raise _not_tracked(self.device)
            return
        self.result = PeakMemory(self.device, peak, self._live_before)


def peak_bytes(
    fn: Callable[..., Any], *args: Any, device: str | None = None, **kwargs: Any
) -> PeakMemory:
    """Calls `fn(*args, **kwargs)` once on `device` and returns the allocator's peak during it.

    `fn` may be a plain function, a `tf.function`, jit-compiled or not. Its first call also
    traces and compiles it, and may create variables (e.g. Keras optimizer slots); call it once
    beforehand to measure a steady step. The call's outputs are not kept.

    Args:
      fn: the step to measure.
      *args: positional arguments for `fn`.
      device: e.g. "CPU:0", "GPU:1", "TPU:0"; defaults to `default_device()`. `fn` runs under
        `tf.device(device)`.
      **kwargs: keyword arguments for `fn`.

    Raises:
      AllocatorNotTrackedError: when the device's allocator keeps no statistics (on CPU: when
        TensorFlow started without its BFC allocator), before `fn` is called.
    """
    with PeakTracker(device) as tracker, tf.device(tracker.device):
        fn(*args, **kwargs)
    return tracker.result
