"""Runs each (policy, batch size) combination in a fresh Python process and collects the results.

A fresh process per combination because the CPU allocator must be chosen before TensorFlow starts
(`TF_CPU_ALLOCATOR_USE_BFC=true`), its statistics and XLA's compiled programs belong to the process,
and a combination that runs out of memory or crashes must take nothing else down with it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

from framework.planner.choose import Plan, choose
from framework.planner.measurement import CONFIG_STAGE, RUN_STAGE, Measurement

DEFAULT_TIMEOUT_SECONDS = 3600


class ConfigError(Exception):
    """The run cannot be built as configured, whatever the policy: a user error, not a result."""


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The trainer's configuration as the binaries got it: gin files, bindings, search paths."""

    files: Sequence[str]
    bindings: Sequence[str]
    search_paths: Sequence[str]


def _child_failure(proc: subprocess.CompletedProcess) -> str:
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        hint = " (out of host memory?)" if proc.returncode == -signal.SIGKILL else ""
        return f"killed by {name}{hint}"
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    return f"exit status {proc.returncode}: {lines[-1].strip() if lines else 'no output'}"[:300]


def measure_combination(
    config: RunConfig,
    policy: str,
    batch_size: int | None,
    steps: int,
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
) -> Measurement:
    """Measures one combination in a child process; a crash or timeout becomes a failed result."""
    spec = {
        "files": list(config.files),
        "bindings": list(config.bindings),
        "search_paths": list(config.search_paths),
        "policy": policy,
        "batch_size": batch_size,
        "steps": steps,
    }
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    command = [sys.executable, "-m", "framework.planner.measurement", json.dumps(spec)]
    try:
        proc = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return Measurement(
            policy, batch_size, error=f"timed out after {timeout:.0f} s", stage=RUN_STAGE
        )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines:
        return Measurement.from_json(json.loads(lines[-1]))
    return Measurement(policy, batch_size, error=_child_failure(proc), stage=RUN_STAGE)


def make_plan(
    config: RunConfig,
    budget_bytes: int,
    policies: Sequence[str],
    batch_sizes: Sequence[int | None] = (None,),
    safety_margin: float = 0.1,
    steps: int = 5,
    tie_tolerance: float = 0.05,
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
) -> Plan:
    """Measures every combination, one process at a time (they would skew each other's times),
    and picks one (see `choose`). `None` as a batch size keeps the config's own.

    Raises:
      ConfigError: when the first combination cannot even be built: the config is wrong, and
        measuring the others would only repeat the error.
    """
    from framework.memory import format_bytes

    measurements = []
    for batch_size in batch_sizes:
        for policy in policies:
            logging.info(
                "plan: measuring remat policy %s, batch size %s",
                policy,
                batch_size or "of the config",
            )
            result = measure_combination(config, policy, batch_size, steps, timeout)
            if not measurements and result.stage == CONFIG_STAGE:
                raise ConfigError(f"cannot build the run: {result.error}")
            measurements.append(result)
            if result.ok:
                logging.info(
                    "plan: %s: peak %s, %.3f s per step",
                    result.label,
                    format_bytes(result.peak_bytes),
                    result.step_seconds,
                )
            else:
                logging.info("plan: %s failed: %s", result.label, result.error)
    return choose(measurements, budget_bytes, safety_margin, tie_tolerance)
