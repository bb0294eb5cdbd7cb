"""Which combination the compile workers read XLA's plan of next, and which they can leave out.

Every (policy, batch size) is handed out in the order listed, then the memory-budget search
probes fractions of `remat.policies.MemoryBudget`. Two rules keep the work small without
changing the pick:

- Dominance. Recomputation only adds products, so no policy's step has fewer dot and
  convolution FLOPs than the same batch without remat. Once a combination fits with no more
  FLOPs than no remat at its batch size, nothing listed after it at that batch size can be
  faster by the compile measure's estimate (FLOPs at the device's peak), and a tie goes to the
  policy listed first (`choose`): the rest of that batch size, and the budget search there, are
  left out (`SKIPPED_STAGE`). Only where the caller allows it (`may_skip`): a plan that will run
  the combinations judges them by measured time, which this rule does not bound.
- The budget search runs in rounds of as many probes as there are workers, each round splitting
  what is left of the interval evenly, on a grid of 1/`BUDGET_GRID`: `budget:1` leads the first
  round (one compilation when the whole budget fits).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

from framework.planner.measurement import CONFIG_STAGE, SKIPPED_STAGE, Measurement
from framework.planner.spec import Combination, Measure

# Budget fractions are searched in steps of 1/BUDGET_GRID: "budget:0.34", not "budget:0.328125".
BUDGET_GRID = 50
# `remat.BUDGET_PREFIX`, spelt out: the planner's --help must not import TensorFlow.
BUDGET_PREFIX = "budget:"


@dataclasses.dataclass(frozen=True)
class Job:
    """One compilation: a policy at a batch size (None: the config's) and a shard level;
    `search` for a budget probe, so a listed "budget:0.5" and the search's own are told apart."""

    policy: str
    batch_size: int | None
    search: bool = False
    shard_state: str = "none"

    @property
    def combination(self) -> Combination:
        """What a compile worker is sent: the setting, not how the schedule came to it."""
        return Combination(self.policy, self.batch_size, self.shard_state)


def _is_no_remat(policy: str) -> bool:
    from framework.remat import policies

    return policies.get_policy(policy) is policies.everything_saveable


def _spaced(low: int, high: int, count: int) -> list[int]:
    """Up to `count` grid points strictly between `low` and `high`, splitting it evenly."""
    points = {low + round((high - low) * i / (count + 1)) for i in range(1, count + 1)}
    return sorted(p for p in points if low < p < high)


class BudgetSearch:
    """The largest fraction on the grid whose `budget:F` step fits `usable_bytes` by XLA's plan,
    or (nothing fits) the failure at fraction 0. Assumes the plan grows with the fraction; where
    it does not, what is found still fits."""

    def __init__(
        self,
        usable_bytes: int,
        batch_size: int | None,
        grid: int = BUDGET_GRID,
        shard_state: str = "none",
    ):
        self.usable_bytes = usable_bytes
        self.batch_size = batch_size
        self.shard_state = shard_state
        self.grid = grid
        self.low, self.high = -1, grid + 1  # largest point known to fit, smallest known not to
        self.best: Measurement | None = None
        self.at_zero: Measurement | None = None
        self._unassigned: list[int] = []
        self._round: dict[int, Measurement | None] = {}
        self._first = True

    @property
    def done(self) -> bool:
        return not self._round and not _spaced(self.low, self.high, 1)

    @property
    def result(self) -> Measurement | None:
        return self.best or self.at_zero

    def _job(self, point: int) -> Job:
        policy = f"{BUDGET_PREFIX}{point / self.grid:g}"
        return Job(policy, self.batch_size, search=True, shard_state=self.shard_state)

    def next_job(self, width: int) -> Job | None:
        """A probe to compile, or None while this round's are all out (or the search is done)."""
        if not self._round and not self.done:
            if self._first:
                points = [self.grid, *_spaced(self.low, self.grid, width - 1)]
                self._first = False
            else:
                points = _spaced(self.low, self.high, max(1, width))
            self._round = dict.fromkeys(points)
            self._unassigned = list(points)
        return self._job(self._unassigned.pop(0)) if self._unassigned else None

    def give_back(self, job: Job) -> None:
        self._unassigned.insert(0, self._point(job))

    def _point(self, job: Job) -> int:
        return round(float(job.policy.removeprefix(BUDGET_PREFIX)) * self.grid)

    def record(self, job: Job, result: Measurement) -> None:
        point = self._point(job)
        self._round[point] = result
        if point == 0:
            self.at_zero = result
        if any(m is None for m in self._round.values()):
            return
        fitting = [p for p, m in self._round.items() if self._fits(m)]
        if fitting and max(fitting) > self.low:
            self.low = max(fitting)
            self.best = self._round[self.low]
        failing = [p for p, m in self._round.items() if p > self.low and not self._fits(m)]
        self.high = min([self.high, *failing])
        self._round = {}

    def _fits(self, m: Measurement) -> bool:
        return m.ok and m.compiled_step_bytes <= self.usable_bytes


class CompileSchedule:
    """Hands out the combinations to compile and collects their results (see the module's
    docstring for what is left out).

    Args:
      policy_names, batch_sizes: the combinations, every policy at each batch size in turn.
      usable_bytes: the budget less its margin: what fits.
      search: whether to search the budget fraction (at the last batch size and shard level)
        after them.
      may_skip: given the no-remat result of a batch size, whether the combinations it shows
        cannot be faster may be left out.
      shard_states: the shard levels, each with every combination in turn (dominance is judged
        within one level: a higher level moves more bytes than FLOPs show).
    """

    def __init__(
        self,
        policy_names: Sequence[str],
        batch_sizes: Sequence[int | None],
        usable_bytes: int,
        search: bool = False,
        may_skip: Callable[[Measurement], bool] = lambda baseline: False,
        shard_states: Sequence[str] = ("none",),
    ):
        self.jobs = [
            Job(p, b, shard_state=s)
            for s in shard_states
            for b in batch_sizes
            for p in policy_names
        ]
        self.usable_bytes = usable_bytes
        self.may_skip = may_skip
        self.search = None
        if search:
            self.search = BudgetSearch(usable_bytes, batch_sizes[-1], shard_state=shard_states[-1])
        self.config_error: Measurement | None = None
        self._results: dict[Job, Measurement] = {}
        self._pending = list(self.jobs)
        self._out: set[Job] = set()
        self._search_skipped = False

    @property
    def done(self) -> bool:
        """Whether every result the plan needs is in (or the config cannot be built)."""
        if self.config_error is not None:
            return True
        if self._pending or any(not job.search for job in self._out):
            return False
        return self.search is None or self._search_skipped or self.search.done

    @property
    def busy_jobs(self) -> set[Job]:
        """Jobs handed out whose results are still wanted."""
        return set(self._out)

    def next_job(self, width: int = 1) -> Job | None:
        """The next job to compile, or None when there is none to hand out now: all are out,
        or the budget search waits for its round. `width`: how many workers there are."""
        if self.config_error is not None:
            return None
        if self._pending:
            job = self._pending.pop(0)
            self._out.add(job)
            return job
        if self.search is None or self._search_skipped:
            return None
        job = self.search.next_job(width)
        if job is not None:
            self._out.add(job)
        return job

    def give_back(self, job: Job) -> None:
        """Takes back a job handed out that was never compiled (its worker could not start), to
        hand out again first."""
        if job not in self._out:
            return
        self._out.discard(job)
        if job.search:
            self.search.give_back(job)
        else:
            self._pending.insert(0, job)

    def record(self, job: Job, result: Measurement) -> None:
        """Takes a job's result; a result for a job left out meanwhile is dropped."""
        if job not in self._out:
            return
        self._out.discard(job)
        if result.stage == CONFIG_STAGE:  # the same for every combination: stop here
            self.config_error = result
            return
        if job.search:
            self.search.record(job, result)
        else:
            self._results[job] = result
        self._skip_dominated(job.batch_size, job.shard_state)

    def _skip_dominated(self, batch_size: int | None, shard_state: str) -> None:
        results = [
            (job, m)
            for job, m in self._results.items()
            if job.batch_size == batch_size and job.shard_state == shard_state and m.ok
        ]
        baseline = next((m for job, m in results if _is_no_remat(job.policy)), None)
        if baseline is None or not baseline.step_flops or not self.may_skip(baseline):
            return
        fast = [
            job
            for job, m in results
            if m.compiled_step_bytes <= self.usable_bytes and m.step_flops <= baseline.step_flops
        ]
        if not fast:
            return
        first = min(fast, key=self.jobs.index)
        reason = (
            f"skipped: {first.policy} fits with the FLOPs of no remat, which nothing listed "
            "after it can beat"
        )
        left_out = [
            job
            for job in self.jobs[self.jobs.index(first) + 1 :]
            if job.batch_size == batch_size
            and job.shard_state == shard_state
            and job not in self._results
        ]
        search_left = (
            self.search is not None
            and self.search.batch_size == batch_size
            and self.search.shard_state == shard_state
            and not self._search_skipped
        )
        if left_out or search_left:
            logging.info(
                "plan: %s fits with the FLOPs of no remat: leaving out %s",
                first.policy,
                ", ".join([job.policy for job in left_out] + ["the budget search"] * search_left),
            )
        for job in left_out:
            self._results[job] = Measurement(  # the batch size compiled, not None
                job.policy,
                baseline.batch_size,
                error=reason,
                stage=SKIPPED_STAGE,
                measure=Measure.COMPILE,
                shard_state=shard_state,
            )
            self._out.discard(job)
            if job in self._pending:
                self._pending.remove(job)
        if search_left:
            self._search_skipped = True
            self._out = {job for job in self._out if not job.search}

    def results(self) -> list[Measurement]:
        """Every combination's result in the order listed (a failure for one never compiled),
        then the fraction the budget search found, when it ran."""
        missing = "not compiled"
        if self.config_error is not None:
            missing = self.config_error.error
        out = [
            self._results.get(job)
            or Measurement(
                job.policy,
                job.batch_size,
                error=missing,
                stage=CONFIG_STAGE if self.config_error else None,
                measure=Measure.COMPILE,
                shard_state=job.shard_state,
            )
            for job in self.jobs
        ]
        if self.search is not None and not self._search_skipped and self.search.result:
            out.append(self.search.result)
        return out
