"""What the planner measured of one (policy, batch size, shard level) combination - a
`Measurement`, as a child process reports it in one JSON line - and what a device keeps beside
the step it plans (`state_bytes`, `kept_bytes`). The children that measure: `run_child.py` (a
step run in its own process) and `compile_worker.py` (XLA's plans, nothing run), started as
`python -m framework.planner.child` by `workers.py`.
"""

from __future__ import annotations

import dataclasses
import math

from framework.planner.spec import Measure

# Failure stages: "config" means the run cannot be built as configured (a user error, the same for
# every combination); "run" means this combination failed (out of memory, a crash), others
# may not.
CONFIG_STAGE = "config"
RUN_STAGE = "run"
# A combination left out because another that fits cannot be beaten (`schedule.py`).
SKIPPED_STAGE = "skipped"
# What a compile worker prints once its trainer is built, before its first result.
READY = {"ready": True}


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
        """XLA's plan of the step per device: what the forward and backward pass allocates
        (weights, batch, outputs, and the whole block of temporaries, which XLA:CPU and XLA:GPU
        allocate at once: 8-32% more than what is live at its peak on the tiny configs) plus
        the optimizer's state. A TPU plan's peak adds the program's code to that."""
        if self.compiled_peak_bytes is None or self.state_bytes is None:
            return None
        allocated = max(self.compiled_peak_bytes, self.compiled_total_bytes or 0)
        return allocated + self.state_bytes

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


def reason(error: BaseException) -> str:
    """The first line of an error's message, for the plan's table."""
    lines = str(error).strip().splitlines()
    return " ".join((lines[0] if lines else type(error).__name__).split())[:300]


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
