"""A run child: builds the configured trainer for one combination in its own process
(`TF_CPU_ALLOCATOR_USE_BFC=true` set before TensorFlow starts, so the CPU allocator keeps the
statistics the peak is read from), runs its step, and measures the allocator's peak, the median
step time and XLA's plan beside them."""

from __future__ import annotations

import functools
import statistics
import time

from framework.planner.measurement import (
    CONFIG_STAGE,
    RUN_STAGE,
    Measurement,
    kept_bytes,
    reason,
)
from framework.planner.spec import Combination, RunConfig, WorkerSpec


def bindings(config: RunConfig, job: Combination) -> list[str]:
    """The config's bindings with the combination's policy, shard level and batch size."""
    overrides = [
        f"Trainer.remat_policy = {job.policy!r}",
        f"Trainer.shard_state = {job.shard_state!r}",
    ]
    if job.batch_size:
        overrides.append(f"Trainer.global_batch_size = {int(job.batch_size)}")
    return [*config.bindings, *overrides]


def measure(spec: WorkerSpec) -> Measurement:
    """Builds and measures the combination `spec` names (gin files, bindings, search paths,
    policy, batch size, shard level, timed steps). Failures come back as a Measurement with
    `error` set."""
    import tensorflow as tf

    from framework import cli, memory
    from framework.trainer import Trainer

    config, job = spec.config, spec.combination
    failed = functools.partial(Measurement, job.policy, job.batch_size, shard_state=job.shard_state)
    memory.enable_cpu_bfc_allocator()
    try:
        cli.parse_gin(config.files, bindings(config, job), config.search_paths)
    except cli.UsageError as error:
        return failed(error=str(error), stage=CONFIG_STAGE)
    try:
        trainer = Trainer(None)
    except tf.errors.ResourceExhaustedError as error:
        return failed(error=f"out of memory: {reason(error)}", stage=RUN_STAGE)
    except Exception as error:  # noqa: BLE001 (any failure to build is the config's)
        return failed(error=reason(error), stage=CONFIG_STAGE)
    failed = functools.partial(failed, batch_size=trainer.settings.global_batch_size)
    try:
        return _measure_steps(trainer, job.policy, spec.steps)
    except tf.errors.ResourceExhaustedError as error:
        return failed(error=f"out of memory: {reason(error)}", stage=RUN_STAGE)
    except Exception as error:  # noqa: BLE001 (reported in the plan's table, not raised)
        return failed(error=reason(error), stage=RUN_STAGE)


def _measure_steps(trainer, policy: str, steps: int) -> Measurement:
    """Warms up (trace, compile, optimizer slots), then measures one steady step's peak, the
    median time of `steps` steps, and XLA's buffer assignment of the step."""
    # The first replica's device: on TPU and GPU that device's own allocator is read.
    from framework import memory
    from framework.runtime import distribute, xla

    device = distribute.first_device(trainer.strategy)
    iterator = trainer.train_iterator()
    trainer.run_steps(iterator, 1)
    with memory.PeakTracker(device) as tracker:
        trainer.run_steps(iterator, 1)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.run_steps(iterator, 1)
        times.append(time.perf_counter() - start)
    fn, args = trainer.compiled_step()
    compiled = memory.compiled_bytes(fn, *args)
    return Measurement(
        policy,
        trainer.settings.global_batch_size,
        shard_state=trainer.settings.shard_state,
        xla_flags=xla.current_flags(),
        state_bytes=kept_bytes(trainer.optimizer, trainer.sharded, in_program=False),
        peak_bytes=tracker.result.peak_bytes,
        live_before_bytes=tracker.result.live_before_bytes,
        compiled_total_bytes=compiled.total_bytes,
        compiled_temp_bytes=compiled.temp_bytes,
        compiled_peak_bytes=compiled.peak_bytes,
        step_seconds=statistics.median(times),
        compiler=compiled.compiler,
    )
