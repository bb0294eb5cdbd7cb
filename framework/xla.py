"""XLA flags from configuration, put in the environment before TensorFlow compiles anything.

XLA reads `XLA_FLAGS` (compiler flags) and `TF_XLA_FLAGS` (TensorFlow's bridge flags) once per
process, the first time it needs them, and on a TPU VM libtpu reads `LIBTPU_INIT_ARGS` (the TPU
compiler's and runtime's flags) when TensorFlow initialises the TPU. So these functions must run
before the first op or device use; this module does not import TensorFlow for that reason.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

ENV_VARS = ("XLA_FLAGS", "TF_XLA_FLAGS", "LIBTPU_INIT_ARGS")


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
    for var, value in values.items():
        if value:
            logging.info("%s=%s", var, value)
    return values
