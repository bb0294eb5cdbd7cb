"""`planner.schedule`: what the compile workers are handed, and what is left out. The plans here
are given as (bytes, FLOPs) per policy, so every rule is checked without compiling; the same
rules on real workers and a real config are in test_plan_workers.py and test_plan.py."""

import dataclasses
import itertools
import random

import pytest

from framework import planner
from framework.planner import Measurement
from framework.planner.measurement import CONFIG_STAGE, SKIPPED_STAGE
from framework.planner.schedule import CompileSchedule
from framework.planner.spec import Measure

POLICIES = [
    "none",
    "dots_saveable+random_masks_saveable",
    "dots_saveable",
    "random_masks_saveable",
    "nothing_saveable",
]


def compiled(policy: str, batch_size: int, num_bytes: int, flops: float) -> Measurement:
    return Measurement(
        policy,
        batch_size,
        compiled_peak_bytes=num_bytes,
        state_bytes=0,
        step_flops=flops,
        peak_flops=1e9,
        measure=Measure.COMPILE,
    )


def budget_plan(policy: str, batch_size: int) -> Measurement:
    """At batch size 8 a budget fraction F plans 1000 + 1000 F bytes and 110 - 10 F FLOPs
    (more kept, less recomputed, never fewer than no remat's 100); both grow with the batch."""
    fraction = float(policy.removeprefix("budget:"))
    scale = batch_size / 8
    return compiled(
        policy, batch_size, round((1000 + 1000 * fraction) * scale), (110 - 10 * fraction) * scale
    )


def run(schedule: CompileSchedule, plan, workers: int = 1, seed: int | None = None) -> list[str]:
    """Drives `schedule` as `workers` workers would, the job out longest finishing first (or,
    with a `seed`, a random one); returns the policies compiled, in the order handed out."""
    rng = random.Random(seed)
    out, handed = [], []
    while not schedule.done:
        while len(out) < workers and (job := schedule.next_job(workers)) is not None:
            out.append(job)
            handed.append(job.policy)
        assert out, "the schedule waits with nothing out"
        job = out.pop(0 if seed is None else rng.randrange(len(out)))
        schedule.record(job, plan(job.policy, job.batch_size or 8))
    return handed


def test_the_search_finds_the_largest_fitting_fraction_on_its_grid():
    for workers in (1, 2, 3):
        search = CompileSchedule([], [8], usable_bytes=1700, search=True)
        handed = run(search, budget_plan, workers)
        (found,) = search.results()
        assert found.policy == "budget:0.7", (workers, handed)  # 1700 bytes exactly
        assert handed[0] == "budget:1"
        rounds = 1 + 6 if workers == 1 else 1 + 4  # halving vs. splitting in three or more
        assert len(handed) <= workers * rounds, handed


def test_the_search_compiles_once_when_the_whole_budget_fits():
    search = CompileSchedule([], [8], usable_bytes=2000, search=True)
    assert run(search, budget_plan) == ["budget:1"]
    assert search.results()[0].policy == "budget:1"


def test_the_search_returns_the_failure_at_zero_when_nothing_fits():
    search = CompileSchedule([], [8], usable_bytes=900, search=True)
    handed = run(search, budget_plan, workers=2)
    (found,) = search.results()
    assert found.policy == "budget:0" and "budget:0" in handed[-2:]
    assert found.compiled_step_bytes == 1000 > 900


def plans(table: dict[str, tuple[int, float]], efficiency: dict[int, float] | None = None):
    """Plans from (bytes, FLOPs) at batch size 8, both growing with the batch; `efficiency`
    scales every FLOP count of a batch size alike (a larger batch may be faster per example)."""

    def plan(policy: str, batch_size: int) -> Measurement:
        scale = (efficiency or {}).get(batch_size, 1.0)
        if policy.startswith("budget:"):
            m = budget_plan(policy, batch_size)
            return dataclasses.replace(m, step_flops=m.step_flops * scale)
        num_bytes, flops = table[policy]
        return compiled(
            policy, batch_size, num_bytes * batch_size // 8, flops * batch_size / 8 * scale
        )

    return plan


# none does not fit; dots+masks fits with no recomputed products (the headline case's shape).
HEADLINE = {
    "none": (1700, 100.0),
    "dots_saveable+random_masks_saveable": (700, 100.0),
    "dots_saveable": (720, 100.0),
    "random_masks_saveable": (250, 120.0),
    "nothing_saveable": (280, 120.0),
}


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_what_fits_with_the_flops_of_no_remat_ends_its_batch_size(workers):
    schedule = CompileSchedule(
        POLICIES, [8], usable_bytes=1400, search=True, may_skip=lambda baseline: True
    )
    handed = run(schedule, plans(HEADLINE), workers)
    # The two it takes, and what the other workers took meanwhile.
    assert handed[:2] == POLICIES[:2] and len(handed) <= max(2, workers + 1)
    results = schedule.results()
    assert [m.policy for m in results] == POLICIES  # no search row: it cannot win either
    assert [m.stage for m in results[2:]] == [SKIPPED_STAGE] * 3
    assert "dots_saveable+random_masks_saveable fits with the FLOPs of no remat" in results[2].error
    assert all(m.batch_size == 8 for m in results)
    exhaustive = [plans(HEADLINE)(p, 8) for p in POLICIES]
    pick = planner.choose(results, 1400 / 0.9).pick
    assert pick.policy == planner.choose(exhaustive, 1400 / 0.9).pick.policy == POLICIES[1]


def test_the_pick_is_the_same_as_compiling_everything():
    """For random plans, budgets and batch sizes, the plan with skipping picks what the plan
    of every combination (and the budget search) picks."""
    rng = random.Random(1)
    batch_sizes = [8, 16]
    for trial in range(200):
        base = rng.uniform(800, 2000)
        table = {"none": (int(base), 100.0)}
        for policy in POLICIES[1:]:
            extra = rng.choice([0.0, rng.uniform(5, 40)])
            table[policy] = (int(base * rng.uniform(0.1, 1.1)), 100.0 + extra)
        # Per example, batch 16 is up to 6% slower or faster than 8: within the tie tolerance
        # or just beyond it.
        plan = plans(table, {16: rng.uniform(0.94, 1.06)})
        usable = int(rng.uniform(100, 2500))
        budget = usable / 0.9 + 1
        full = CompileSchedule(POLICIES, batch_sizes, usable, search=True)
        run(full, plan)
        lean = CompileSchedule(POLICIES, batch_sizes, usable, True, lambda baseline: True)
        run(lean, plan, workers=2, seed=trial)
        full_pick = planner.choose(full.results(), budget).pick
        lean_pick = planner.choose(lean.results(), budget).pick
        assert (full_pick and full_pick.label) == (lean_pick and lean_pick.label), (trial, table)


def test_nothing_is_left_out_unless_allowed_or_without_a_no_remat_baseline():
    plan = plans(HEADLINE)
    for schedule in (
        CompileSchedule(POLICIES, [8], usable_bytes=1400),  # run-measured: no skipping
        CompileSchedule(POLICIES[1:], [8], 1400, may_skip=lambda baseline: True),  # no none
    ):
        handed = run(schedule, plan)
        assert handed == schedule_policies(schedule)
        assert all(m.ok for m in schedule.results())


def schedule_policies(schedule: CompileSchedule) -> list[str]:
    return [job.policy for job in schedule.jobs]


def test_a_fit_that_recomputes_products_leaves_nothing_out():
    table = {**HEADLINE, "dots_saveable+random_masks_saveable": (700, 101.0)}
    table["dots_saveable"] = (1500, 100.0)  # no recomputed products, but does not fit
    schedule = CompileSchedule(POLICIES, [8], 1400, may_skip=lambda baseline: True)
    assert run(schedule, plans(table)) == POLICIES


def test_a_result_for_a_job_left_out_meanwhile_is_dropped():
    schedule = CompileSchedule(POLICIES, [8], 1400, may_skip=lambda baseline: True)
    jobs = [schedule.next_job(3) for _ in range(3)]
    assert [j.policy for j in jobs] == POLICIES[:3]
    plan = plans(HEADLINE)
    schedule.record(jobs[1], plan(jobs[1].policy, 8))
    schedule.record(jobs[0], plan(jobs[0].policy, 8))
    assert schedule.done and schedule.busy_jobs == set()
    schedule.record(jobs[2], plan(jobs[2].policy, 8))  # late: its row stays skipped
    assert schedule.results()[2].stage == SKIPPED_STAGE


def test_a_config_error_ends_the_schedule():
    schedule = CompileSchedule(POLICIES, [8, 16], 1400, search=True)
    job = schedule.next_job()
    schedule.record(job, Measurement(job.policy, 8, error="bad binding", stage=CONFIG_STAGE))
    assert schedule.done and schedule.next_job() is None
    results = schedule.results()
    assert len(results) == len(POLICIES) * 2
    assert all(m.stage == CONFIG_STAGE and m.error == "bad binding" for m in results)


def test_every_batch_size_is_judged_on_its_own():
    schedule = CompileSchedule(POLICIES, [8, 64], 1400, search=True, may_skip=lambda b: True)
    run(schedule, plans(HEADLINE))
    results = {(m.policy, m.batch_size): m for m in schedule.results()}
    skipped = {key for key, m in results.items() if m.stage == SKIPPED_STAGE}
    # At 8 dots+masks ends it; at 64 (8x the bytes) nothing fits, so everything is compiled and
    # the budget search runs.
    assert skipped == set(itertools.product(POLICIES[2:], [8]))
    assert any(policy.startswith("budget:") for policy, _ in results)


def test_the_budget_prefix_is_the_policies_own():
    from framework.planner import schedule
    from framework.remat import policies

    assert schedule.BUDGET_PREFIX == policies.BUDGET_PREFIX


def test_a_compiled_step_counts_the_whole_block_of_temporaries():
    """XLA:CPU allocates its temporaries as one block, larger than what is live at their peak
    (quickstart.gin at depth 2, batch 128, no remat: 91.5 MiB against 74.9), and a pick judged
    by the live bytes trained above its budget; a TPU plan's peak (with its code) is larger."""
    cpu = Measurement(
        "none",
        8,
        compiled_total_bytes=130,
        compiled_peak_bytes=100,
        state_bytes=5,
        measure=Measure.COMPILE,
    )
    tpu = dataclasses.replace(cpu, compiled_total_bytes=100, compiled_peak_bytes=120)
    assert (cpu.compiled_step_bytes, tpu.compiled_step_bytes) == (135, 125)
