"""Plans every (policy, batch size) combination of a config and picks one: XLA's plan of each
from compile workers (`workers.compile_in_workers`, as `schedule.CompileSchedule` hands them
out), then, when measured by running, each combination in a fresh process of its own.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

from framework.core.errors import FrameworkError
from framework.planner.choose import Plan, choose, usable_bytes
from framework.planner.measurement import CONFIG_STAGE, RUN_STAGE, Measurement
from framework.planner.schedule import CompileSchedule
from framework.planner.spec import Combination, Measure, RunConfig, WorkerSpec
from framework.planner.workers import compile_in_workers, host_available_bytes, run_child

# `auto` runs the combinations when XLA's plan of the largest fits in this fraction of the host's
# available memory (a run also holds the data pipeline, TensorFlow's runtime and the allocator's
# slack); otherwise it plans from XLA alone.
HOST_FRACTION = 0.7

DEFAULT_TIMEOUT_SECONDS = 3600


class ConfigError(FrameworkError):
    """The run cannot be built as configured, whatever the policy: a user error, not a result."""


def plan_target(name: str | None, measure: Measure | str) -> str | None:
    """The device a plan compiles for: `name` (a TPU chip or slice, or a GPU card:
    `memory.targets.target_device`), or without one, when the plan compiles (`measure` is not
    "run"), this host's GPU if it has one the framework knows (`memory.gpu.local_card`): a GPU
    run is planned by its own card's compiler, never by the host CPU's. None plans with the
    compiler of this host's device.

    Raises:
      ValueError: an unknown name, or a named device with `measure` "run".
      MissingDependency: that device's compiler (the `tpu` or `gpu` extra) is not installed.
    """
    from framework.core import jax_internals
    from framework.memory import gpu, targets, tpu

    if name is None:
        card = None if measure == Measure.RUN else gpu.local_card()
        if card is None:
            return None
        logging.info("plan: compiling for this host's GPU, described as %s", card.name)
        name = card.name
    device = targets.target_device(name)
    if device.kind == "TPU":
        tpu.tpu_devices(name)  # (a slice size that does not exist raises)
    if measure == Measure.RUN:
        raise ValueError(f"a plan for {name} is compiled, not run: drop --measure=run")
    jax_internals.require_compiler(device.kind.lower())
    return name


def measure_combination(
    config: RunConfig,
    policy: str,
    batch_size: int | None,
    steps: int,
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
    shard_state: str = "none",
) -> Measurement:
    """Measures one combination in a child process; a crash or timeout becomes a failed result."""
    job = Combination(policy, batch_size, shard_state)
    results, failure = run_child(WorkerSpec(config, Measure.RUN, job, steps=steps), timeout)
    if results:
        return results[-1]
    return Measurement(policy, batch_size, error=failure, stage=RUN_STAGE, shard_state=shard_state)


def compile_combinations(
    config: RunConfig,
    policies: Sequence[str],
    batch_sizes: Sequence[int | None],
    usable_bytes: int,
    search_budget: bool = False,
    may_skip: Callable[[Measurement], bool] = lambda baseline: False,
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
    processes: int = 0,
    target: str | None = None,
    shard_states: Sequence[str] = ("none",),
) -> list[Measurement]:
    """XLA's plan of every combination in the order listed, then (with `search_budget`) the
    largest memory-budget fraction that fits `usable_bytes` at the last batch size; what
    `may_skip` lets the schedule leave out comes back as skipped (see `schedule.py`).

    `processes` compile workers at most, each holding the weights and the optimizer state in
    host memory; 0 chooses by the cores and the memory (`workers.compile_in_workers`).
    `target` names a TPU chip or a GPU card to compile for with its compiler
    (`memory.targets.target_device`); None compiles for this host's device. Each level of
    `shard_states` plans every combination.
    """
    schedule = CompileSchedule(
        policies, batch_sizes, usable_bytes, search_budget, may_skip, shard_states
    )
    spec = WorkerSpec(config, Measure.COMPILE, target=target)
    compile_in_workers(spec, schedule, processes, timeout)
    results = schedule.results()
    # Each worker measured a CPU's peak for itself (this process starts no device: on a GPU or
    # TPU host it would claim the accelerators): the highest is the least disturbed, and one
    # figure for all keeps the estimates comparable.
    peak = max((m.peak_flops for m in results if m.peak_flops), default=None)
    return [dataclasses.replace(m, peak_flops=peak) if m.peak_flops else m for m in results]


def make_plan(
    config: RunConfig,
    budget_bytes: int,
    policies: Sequence[str],
    batch_sizes: Sequence[int | None] = (None,),
    safety_margin: float = 0.1,
    steps: int = 5,
    tie_tolerance: float = 0.05,
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
    measure: Measure | str = Measure.AUTO,
    search_budget: bool = True,
    compile_processes: int = 0,
    target: str | None = None,
    shard_states: Sequence[str] = ("none",),
) -> Plan:
    """Plans every combination and picks one (see `choose`). `None` as a batch size keeps the
    config's own. Every combination is planned at each level of `shard_states` (levels of
    `Trainer.shard_state`; a target slice plans its per-chip program for its chip count). A
    `target` (`plan_target`) plans every combination with that device's compiler (`measure`
    must then be "compile" or "auto", which becomes "compile": nothing runs on a device named).

    First XLA's plan of every combination is read (`compile_combinations`, in at most
    `compile_processes` workers, 0 for as many as the host's cores and memory allow), with the
    memory-budget fraction that fits when `search_budget`. With `measure` "compile" that is the
    plan, and what cannot beat a combination that fits is left out. With "run" every
    combination (the fraction found included) then runs, one process at a time (they would skew
    each other's times); "auto" runs them when XLA's plan of the largest fits the host
    (`HOST_FRACTION` of its available memory), else plans from XLA alone.

    Raises:
      ConfigError: when the first combination cannot even be built: the config is wrong, and
        measuring the others would only repeat the error.
    """
    measure = _checked_measure(measure, target)
    available = host_available_bytes()
    compiled = []
    if measure != Measure.RUN or search_budget:
        logging.info(
            "plan: reading %s plan of every combination (nothing runs)",
            f"the {target} compiler's" if target else "XLA's",
        )
        compiled = compile_combinations(
            config,
            policies,
            batch_sizes,
            usable_bytes(budget_bytes, safety_margin),
            search_budget,
            _skip_rule(measure, target, available),
            timeout,
            compile_processes,
            target,
            shard_states,
        )
    if compiled:
        _check_buildable(compiled[0])
    if measure == Measure.AUTO:
        measure = _auto_measure(compiled, available)
    if measure == Measure.COMPILE:
        return choose(compiled, budget_bytes, safety_margin, tie_tolerance)
    listed = len(policies) * len(batch_sizes) * len(shard_states)
    searched = [m.policy for m in compiled[listed:] if m.ok]
    measured = _run_each(config, [*policies, *searched], batch_sizes, shard_states, steps, timeout)
    return choose(measured, budget_bytes, safety_margin, tie_tolerance)


def _checked_measure(measure: Measure | str, target: str | None) -> Measure:
    """The mode asked for as a `Measure`, compile for a named target: nothing runs on a device
    the host does not have."""
    try:
        measure = Measure(measure)
    except ValueError:
        raise ValueError(f"measure must be one of {', '.join(Measure)}, got {measure!r}") from None
    if target is None:
        return measure
    if measure == Measure.RUN:
        raise ValueError(
            f"a plan for {target} is compiled, not run: use measure 'compile' or 'auto'"
        )
    return Measure.COMPILE


def _fits_host(num_bytes: int, available: int | None) -> bool:
    """Whether a step that XLA plans at `num_bytes` can run on this host (`HOST_FRACTION`)."""
    return available is None or num_bytes <= HOST_FRACTION * available


def _skip_rule(
    measure: Measure, target: str | None, available: int | None
) -> Callable[[Measurement], bool]:
    """Given a batch size's no-remat plan, whether the schedule may leave out what cannot beat a
    fit there: exact only for the compile measure's estimate, so under "auto" only when that
    plan is too large to run on this host (the plan will be compile-measured)."""
    # Nothing is left out for a named target: its compiler (the TPU's, XLA:GPU) rematerializes
    # by itself what does not fit the device's memory, so a "none" that fits may already
    # recompute, and a policy after it may need fewer FLOPs.
    if target is not None or measure == Measure.RUN:
        return lambda baseline: False
    if measure == Measure.COMPILE:
        return lambda baseline: True
    return lambda baseline: not _fits_host(baseline.compiled_step_bytes, available)


def _check_buildable(first: Measurement) -> None:
    """Stops the plan at a first result that could not build the run: the config is wrong,
    and every other combination would only repeat the error."""
    if first.stage == CONFIG_STAGE:
        raise ConfigError(f"cannot build the run: {first.error}")


def _auto_measure(compiled: Sequence[Measurement], available: int | None) -> Measure:
    """Run when XLA's plan of the largest combination fits this host, else compile: a run that
    cannot fit the host would only fail."""
    from framework.memory import format_bytes

    largest = max((m.compiled_step_bytes for m in compiled if m.ok), default=0)
    measure = Measure.RUN if _fits_host(largest, available) else Measure.COMPILE
    logging.info(
        "plan: measure=%s (XLA plans at most %s; the host has %s available)",
        measure,
        format_bytes(largest),
        format_bytes(available) if available else "an unknown amount",
    )
    return measure


def _run_each(
    config: RunConfig,
    policies: Sequence[str],
    batch_sizes: Sequence[int | None],
    shard_states: Sequence[str],
    steps: int,
    timeout: float,
) -> list[Measurement]:
    """Runs every combination, one process at a time, since runs side by side would skew each
    other's times."""
    from framework.memory import format_bytes

    measured = []
    for level in shard_states:
        for batch_size in batch_sizes:
            for policy in policies:
                logging.info(
                    "plan: measuring remat policy %s, batch size %s, shard state %s",
                    policy,
                    batch_size or "of the config",
                    level,
                )
                result = measure_combination(config, policy, batch_size, steps, timeout, level)
                if not measured:
                    _check_buildable(result)
                measured.append(result)
                if result.ok:
                    logging.info(
                        "plan: %s: peak %s, %.3f s per step",
                        result.label,
                        format_bytes(result.peak_bytes),
                        result.step_seconds,
                    )
                else:
                    logging.info("plan: %s failed: %s", result.label, result.error)
    return measured
