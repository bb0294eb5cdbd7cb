"""`planner.workers`: the compile worker pool on real processes, scripted to crash, hang or not
start (`compile_worker_stub.py` speaks the workers' protocol without TensorFlow, so each case
takes well under a second). The real workers are in test_plan.py."""

import collections
import dataclasses
import json
import sys
import time
import types

import pytest

from framework.planner import workers
from framework.planner.measurement import RUN_STAGE, SKIPPED_STAGE
from framework.planner.schedule import CompileSchedule
from framework.planner.spec import Measure, RunConfig, WorkerSpec
from tests.subprocesses import TESTS_DIR

PLANS = {
    "none": [1700, 100.0],
    "dots_saveable": [700, 100.0],
    "random_masks_saveable": [250, 120.0],
    "nothing_saveable": [280, 120.0],
}
POLICIES = list(PLANS)
SPEC = WorkerSpec(RunConfig(files=(), bindings=(), search_paths=()), Measure.COMPILE)


@pytest.fixture
def stub(monkeypatch, tmp_path):
    """Runs the pool on stub workers; returns a function (schedule, processes, timeout, **script)
    -> the log lines of every worker, as (pid, what) pairs."""
    logs = iter(tmp_path / f"log{i}" for i in range(100))
    stub_path = str(TESTS_DIR / "compile_worker_stub.py")

    def run(schedule, processes=1, timeout=60.0, **script):
        log = next(logs)
        stub_spec = json.dumps({"stub": {"plans": PLANS, "log": str(log), **script}})
        monkeypatch.setattr(
            workers, "_command", lambda spec: [sys.executable, stub_path, stub_spec]
        )
        workers.compile_in_workers(SPEC, schedule, processes, timeout)
        return [tuple(line.split(" ", 1)) for line in log.read_text().splitlines()]

    return run


def compiled_by(lines) -> dict[str, list[str]]:
    by_pid = collections.defaultdict(list)
    for pid, what in lines:
        if what != "start":
            by_pid[pid].append(what)
    return dict(by_pid)


def test_one_worker_compiles_every_combination_in_order(stub):
    schedule = CompileSchedule(POLICIES, [8], usable_bytes=1000)
    lines = stub(schedule)
    assert list(compiled_by(lines).values()) == [POLICIES]
    assert [m.compiled_step_bytes for m in schedule.results()] == [p[0] for p in PLANS.values()]


def test_workers_share_the_combinations(stub):
    schedule = CompileSchedule(POLICIES, [8], usable_bytes=1000)
    lines = stub(schedule, processes=2)
    shares = compiled_by(lines)
    assert len(shares) == 2 and sorted(sum(shares.values(), [])) == sorted(POLICIES)
    assert all(m.ok for m in schedule.results())


def test_a_crashed_job_fails_alone_and_a_new_worker_takes_the_rest(stub):
    schedule = CompileSchedule(POLICIES, [8], usable_bytes=1000)
    lines = stub(schedule, crash=["dots_saveable"])
    results = schedule.results()
    assert results[1].stage == RUN_STAGE
    assert results[1].error == "killed by SIGKILL (out of host memory?)"
    assert [m.ok for m in results] == [True, False, True, True]
    assert len(compiled_by(lines)) == 2  # the crashed worker and its replacement


def test_a_job_over_the_timeout_is_killed_and_fails(stub):
    schedule = CompileSchedule(POLICIES, [8], usable_bytes=1000)
    start = time.monotonic()
    stub(schedule, timeout=2.0, hang=["random_masks_saveable"])
    assert time.monotonic() - start < 30
    results = schedule.results()
    assert results[2].error == "timed out after 2 s"
    assert [m.ok for m in results] == [True, True, False, True]


def test_a_worker_that_cannot_start_fails_every_job_with_its_reason_once(stub):
    schedule = CompileSchedule(POLICIES, [8], usable_bytes=1000, search=True)
    lines = stub(schedule, processes=2, start_error="ImportError: no module named tensorflow")
    results = schedule.results()
    assert all(m.error == "exit status 3: ImportError: no module named tensorflow" for m in results)
    assert len(results) == len(POLICIES) + 1  # the search's own failure at fraction 0
    # Not one worker per job: no worker is started again after one failed to start.
    assert len([what for _, what in lines if what == "start"]) <= 2


def test_a_worker_that_cannot_start_beside_another_gives_its_job_back(stub, tmp_path):
    """As on a TPU host, whose chips take one process: the second worker fails to start, the
    first compiles everything, and no combination fails for it."""
    schedule = CompileSchedule(POLICIES, [8], usable_bytes=1000)
    lines = stub(schedule, processes=2, device_lock=str(tmp_path / "tpu"))
    assert all(m.ok for m in schedule.results())
    assert len([what for _, what in lines if what == "start"]) == 2
    (compiled,) = compiled_by(lines).values()
    assert sorted(compiled) == sorted(POLICIES)


def test_a_crash_after_a_worker_could_not_start_is_replaced(stub, tmp_path):
    """The worker that holds the device crashes: the device is free again, so a new worker
    takes the rest (the one that could not start beside it stopped the pool from growing,
    not from replacing)."""
    schedule = CompileSchedule(POLICIES, [8], usable_bytes=1000)
    lines = stub(
        schedule, processes=2, device_lock=str(tmp_path / "tpu"), crash=["random_masks_saveable"]
    )
    results = schedule.results()
    assert [m.ok for m in results] == [True, True, False, True]
    assert results[2].error == "killed by SIGKILL (out of host memory?)"
    assert len(compiled_by(lines)) == 2


def test_a_worker_left_with_an_unwanted_job_is_stopped_at_once(stub):
    """dots_saveable fits with the FLOPs of no remat: the workers still compiling what comes
    after it are stopped, not waited for."""
    schedule = CompileSchedule(POLICIES, [8], 1000, search=True, may_skip=lambda baseline: True)
    start = time.monotonic()
    hang = ["random_masks_saveable", "nothing_saveable"]
    stub(schedule, processes=3, timeout=300.0, hang=hang)
    assert time.monotonic() - start < 30
    results = schedule.results()
    assert [m.stage for m in results[2:]] == [SKIPPED_STAGE, SKIPPED_STAGE]
    assert len(results) == len(POLICIES)  # no search: it could not beat dots_saveable either


def test_the_automatic_pool_adds_workers_one_at_a_time_while_memory_allows(stub, monkeypatch):
    monkeypatch.setattr(workers, "usable_cores", lambda: 8)
    monkeypatch.setattr(workers, "host_available_bytes", lambda: 2**40)
    started = []
    add = workers._Pool.add

    def counting_add(pool):  # how many were starting (not ready) when one more was added
        started.append(sum(not w.ready for w in pool.workers))
        return add(pool)

    monkeypatch.setattr(workers._Pool, "add", counting_add)
    schedule = CompileSchedule(POLICIES, [8], usable_bytes=1000)
    assert len(compiled_by(stub(schedule, processes=0))) >= 2
    assert all(m.ok for m in schedule.results())
    assert started[0] == 0 and max(started) == 0, started  # never two starting at once
    monkeypatch.setattr(workers, "host_available_bytes", lambda: 2**20)  # less than a worker
    schedule = CompileSchedule(POLICIES, [8], usable_bytes=1000)
    assert len(compiled_by(stub(schedule, processes=0))) == 1


def test_a_tpu_target_adds_a_worker_only_once_one_has_compiled(monkeypatch):
    """The TPU compiler takes many times what building the model did, so the first build's
    peak says nothing about a second worker's room: the pool waits for a compilation's."""
    monkeypatch.setattr(workers, "host_available_bytes", lambda: 20 * 2**30)
    ready = types.SimpleNamespace(ready=True)
    for target, compiled, grows in [(None, 0, True), ("v5e", 0, False), ("v5e", 2**30, True)]:
        spec = dataclasses.replace(SPEC, target=target)
        pool = workers._Pool(spec, 2, automatic=True, workers=[ready])
        pool.built_peak_bytes, pool.compiled_peak_bytes = 2**30, compiled
        assert pool.may_grow() is grows, (target, compiled)
