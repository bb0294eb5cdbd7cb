"""The pick: the fastest combination whose peak fits the budget, with a safety margin.

The rule, in order:
1. A combination fits when it was measured and its peak is at most `budget * (1 -
   safety_margin)` (the usable budget): the allocator's peak of a step that ran, or XLA's plan
   of the step plus the optimizer's state when only compiled. The margin covers what one step
   does not show: allocator fragmentation over a long run, evaluation, a checkpoint being written.
2. Among those that fit, speed is throughput: examples per second (batch size / median step
   time, or / the step's FLOPs at the device's peak when only compiled), so a larger batch wins
   only when it is faster per example, not per step.
3. Throughputs within `tie_tolerance` of the best count as equal, because step times on a shared
   machine move by a few percent between runs. Among equals the shard level listed first wins
   (a higher level moves more bytes per step, which FLOPs do not show), then the policy listed
   first (the default order goes from the least recomputation to the most), then the higher
   throughput. Without this, noise could pick full remat over no remat at the same speed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from framework.planner.measurement import Measurement


def usable_bytes(budget_bytes: int, safety_margin: float) -> int:
    """The budget less its safety margin: what a combination must fit, for the pick and for the
    budget search of the compile workers alike."""
    return int(budget_bytes * (1 - safety_margin))


@dataclasses.dataclass(frozen=True)
class Plan:
    """The measured combinations, the budget they were judged against, and the pick (or None)."""

    measurements: tuple[Measurement, ...]
    budget_bytes: int
    safety_margin: float
    tie_tolerance: float
    pick: Measurement | None

    @property
    def usable_bytes(self) -> int:
        return usable_bytes(self.budget_bytes, self.safety_margin)

    def fits(self, measurement: Measurement) -> bool:
        return measurement.ok and measurement.fit_bytes <= self.usable_bytes

    @property
    def xla_flags(self) -> dict[str, str]:
        """The compiler flags the combinations were compiled under (the config's, the same for
        each): figures planned under other flags do not hold."""
        return next((m.xla_flags for m in self.measurements if m.xla_flags is not None), {})

    @property
    def smallest(self) -> Measurement | None:
        """The measured combination with the lowest peak: what "nothing fits" points to."""
        measured = [m for m in self.measurements if m.ok]
        return min(measured, key=lambda m: m.fit_bytes) if measured else None


def choose(
    measurements: Sequence[Measurement],
    budget_bytes: int,
    safety_margin: float = 0.1,
    tie_tolerance: float = 0.05,
) -> Plan:
    """Judges `measurements` (in the order the policies were listed) against a budget."""
    plan = Plan(tuple(measurements), budget_bytes, safety_margin, tie_tolerance, pick=None)
    fitting = [m for m in measurements if plan.fits(m) and m.examples_per_second]
    if not fitting:
        return plan
    best = max(m.examples_per_second for m in fitting)
    equals = [m for m in fitting if m.examples_per_second >= best * (1 - tie_tolerance)]
    levels = list(dict.fromkeys(m.shard_state for m in measurements))
    policies = list(dict.fromkeys(m.policy for m in measurements))
    pick = min(
        equals,
        key=lambda m: (
            levels.index(m.shard_state),
            policies.index(m.policy),
            -m.examples_per_second,
        ),
    )
    return dataclasses.replace(plan, pick=pick)
