"""A compile worker: builds the configured trainer once, then reads combinations from stdin and
prints XLA's plan of each, nothing run. XLA's buffer assignment of one replica's forward and
backward pass plus the optimizer's state is the per-device total, and the dot and convolution
FLOPs of that program (recomputation included) over the device's peak FLOP/s estimate its time.
The weights and the optimizer state are built once (host memory); no activation is ever
allocated, so a step far larger than the host can be planned. `workers.py` runs these workers,
`schedule.py` decides what they compile.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple, TextIO

from framework.planner.measurement import (
    CONFIG_STAGE,
    READY,
    RUN_STAGE,
    Measurement,
    kept_bytes,
    reason,
)
from framework.planner.spec import Combination, Measure, RunConfig, WorkerSpec

if TYPE_CHECKING:
    from framework.memory import CompiledMemory
    from framework.shard import ShardedState
    from framework.trainer.trainer import Trainer

# XLA:GPU rematerializes towards 80% of the card's memory (`xla.GPU_SCHEDULER_SHARE`); a plan
# above this share of it is compiled again for a card without a limit, to see what that did.
NEAR_CAPACITY = 0.5
UNLIMITED_BYTES = 2**50


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
            return failed(error=f"out of host memory while compiling: {reason(error)}")
        except Exception as error:  # noqa: BLE001 (reported in the plan's table, not raised)
            return failed(error=reason(error))
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
        return None, reason(error)
