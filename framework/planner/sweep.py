"""Runs each (policy, batch size) combination in a fresh Python process and collects the results.

A fresh process per combination because the CPU allocator must be chosen before TensorFlow starts
(`TF_CPU_ALLOCATOR_USE_BFC=true`), its statistics and XLA's compiled programs belong to the process,
and a combination that runs out of memory or crashes must take nothing else down with it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

from framework.planner.choose import Plan, choose
from framework.planner.measurement import (
    COMPILE,
    CONFIG_STAGE,
    RUN,
    RUN_STAGE,
    Measurement,
)

MEASURES = ("auto", RUN, COMPILE)
# `auto` runs the combinations when XLA's plan of the largest fits in this fraction of the host's
# available memory (a run also holds the data pipeline, TensorFlow's runtime and the allocator's
# slack); otherwise it plans from XLA alone.
HOST_FRACTION = 0.7

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
    results, failure = _child(spec, timeout)
    if results:
        return results[-1]
    return Measurement(policy, batch_size, error=failure, stage=RUN_STAGE)


def _child(spec: dict, timeout: float) -> tuple[list[Measurement], str | None]:
    """Runs `framework.planner.measurement` on `spec` in a fresh process: its results (one JSON
    line each), and what went wrong when it did not end well."""
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    command = [sys.executable, "-m", "framework.planner.measurement", json.dumps(spec)]
    try:
        proc = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return [], f"timed out after {timeout:.0f} s"
    results = [
        Measurement.from_json(json.loads(line))
        for line in proc.stdout.splitlines()
        if line.startswith("{")
    ]
    return results, None if proc.returncode == 0 else _child_failure(proc)


def compile_combinations(
    config: RunConfig,
    policies: Sequence[str],
    batch_sizes: Sequence[int | None],
    budget_search: int | None,
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
    processes: int = 1,
) -> list[Measurement]:
    """XLA's plan of every combination, then the memory-budget fraction that fits
    `budget_search` bytes when given, in the order listed (the fraction last).

    One fresh process compiles them all in turn (see `measurement`), or `processes` at once,
    the combinations shared round-robin and the search (one compilation when `budget:1` fits,
    else up to `BUDGET_SEARCH_STEPS` more) after the last process's share, which is never the
    largest. Each process builds the weights and the optimizer state in host memory, so more
    processes need that much more.
    """
    combinations = [(p, b) for b in batch_sizes for p in policies]
    base = {
        "files": list(config.files),
        "bindings": list(config.bindings),
        "search_paths": list(config.search_paths),
        "measure": COMPILE,
        "search_batch_size": batch_sizes[-1],
    }
    groups = max(1, min(processes, len(combinations)))
    specs = [
        {**base, "combinations": combinations[i::groups], "budget_search": None}
        for i in range(groups)
    ]
    specs[-1]["budget_search"] = budget_search
    with concurrent.futures.ThreadPoolExecutor(len(specs)) as pool:
        outputs = list(pool.map(lambda spec: _child(spec, timeout), specs))
    found: dict[tuple[str, int | None], Measurement] = {}
    searched = []
    for spec, (results, failure) in zip(specs, outputs, strict=True):
        asked = [tuple(c) for c in spec["combinations"]]
        for i, combination in enumerate(asked):
            found[combination] = (
                results[i]
                if i < len(results)
                else Measurement(*combination, error=failure, stage=RUN_STAGE, measure=COMPILE)
            )
        searched += results[len(asked) :]
    results = [found[c] for c in combinations] + searched
    # Each process measured the CPU's peak FLOP/s for itself (the others competing for the cores):
    # the highest is the least disturbed, and one peak for all keeps the estimates comparable.
    peak = max((m.peak_flops for m in results if m.peak_flops), default=None)
    return [dataclasses.replace(m, peak_flops=peak) if m.peak_flops else m for m in results]


def host_available_bytes() -> int | None:
    """The memory the host can still give (Linux's MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def make_plan(
    config: RunConfig,
    budget_bytes: int,
    policies: Sequence[str],
    batch_sizes: Sequence[int | None] = (None,),
    safety_margin: float = 0.1,
    steps: int = 5,
    tie_tolerance: float = 0.05,
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
    measure: str = "auto",
    search_budget: bool = True,
    compile_processes: int = 1,
) -> Plan:
    """Plans every combination and picks one (see `choose`). `None` as a batch size keeps the
    config's own.

    First XLA's plan of every combination is read (`compile_combinations`, in
    `compile_processes` processes), with the memory-budget fraction that fits when
    `search_budget`. With `measure` "compile" that is
    the plan. With "run" every combination (the fraction found included) then runs, one process
    at a time (they would skew each other's times); "auto" runs them when XLA's plan of the
    largest fits the host (`HOST_FRACTION` of its available memory), else plans from XLA alone.

    Raises:
      ConfigError: when the first combination cannot even be built: the config is wrong, and
        measuring the others would only repeat the error.
    """
    from framework.memory import format_bytes

    if measure not in MEASURES:
        raise ValueError(f"measure must be one of {', '.join(MEASURES)}, got {measure!r}")
    usable = int(budget_bytes * (1 - safety_margin))
    compiled = []
    if measure != RUN or search_budget:
        logging.info("plan: reading XLA's plan of every combination (nothing runs)")
        compiled = compile_combinations(
            config,
            policies,
            batch_sizes,
            usable if search_budget else None,
            timeout,
            compile_processes,
        )
    if compiled and compiled[0].stage == CONFIG_STAGE:
        raise ConfigError(f"cannot build the run: {compiled[0].error}")
    for result in compiled:
        logging.info(
            "plan: %s: XLA plans %s per device",
            result.label,
            format_bytes(result.compiled_step_bytes) if result.ok else f"nothing ({result.error})",
        )
    if measure == "auto":
        largest = max((m.compiled_step_bytes for m in compiled if m.ok), default=0)
        available = host_available_bytes()
        measure = RUN if available is None or largest <= HOST_FRACTION * available else COMPILE
        logging.info(
            "plan: measure=%s (XLA plans at most %s; the host has %s available)",
            measure,
            format_bytes(largest),
            format_bytes(available) if available else "an unknown amount",
        )
    if measure == COMPILE:
        return choose(compiled, budget_bytes, safety_margin, tie_tolerance)
    searched = [m.policy for m in compiled[len(policies) * len(batch_sizes) :] if m.ok]
    measurements = []
    for batch_size in batch_sizes:
        for policy in [*policies, *searched]:
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
