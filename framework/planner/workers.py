"""Child processes of the planner: one per run-measured combination (`run_child`), and a pool
of compile workers (`compile_in_workers`) that each build the trainer once and read XLA's plan
of the combinations a `CompileSchedule` hands them, one after another.

A child process because the CPU allocator must be chosen before TensorFlow starts
(`TF_CPU_ALLOCATOR_USE_BFC=true`), its statistics and XLA's flags belong to the process, and a
combination that crashes or runs the host out of memory must take nothing else down with it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time

from framework.planner.measurement import READY, RUN_STAGE, Measurement
from framework.planner.schedule import CompileSchedule, Job
from framework.planner.spec import Measure, WorkerSpec

# An automatic pool adds a worker while the host's available memory is at least this many times
# the largest peak resident memory of a worker: once one has compiled, its peak over building
# the model and optimizer state and compiling; before that, its peak at building, assuming the
# compilation at most doubles it.
MEMORY_HEADROOM = 1.25
BUILT_HEADROOM = 2.0


def _env(spec: WorkerSpec) -> dict[str, str]:
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if spec.target:
        # A step planned for a named device is built on this host's CPU: a worker never claims
        # a GPU of this host (the run, or the other workers, need it).
        env["CUDA_VISIBLE_DEVICES"] = "-1"
    return env


def _command(spec: WorkerSpec) -> list[str]:
    return [sys.executable, "-m", "framework.planner.child", json.dumps(spec.to_json())]


def failure_message(returncode: int, stderr: str) -> str:
    """Why a child ended badly, in one line: its signal, or its exit status and last line."""
    if returncode < 0:
        name = signal.Signals(-returncode).name
        hint = " (out of host memory?)" if returncode == -signal.SIGKILL else ""
        return f"killed by {name}{hint}"
    lines = [line for line in stderr.splitlines() if line.strip()]
    return f"exit status {returncode}: {lines[-1].strip() if lines else 'no output'}"[:300]


def run_child(spec: WorkerSpec, timeout: float) -> tuple[list[Measurement], str | None]:
    """Runs `framework.planner.child` on `spec` in a fresh process: its results (one JSON
    line each), and what went wrong when it did not end well."""
    try:
        proc = subprocess.run(
            _command(spec),
            env=_env(spec),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return [], f"timed out after {timeout:.0f} s"
    results = [
        Measurement.from_json(json.loads(line))
        for line in proc.stdout.splitlines()
        if line.startswith("{")
    ]
    return results, None if proc.returncode == 0 else failure_message(proc.returncode, proc.stderr)


def host_available_bytes() -> int | None:
    """The memory the host can still give (Linux's MemAvailable), or None where unknown."""
    return _meminfo_bytes("/proc/meminfo", "MemAvailable:")


def _meminfo_bytes(path: str, key: str) -> int | None:
    try:
        with open(path) as lines:
            for line in lines:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def usable_cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class _Worker:
    """One compile worker process, fed jobs on stdin; its results arrive as lines on stdout."""

    def __init__(self, spec: WorkerSpec):
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            _command(spec),
            env=_env(spec),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
        )
        self.ready = False
        self.job: Job | None = None
        self.deadline = self.sent = float("inf")
        self._buffer = b""

    def send(self, job: Job, timeout: float) -> bool:
        """Hands the worker `job`; False when the process is gone (its input is closed)."""
        line = json.dumps(job.combination.to_json())
        try:
            self.proc.stdin.write(line.encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:
            return False
        self.sent = time.monotonic()
        self.job, self.deadline = job, self.sent + timeout
        return True

    def read(self) -> list[dict] | None:
        """The protocol's lines that arrived (JSON objects), or None when the process closed its
        output (it ended). Anything else on the pipe is skipped."""
        data = os.read(self.proc.stdout.fileno(), 1 << 16)
        if not data:
            return None
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        messages = []
        for line in lines:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if isinstance(message, dict):
                messages.append(message)
        return messages

    def peak_resident_bytes(self) -> int | None:
        return _meminfo_bytes(f"/proc/{self.proc.pid}/status", "VmHWM:")

    def failure(self) -> str:
        """Why the process ended (killing it when it has not after closing its output)."""
        self._reap()
        self._stderr.seek(0)
        return failure_message(self.proc.returncode, self._stderr.read().decode(errors="replace"))

    def stop(self) -> None:
        """Ends the process: at once when it is compiling, else by closing its input."""
        if self.job is not None:
            self.proc.kill()
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        self._reap()
        self.proc.stdout.close()
        self._stderr.close()

    def _reap(self) -> None:
        """Waits for the process to end, killing it when it has not within 10 s."""
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclasses.dataclass
class _Pool:
    """The workers and the rule for adding one: `processes` at most. With `automatic`, one more
    only while every worker is ready (so the memory read counts what each holds) and the host
    has `MEMORY_HEADROOM` times a worker's peak available (`BUILT_HEADROOM` before any has
    compiled; for a TPU target, none before one has). A worker that cannot start beside the
    others caps `processes` at those."""

    spec: WorkerSpec
    processes: int
    automatic: bool
    workers: list[_Worker] = dataclasses.field(default_factory=list)
    built_peak_bytes: int = 0
    compiled_peak_bytes: int = 0
    startup_failure: str | None = None

    def may_grow(self) -> bool:
        if self.startup_failure is not None or len(self.workers) >= self.processes:
            return False
        if not self.workers or not self.automatic:
            return True
        if not all(w.ready for w in self.workers):
            return False
        if self.compiled_peak_bytes:
            needed = MEMORY_HEADROOM * self.compiled_peak_bytes
        elif self.spec.target:
            # The TPU and GPU compilers take many times what building the model did (ViT-B/16
            # for a TPU: 10.9 GB against 0.9 GB): wait for the first compilation's peak.
            return False
        else:
            needed = BUILT_HEADROOM * self.built_peak_bytes
        available = host_available_bytes()
        return available is not None and available >= needed

    def add(self) -> _Worker:
        worker = _Worker(self.spec)
        self.workers.append(worker)
        logging.info("plan: compile worker %d started", len(self.workers))
        return worker


def compile_in_workers(
    spec: WorkerSpec, schedule: CompileSchedule, processes: int, timeout: float
) -> None:
    """Compiles what `schedule` hands out in worker processes until it is done.

    `processes` workers at most; 0 means as many as there are cores, added one at a time while
    the host has the memory one more needs (see `_Pool`). A job that fails, crashes its worker
    or runs over `timeout` seconds (a worker's first job includes building its trainer) becomes a
    failed result and the worker is replaced. A worker that ends before its trainer is built,
    beside others, gives its job back and caps the pool at those (a TPU host's chips take one
    process); alone, it fails every job left with its reason, since the next would fail alike.
    Workers whose jobs are no longer wanted are stopped at once.
    """
    automatic = processes == 0
    pool = _Pool(spec, usable_cores() if automatic else processes, automatic)
    selector = selectors.DefaultSelector()
    try:
        while not schedule.done:
            _hand_out(pool, schedule, selector, timeout)
            busy = [w for w in pool.workers if w.job is not None]
            if not busy:
                if pool.startup_failure is None:
                    raise RuntimeError("the compile schedule waits with no job out")
                _fail_rest(schedule, pool.startup_failure)
                return
            wait = min(w.deadline for w in busy) - time.monotonic()
            for key, _ in selector.select(timeout=max(0.0, wait)):
                _receive(pool, schedule, selector, key.data)
            for worker in busy:
                if worker.job is not None and time.monotonic() > worker.deadline:
                    _end(pool, schedule, selector, worker, f"timed out after {timeout:.0f} s")
    finally:
        for worker in pool.workers:
            worker.stop()
        selector.close()


def _hand_out(pool: _Pool, schedule: CompileSchedule, selector, timeout: float) -> None:
    """Gives every idle worker a job, starting workers while jobs are left and the pool may
    grow; drops the jobs of workers whose results are no longer wanted."""
    for worker in list(pool.workers):
        if worker.job is not None and worker.job not in schedule.busy_jobs:
            _end(pool, schedule, selector, worker, None)
    while True:
        idle = [w for w in pool.workers if w.job is None]
        grow = pool.may_grow()
        if not idle and not grow:
            return
        job = schedule.next_job(len(pool.workers) + grow)
        if job is None:
            return
        if idle:
            worker = idle[0]
        else:
            worker = pool.add()
            selector.register(worker.proc.stdout, selectors.EVENT_READ, worker)
        if not worker.send(job, timeout):  # it ended while idle: the next takes the job
            schedule.give_back(job)
            _end(pool, schedule, selector, worker, None)


def _receive(pool: _Pool, schedule: CompileSchedule, selector, worker: _Worker) -> None:
    lines = worker.read()
    if lines is None:
        _end(pool, schedule, selector, worker, worker.failure())
        return
    for line in lines:
        peak = worker.peak_resident_bytes() or 0
        if line == READY:
            worker.ready = True
            pool.built_peak_bytes = max(pool.built_peak_bytes, peak)
        elif worker.job is not None:
            job, worker.job = worker.job, None
            result = Measurement.from_json(line)
            _log_result(result, time.monotonic() - worker.sent)
            schedule.record(job, result)
            pool.compiled_peak_bytes = max(pool.compiled_peak_bytes, peak)


def _log_result(result: Measurement, seconds: float) -> None:
    from framework.memory import format_bytes

    planned = format_bytes(result.compiled_step_bytes) if result.ok else f"nothing ({result.error})"
    logging.info("plan: %s: XLA plans %s per device (%.0f s)", result.label, planned, seconds)


def _end(pool: _Pool, schedule, selector, worker: _Worker, failure: str | None) -> None:
    """Stops a worker; its job, if any, fails with `failure` (None: no longer wanted)."""
    if worker not in pool.workers:  # ended already (its output closed, then its deadline)
        return
    job, ready = worker.job, worker.ready
    selector.unregister(worker.proc.stdout)
    if failure is not None:
        worker.proc.kill()
    worker.stop()
    worker.job = None
    pool.workers.remove(worker)
    if job is None or failure is None:
        return
    if not ready:
        logging.info("plan: a compile worker could not start: %s", failure)
        if pool.workers:  # the others compile it (a TPU, e.g., takes one process only)
            pool.processes = len(pool.workers)
            schedule.give_back(job)
            return
        pool.startup_failure = failure
    result = _failed(job, failure)
    _log_result(result, time.monotonic() - worker.sent)
    schedule.record(job, result)


def _failed(job: Job, failure: str) -> Measurement:
    return Measurement(
        job.policy,
        job.batch_size,
        error=failure,
        stage=RUN_STAGE,
        measure=Measure.COMPILE,
        shard_state=job.shard_state,
    )


def _fail_rest(schedule: CompileSchedule, failure: str) -> None:
    """Every job not yet compiled fails with `failure` (no worker could start)."""
    while (job := schedule.next_job()) is not None:
        schedule.record(job, _failed(job, failure))
