"""One combination's figures, measured in this process: `python -m framework.planner.measurement
SPEC_JSON` builds the configured Trainer with the given remat policy and batch size, without a
model directory (no lock, checkpoints or summaries), runs its compiled step and prints one JSON
line with the results.

It runs in a fresh process per combination (see `sweep.py`), with `TF_CPU_ALLOCATOR_USE_BFC=true`
set before TensorFlow starts so the CPU allocator keeps the statistics the peak is read from.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time

# Failure stages: "config" means the run cannot be built as configured (a user error, the same for
# every combination); "run" means this combination failed (out of memory, a crash), others
# may not.
CONFIG_STAGE = "config"
RUN_STAGE = "run"


@dataclasses.dataclass(frozen=True)
class Measurement:
    """What one (policy, batch size) combination costs, or why it could not be measured.

    Attributes:
      policy: the remat policy name bound to `Trainer.remat_policy`.
      batch_size: the global batch size the step ran with.
      peak_bytes: the allocator's absolute peak during one steady step: weights, optimizer slots
        and prefetched data included, since all of them must fit in the device's memory.
      live_before_bytes: what was live when that step started; `peak_bytes - live_before_bytes`
        is what the step itself added (activations, gradients, temporaries).
      compiled_total_bytes / compiled_temp_bytes / compiled_peak_bytes: XLA's buffer assignment
        for the forward and backward pass (`memory.compiled_bytes`), without running it.
      step_seconds: median wall time of the timed steps.
      error: why the combination failed, or None; `stage` says whether building the run
        (`CONFIG_STAGE`) or running it (`RUN_STAGE`) failed.
    """

    policy: str
    batch_size: int | None
    peak_bytes: int | None = None
    live_before_bytes: int | None = None
    compiled_total_bytes: int | None = None
    compiled_temp_bytes: int | None = None
    compiled_peak_bytes: int | None = None
    step_seconds: float | None = None
    error: str | None = None
    stage: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def step_bytes(self) -> int | None:
        if self.peak_bytes is None or self.live_before_bytes is None:
            return None
        return self.peak_bytes - self.live_before_bytes

    @property
    def examples_per_second(self) -> float | None:
        if not self.step_seconds or not self.batch_size:
            return None
        return self.batch_size / self.step_seconds

    @property
    def label(self) -> str:
        return f"{self.policy} @ {self.batch_size}" if self.batch_size else self.policy

    def to_json(self) -> dict:
        return {
            **dataclasses.asdict(self),
            "step_bytes": self.step_bytes,
            "examples_per_second": self.examples_per_second,
        }

    @classmethod
    def from_json(cls, data: dict) -> Measurement:
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in names})


def _reason(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return " ".join((lines[0] if lines else type(error).__name__).split())[:300]


def _bindings(spec: dict) -> list[str]:
    overrides = [f"Trainer.remat_policy = {spec['policy']!r}"]
    if spec["batch_size"]:
        overrides.append(f"Trainer.global_batch_size = {int(spec['batch_size'])}")
    return [*spec["bindings"], *overrides]


def measure(spec: dict) -> Measurement:
    """Builds and measures the combination `spec` describes (gin files, bindings, search paths,
    policy, batch size, timed steps). Failures come back as a Measurement with `error` set."""
    import tensorflow as tf

    from framework import cli, memory
    from framework.trainer import Trainer

    policy, batch_size = spec["policy"], spec["batch_size"]
    memory.enable_cpu_bfc_allocator()
    try:
        cli.parse_gin(spec["files"], _bindings(spec), spec["search_paths"])
    except cli.UsageError as error:
        return Measurement(policy, batch_size, error=str(error), stage=CONFIG_STAGE)
    try:
        trainer = Trainer(None)
    except tf.errors.ResourceExhaustedError as error:
        return Measurement(
            policy, batch_size, error=f"out of memory: {_reason(error)}", stage=RUN_STAGE
        )
    except Exception as error:  # noqa: BLE001 (any failure to build is the config's)
        return Measurement(policy, batch_size, error=_reason(error), stage=CONFIG_STAGE)
    batch_size = trainer.global_batch_size
    try:
        return _measure_steps(trainer, policy, spec["steps"])
    except tf.errors.ResourceExhaustedError as error:
        return Measurement(
            policy, batch_size, error=f"out of memory: {_reason(error)}", stage=RUN_STAGE
        )
    except Exception as error:  # noqa: BLE001 (reported in the plan's table, not raised)
        return Measurement(policy, batch_size, error=_reason(error), stage=RUN_STAGE)


def _measure_steps(trainer, policy: str, steps: int) -> Measurement:
    """Warms up (trace, compile, optimizer slots), then measures one steady step's peak, the
    median time of `steps` steps, and XLA's buffer assignment of the step."""
    from framework import distribute, memory

    # The first replica's device: on TPU and GPU that device's own allocator is read.
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
    compiled = memory.compiled_bytes(*trainer.compiled_step())
    return Measurement(
        policy,
        trainer.global_batch_size,
        peak_bytes=tracker.result.peak_bytes,
        live_before_bytes=tracker.result.live_before_bytes,
        compiled_total_bytes=compiled.total_bytes,
        compiled_temp_bytes=compiled.temp_bytes,
        compiled_peak_bytes=compiled.peak_bytes,
        step_seconds=statistics.median(times),
    )


def main() -> None:
    result = measure(json.loads(sys.argv[1]))
    print(json.dumps(result.to_json()), flush=True)


if __name__ == "__main__":
    main()
