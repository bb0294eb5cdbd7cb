"""XLA flags from configuration, put in the environment before TensorFlow compiles anything.

XLA reads `XLA_FLAGS` (compiler flags) and `TF_XLA_FLAGS` (TensorFlow's bridge flags) once per
process, the first time it needs them, and on a TPU VM libtpu reads `LIBTPU_INIT_ARGS` (the TPU
compiler's and runtime's flags) when TensorFlow initialises the TPU. So these functions must run
before the first op or device use; this module does not import TensorFlow for that reason.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence

from framework.core.errors import FrameworkError

ENV_VARS = ("XLA_FLAGS", "TF_XLA_FLAGS", "LIBTPU_INIT_ARGS")
# XLA:GPU's rematerialization limit is `slop_factor`% of (80% of the device's memory - the step's
# inputs and outputs); TensorFlow passes XLA no memory size of its own (JAX does).
GPU_SCHEDULER_SHARE = 0.8


class XlaMemoryLimitError(FrameworkError, ValueError):
    """`Runtime.xla_memory_limit` cannot be honoured on this platform."""


def remat_limit_flags(
    platform: str, limit_bytes: int, device_bytes: int | None = None
) -> tuple[list[str], list[str]]:
    """(XLA_FLAGS, LIBTPU_INIT_ARGS) flags that make XLA's own rematerialization pass keep a
    compiled program under `limit_bytes` on `platform` ("TPU", "GPU" or "CPU").

    - TPU: libtpu's documented `--xla_tpu_max_hbm_size_mib` (the pass's limit, in MiB).
    - GPU: XLA:GPU takes no byte limit, only `--xla_gpu_memory_limit_slop_factor`, a percent of
      80% of the device's memory (`device_bytes`), rounded down so the limit is not exceeded.
    - CPU: XLA:CPU runs no rematerialization pass: an error that says what to use instead.
    """
    if limit_bytes <= 0:
        raise XlaMemoryLimitError(f"Runtime.xla_memory_limit must be positive, got {limit_bytes}")
    if platform == "TPU":
        return [], [f"--xla_tpu_max_hbm_size_mib={max(1, limit_bytes // 2**20)}"]
    if platform == "GPU":
        if not device_bytes:
            raise XlaMemoryLimitError(
                "Runtime.xla_memory_limit: the GPU's memory size is unknown, so the limit cannot "
                "be turned into --xla_gpu_memory_limit_slop_factor; set that flag in "
                "Runtime.xla_flags instead"
            )
        percent = math.floor(100 * limit_bytes / (GPU_SCHEDULER_SHARE * device_bytes))
        return [f"--xla_gpu_memory_limit_slop_factor={max(1, percent)}"], []
    raise XlaMemoryLimitError(
        f"Runtime.xla_memory_limit has no effect on {platform}: XLA:{platform} runs no "
        "rematerialization pass. Lower the step's memory with Trainer.remat_policy (e.g. "
        "'budget:0.3', see `python -m framework.planner`), or drop the setting for this runtime"
    )


def merge_flags(existing: str, extra: Sequence[str]) -> str:
    """Adds `extra` flags to a flag string; an `extra` flag replaces one of the same name."""
    names = {flag.split("=", 1)[0] for flag in extra}
    kept = [flag for flag in existing.split() if flag.split("=", 1)[0] not in names]
    return " ".join([*kept, *extra])


def set_xla_flags(
    xla_flags: Sequence[str] = (),
    tf_xla_flags: Sequence[str] = (),
    libtpu_flags: Sequence[str] = (),
) -> dict[str, str]:
    """Writes the flags to `XLA_FLAGS`, `TF_XLA_FLAGS` and `LIBTPU_INIT_ARGS`, logs the ones that
    are set and returns the three values."""
    for flag in (*xla_flags, *tf_xla_flags, *libtpu_flags):
        if not flag.startswith("--"):
            raise ValueError(f"XLA flag {flag!r} must start with '--', e.g. '--xla_dump_to=/tmp/x'")
    for var, flags in zip(ENV_VARS, (xla_flags, tf_xla_flags, libtpu_flags)):
        if flags:
            os.environ[var] = merge_flags(os.environ.get(var, ""), flags)
    values = {var: os.environ.get(var, "") for var in ENV_VARS}
    for var, value in current_flags().items():
        logging.info("%s=%s", var, value)
    return values


def current_flags() -> dict[str, str]:
    """The compiler flag variables this process has set (empty ones left out): what a plan or a
    benchmark records beside its figures, since the flags change what XLA compiles."""
    return {var: os.environ[var] for var in ENV_VARS if os.environ.get(var)}
