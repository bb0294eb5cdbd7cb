"""The figures of (policy, batch size) combinations: `python -m framework.planner.measurement
SPEC_JSON` builds the configured Trainer without a model directory (no lock, checkpoints or
summaries) and prints one JSON line per combination.

Two ways to measure, the `measure` of the `spec.WorkerSpec` given:
- `Measure.RUN`: one combination per process (see `sweep.py`), with
  `TF_CPU_ALLOCATOR_USE_BFC=true` set before TensorFlow starts so the CPU allocator keeps the
  statistics the peak is read from: the step runs, its allocator peak and median time are
  measured, and XLA's plan is read beside them.
- `Measure.COMPILE`: a worker process (`serve_compiled`) that builds the trainer once, then reads
  combinations from stdin and prints XLA's plan of each, nothing run: XLA's buffer assignment
  of one replica's forward and backward pass plus the optimizer's state is the per-device
  total, and the dot and convolution FLOPs of that program (recomputation included) over the
  device's peak FLOP/s estimate its time. The weights and the optimizer state are built once
  (host memory); no activation is ever allocated, so a step far larger than the host can be
  planned. `workers.py` runs these workers, `schedule.py` decides what they compile.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple, TextIO

from framework.planner.spec import Combination, Measure, RunConfig, WorkerSpec

if TYPE_CHECKING:
    from framework.memory import CompiledMemory
    from framework.shard import ShardedState
    from framework.trainer.trainer import Trainer

# Failure stages: "config" means the run cannot be built as configured (a user error, the same for
# every combination); "run" means this combination failed (out of memory, a crash), others
# may not.
CONFIG_STAGE = "config"
RUN_STAGE = "run"
# A combination left out because another that fits cannot be beaten (`schedule.py`).
SKIPPED_STAGE = "skipped"
# The measure modes under their names from before `Measure`, which tests import.
RUN, COMPILE = Measure.RUN, Measure.COMPILE
# What a compile worker prints once its trainer is built, before its first result.
READY = {"ready": True}
# XLA:GPU rematerializes towards 80% of the card's memory (`xla.GPU_SCHEDULER_SHARE`); a plan
# above this share of it is compiled again for a card without a limit, to see what that did.
NEAR_CAPACITY = 0.5
UNLIMITED_BYTES = 2**50


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
      measure: `Measure.RUN` (the step ran) or `Measure.COMPILE` (only XLA's plan: no
        peak_bytes, no step_seconds).
      state_bytes: the state a device keeps beside XLA's plan of the forward and backward pass
        (whose parameters are the weights, or their shards): the optimizer's slots, whole or
        their shards, and the weights' shards when the program takes the whole weights.
      step_flops: dot and convolution FLOPs of one replica's forward and backward pass in XLA's
        optimised program, the recomputation it keeps included (compile measure).
      peak_flops: the device's peak FLOP/s the step time is estimated from (compile measure).
      xla_flags: the compiler flag variables the step was compiled under (`xla.current_flags`:
        the run's `Runtime.xla_flags`, `xla_memory_limit`, ...), empty ones left out.
      compiler: who planned the compiled figures, e.g. "XLA:CPU" or "TPU v5e (libtpu 0.0.42.1)".
      shard_state: the level of `Trainer.shard_state` the step was planned at.
      unlimited_peak_bytes: for a GPU target, XLA:GPU's plan of the same program on a card
        without a memory limit, when the step plans near the card's memory (the compiler's own
        rematerialization works towards it): above `compiled_peak_bytes`, the compiler
        recomputed to fit.
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
    measure: Measure = Measure.RUN
    state_bytes: int | None = None
    step_flops: float | None = None
    peak_flops: float | None = None
    xla_flags: dict[str, str] | None = None
    compiler: str | None = None
    shard_state: str = "none"
    unlimited_peak_bytes: int | None = None

    def __post_init__(self) -> None:
        """The mode as a `Measure` whether given as one or as its word (JSON, callers)."""
        object.__setattr__(self, "measure", Measure(self.measure))

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def compiled_step_bytes(self) -> int | None:
        """XLA's plan of the step per device: the forward and backward pass at its peak
        (weights, batch, live activations, gradients) plus the optimizer's state."""
        if self.compiled_peak_bytes is None or self.state_bytes is None:
            return None
        return self.compiled_peak_bytes + self.state_bytes

    @property
    def fit_bytes(self) -> int | None:
        """What is judged against the budget: the measured peak, or XLA's plan when not run."""
        return self.peak_bytes if self.measure == Measure.RUN else self.compiled_step_bytes

    @property
    def fit_kind(self) -> str:
        """What `fit_bytes` is, in words: "peak" (measured) or "XLA's plan"."""
        return "peak" if self.measure == Measure.RUN else "XLA's plan"

    @property
    def compiler_remat_bytes(self) -> int:
        """What the compiler's own rematerialization took off the step's plan (0: nothing)."""
        if self.unlimited_peak_bytes is None or self.compiled_peak_bytes is None:
            return 0
        return max(0, self.unlimited_peak_bytes - self.compiled_peak_bytes)

    @property
    def estimated_step_seconds(self) -> float | None:
        if not self.step_flops or not self.peak_flops:
            return None
        return self.step_flops / self.peak_flops

    @property
    def step_bytes(self) -> int | None:
        if self.peak_bytes is None or self.live_before_bytes is None:
            return None
        return self.peak_bytes - self.live_before_bytes

    @property
    def seconds(self) -> float | None:
        """Seconds per step: measured, or (compile measure) estimated from the step's FLOPs at
        the device's peak."""
        return self.step_seconds if self.measure == Measure.RUN else self.estimated_step_seconds

    @property
    def examples_per_second(self) -> float | None:
        if not self.seconds or not self.batch_size:
            return None
        return self.batch_size / self.seconds

    @property
    def label(self) -> str:
        label = f"{self.policy} @ {self.batch_size}" if self.batch_size else self.policy
        return label if self.shard_state == "none" else f"{label}, {self.shard_state} sharded"

    def to_json(self) -> dict:
        return {
            **dataclasses.asdict(self),
            "step_bytes": self.step_bytes,
            "compiled_step_bytes": self.compiled_step_bytes,
            "examples_per_second": self.examples_per_second,
        }

    @classmethod
    def from_json(cls, data: dict) -> Measurement:
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in names})


def _reason(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return " ".join((lines[0] if lines else type(error).__name__).split())[:300]


def _bindings(config: RunConfig, job: Combination) -> list[str]:
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
        cli.parse_gin(config.files, _bindings(config, job), config.search_paths)
    except cli.UsageError as error:
        return failed(error=str(error), stage=CONFIG_STAGE)
    try:
        trainer = Trainer(None)
    except tf.errors.ResourceExhaustedError as error:
        return failed(error=f"out of memory: {_reason(error)}", stage=RUN_STAGE)
    except Exception as error:  # noqa: BLE001 (any failure to build is the config's)
        return failed(error=_reason(error), stage=CONFIG_STAGE)
    failed = functools.partial(failed, batch_size=trainer.settings.global_batch_size)
    try:
        return _measure_steps(trainer, job.policy, spec.steps)
    except tf.errors.ResourceExhaustedError as error:
        return failed(error=f"out of memory: {_reason(error)}", stage=RUN_STAGE)
    except Exception as error:  # noqa: BLE001 (reported in the plan's table, not raised)
        return failed(error=_reason(error), stage=RUN_STAGE)


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


def state_bytes(variables) -> int:
    """The bytes of `variables` (one device's copy of each)."""
    import tensorflow as tf

    return sum(math.prod(v.shape) * tf.as_dtype(v.dtype).size for v in variables)


def kept_bytes(optimizer, sharded, in_program: bool) -> int:
    """What a device keeps beside the forward and backward pass the planner compiles: the
    optimizer's variables (slots and counters: whole, or with `sharded` state their shards),
    and the weights' shards unless the program takes them (`in_program` above "optimizer")."""
    if sharded is None:
        return state_bytes(optimizer.variables)
    kept = state_bytes(sharded.optimizer.variables)
    if not sharded.reduces_in_program(in_program):
        kept += state_bytes(sharded.shards)
    return kept


def serve_compiled(spec: WorkerSpec, jobs: TextIO) -> Iterator[dict]:
    """A compile worker: builds the configured trainer once, yields `READY`, then for each job
    line of `jobs` (a `Combination`'s JSON) XLA's plan of that combination as a compile-only
    Measurement's JSON, setting each policy on the model in turn; until `jobs` ends. When the
    trainer cannot be built, every job gets that config error. A CPU's peak FLOP/s is measured
    before `READY`, so before the parent starts another worker.

    With `spec.target` (a TPU chip or slice, or a GPU card: `memory.targets.target_device`)
    each step is compiled by that device's compiler instead (libtpu's, XLA:GPU's), its time
    estimated from the optimised program's FLOPs at the device's peak for the run's precision.
    The trainer is built unsharded; a shard level is planned on a
    `shard.ShardedState` cut for the run's replicas (a slice's chips), built once per level.
    On a slice, the "gradients" and "weights" levels compile the one program of all replicas a
    TPU runs (collectives inside) for every chip of the slice; elsewhere the program is the
    one the run's strategy compiles."""
    worker = _CompileWorker(spec)
    yield READY
    for line in iter(jobs.readline, ""):
        if line.strip():
            yield worker.compile(Combination.from_json(json.loads(line))).to_json()


class _Program(NamedTuple):
    """What one compilation of a step gives: XLA's plan, the FLOPs its time is estimated from,
    and (a GPU target near its memory) the plan's peak without a memory limit."""

    plan: CompiledMemory
    flops: float
    unlimited_peak_bytes: int | None


class _CompileWorker:
    """What a compile worker keeps from one job to the next, so each is a compilation only: the
    trainer built once (or why it could not be), the device planned for, the sharded state of
    the last level and the programs compiled so far."""

    def __init__(self, spec: WorkerSpec):
        from framework.memory import targets, tpu

        self.target = spec.target
        self.chip = targets.target_device(spec.target) if spec.target else None
        self.devices = 1
        if self.chip is not None and self.chip.kind == "TPU":
            self.devices = tpu.tpu_devices(spec.target)
        self.trainer, self.build_error = _build_unsharded(spec.config, self.chip is not None)
        if self.trainer is not None:
            strategy = self.trainer.strategy
            self.replicas = self.devices if self.chip else strategy.num_replicas_in_sync
            self.peak = self._peak_flops()
        self._programs: dict[tuple, _Program] = {}
        self._sharded: tuple[str, ShardedState | None] | None = None

    def _peak_flops(self) -> float:
        """The peak FLOP/s step times are estimated at: the named device's for the run's
        precision, or this host's, measured."""
        if self.chip is None:
            peak, _ = self.trainer.runtime.peak_flops_per_device(self.trainer.strategy)
            return peak
        return self.chip.peak(self.trainer.runtime.precision)

    def compile(self, job: Combination) -> Measurement:
        """XLA's plan of `job` as a compile-only Measurement; a failure comes back in it, since
        one combination's failure says nothing of the others'."""
        import tensorflow as tf

        from framework.runtime import xla

        if self.trainer is None:
            return Measurement(
                job.policy,
                job.batch_size,
                error=self.build_error,
                stage=CONFIG_STAGE,
                shard_state=job.shard_state,
            )
        batch_size = job.batch_size or self.trainer.settings.global_batch_size
        failed = functools.partial(
            Measurement,
            job.policy,
            batch_size,
            stage=RUN_STAGE,
            measure=Measure.COMPILE,
            shard_state=job.shard_state,
        )
        try:
            program, kept = self._plan(job.policy, batch_size, job.shard_state)
        except tf.errors.ResourceExhaustedError as error:
            return failed(error=f"out of host memory while compiling: {_reason(error)}")
        except Exception as error:  # noqa: BLE001 (reported in the plan's table, not raised)
            return failed(error=_reason(error))
        return Measurement(
            job.policy,
            batch_size,
            compiled_total_bytes=program.plan.total_bytes,
            compiled_temp_bytes=program.plan.temp_bytes,
            compiled_peak_bytes=program.plan.peak_bytes,
            measure=Measure.COMPILE,
            state_bytes=kept,
            step_flops=program.flops,
            peak_flops=self.peak,
            xla_flags=xla.current_flags(),
            compiler=program.plan.compiler,
            shard_state=job.shard_state,
            unlimited_peak_bytes=program.unlimited_peak_bytes,
        )

    def _plan(self, policy: str, batch_size: int, level: str) -> tuple[_Program, int]:
        """The step of `policy` at `batch_size` and shard `level`, compiled, and the state a
        device keeps beside it: the two parts of the plan judged against the budget."""
        self._set_policy(policy)
        if self.chip is not None and batch_size % self.devices:
            raise ValueError(
                f"batch size {batch_size} does not split over the {self.devices} devices of "
                f"{self.target}"
            )
        state = self._sharded_state(level)
        in_program = self.chip is not None and state is not None and state.reduces_in_program(True)
        # compiled_step splits a global batch over the strategy's replicas (one, for a chip).
        step_batch = batch_size if self.chip is None else batch_size // self.devices
        fn, args = self.trainer.compiled_step(step_batch, planned=state, in_program=in_program)
        form = level if in_program else ("gathered" if len(args) > 1 else "whole")
        program = self._compile_step((policy, step_batch, form, in_program), in_program, fn, *args)
        return program, kept_bytes(self.trainer.optimizer, state, in_program)

    def _set_policy(self, policy: str) -> None:
        """Checkpoints the model by `policy`; a memory budget prices kept masks as the planned
        device's compiler stores them."""
        from framework import remat
        from framework.runtime import distribute

        kind = self.chip.kind if self.chip else distribute.device_type(self.trainer.strategy)
        resolved = remat.get_policy(policy, mask_bits=remat.policies.MASK_BITS.get(kind, 1))
        enable = resolved is not remat.policies.everything_saveable
        remat.set_grad_checkpointing(self.trainer.model, policy=resolved, enable=enable)

    def _sharded_state(self, level: str) -> ShardedState | None:
        """The state cut at `level` (None for "none"), kept for the next job only: jobs come
        level by level, and a level's state is built anew from the optimizer."""
        if self._sharded is None or self._sharded[0] != level:
            self._sharded = level, None if level == "none" else self._cut_state(level)
        return self._sharded[1]

    def _cut_state(self, level: str) -> ShardedState:
        """A fresh optimizer's state cut at `level` for the run's replicas (a slice's chips),
        since the trainer itself is built unsharded."""
        from framework import shard
        from framework.trainer import optim

        s = self.trainer.settings
        with self.trainer.strategy.scope():
            optimizer, _ = optim.scheduled_optimizer(
                s.optimizer_fn, s.learning_rate, s.warmup_steps, s.train_steps, s.weight_decay
            )
        return shard.ShardedState(
            level, self.trainer.strategy, self.trainer.model, optimizer, self.replicas
        )

    def _compile_step(self, key: tuple, in_program: bool, fn, *args) -> _Program:
        """One compilation per program: levels whose step compiles the same program share it."""
        if key not in self._programs:
            if self.chip is None:
                self._programs[key] = self._compile_on_host(fn, *args)
            else:
                self._programs[key] = self._compile_for_target(in_program, fn, *args)
        return self._programs[key]

    def _compile_on_host(self, fn, *args) -> _Program:
        """XLA's plan and FLOPs from one compilation, for the strategy's first device."""
        from framework.runtime import distribute, flops

        device = distribute.first_device(self.trainer.strategy)
        plan, step_flops = flops.compiled_plan_and_flops(fn, *args, device=device)
        return _Program(plan, float(step_flops), None)

    def _compile_for_target(self, in_program: bool, fn, *args) -> _Program:
        """The named device's compiler's plan and FLOPs (for every chip of a slice when the
        program reduces in it); near a GPU's memory also its plan without a limit, since
        XLA:GPU may have rematerialized by itself to fit."""
        from framework.memory import gpu, targets

        hlo = fn.experimental_get_compiler_ir(*args)(stage="hlo_serialized")
        replicas = self.replicas if in_program else 1
        plan = targets.compile_for_target(hlo, self.target, replicas=replicas)
        unlimited = None
        if self.chip.kind == "GPU" and plan.peak_bytes > NEAR_CAPACITY * self.chip.memory_bytes:
            unlimited = gpu.compile_for_card(hlo, self.chip, UNLIMITED_BYTES).peak_bytes
        return _Program(plan, plan.flops, unlimited)


def _build_unsharded(config: RunConfig, for_target: bool) -> tuple[Trainer | None, str | None]:
    """The trainer a compile worker plans on, or why it cannot be built (the config's fault,
    the same for every job): unsharded, since each level is planned on state cut for it."""
    from framework import cli
    from framework.trainer import Trainer

    bindings = [*config.bindings, "Trainer.shard_state = 'none'"]
    if for_target:
        # The step of one device, built on this host's CPU: the worker never claims a TPU or a
        # GPU (the run holds them), and a slice's devices split the global batch.
        bindings.append("Runtime.strategy = 'one_device'")
    try:
        cli.parse_gin(config.files, bindings, config.search_paths)
        return Trainer(None, remat_policy=None, count_flops=False), None
    except Exception as error:  # noqa: BLE001 (any failure to build is the config's)
        return None, _reason(error)


def main() -> None:
    spec = WorkerSpec.from_json(json.loads(sys.argv[1]))
    if spec.measure == Measure.COMPILE:
        # The protocol keeps stdout's pipe to itself: anything else written there (TensorFlow,
        # a model that prints) goes to stderr instead.
        protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w")
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
        for line in serve_compiled(spec, sys.stdin):
            protocol.write(json.dumps(line) + "\n")
            protocol.flush()
        return
    result = measure(spec)
    print(json.dumps(result.to_json()), flush=True)


if __name__ == "__main__":
    main()
