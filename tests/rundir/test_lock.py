"""framework.rundir.lock: one writer per model_dir, held by real processes, taken over when
stale."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from framework.rundir import lock as run_lock
from tests.subprocesses import child_env

HOLD = """
import sys, time
from framework.rundir import lock as run_lock
lock = run_lock.RunLock(sys.argv[1], use_flock=sys.argv[2] == "flock", lease_seconds=60)
try:
    lock.acquire()
except run_lock.LockError as error:
    print("held:", error, flush=True)
    sys.exit(2)
print("acquired", flush=True)
time.sleep(float(sys.argv[3]))
"""


def hold(model_dir, mode: str, seconds: float = 0) -> subprocess.Popen:
    """A process that takes the lock of model_dir and keeps it `seconds`."""
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(HOLD), str(model_dir), mode, str(seconds)],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def first_line(process: subprocess.Popen) -> str:
    return process.stdout.readline().strip()


@pytest.mark.slow
def test_a_second_run_is_refused_naming_the_holder_and_a_killed_holder_is_taken_over(tmp_path):
    mode = "flock"
    holder = hold(tmp_path, mode, seconds=60)
    try:
        assert first_line(holder) == "acquired"
        second = hold(tmp_path, mode)
        out, err = second.communicate(timeout=60)
        assert second.returncode == 2, err
        assert f"pid {holder.pid} on" in out and "in use by another run" in out
        assert "remove" not in out  # a flock is held by a running process only
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    third = hold(tmp_path, mode)
    out, err = third.communicate(timeout=60)
    assert third.returncode == 0 and out.strip() == "acquired", err
    assert "took over" in err and f"pid {holder.pid}" in err


def test_a_released_lock_is_taken_without_a_warning(tmp_path, caplog):
    first = run_lock.RunLock(str(tmp_path))
    first.acquire()
    first.release()
    assert json.loads((tmp_path / "LOCK").read_text())["released"] is True
    second = run_lock.RunLock(str(tmp_path))
    second.acquire()
    second.release()
    assert "took over" not in caplog.text


def test_a_new_lock_in_the_same_process_takes_over_and_the_old_one_fails_its_check(tmp_path):
    old = run_lock.RunLock(str(tmp_path))
    old.acquire()
    new = run_lock.RunLock(str(tmp_path))
    new.acquire()
    new.check()
    with pytest.raises(run_lock.LockError, match="a later Trainer of this process"):
        old.check()
    assert json.loads((tmp_path / "LOCK").read_text())["token"] == new.holder.token
    new.release()


@pytest.mark.parametrize("change", ["removed", "replaced"])
def test_a_flocked_lock_whose_file_is_removed_or_replaced_fails_its_check(tmp_path, change):
    """Removing LOCK under a live run lets another run take a new file: the first must stop
    before its next save rather than write beside the other."""
    lock = run_lock.RunLock(str(tmp_path), use_flock=True)
    lock.acquire()
    lock.check()
    (tmp_path / "LOCK").unlink()
    if change == "replaced":
        write_lock(tmp_path / "LOCK")
    with pytest.raises(run_lock.LockError, match="was removed or replaced while this run held"):
        lock.check()
    lock.release()


def write_lock(path, **fields) -> None:
    now = time.time()
    holder = dict(host="another-host", pid=1, started=now, heartbeat=now, command="x", token="t")
    path.write_text(json.dumps({**holder, **fields}))


def test_a_lease_of_another_host_holds_until_its_heartbeat_is_older_than_the_lease(tmp_path):
    write_lock(tmp_path / "LOCK")
    lease = run_lock.RunLock(str(tmp_path), use_flock=False, lease_seconds=60)
    with pytest.raises(run_lock.LockError, match="pid 1 on another-host"):
        lease.acquire()
    write_lock(tmp_path / "LOCK", heartbeat=time.time() - 61)
    lease.acquire()
    lease.check()
    write_lock(tmp_path / "LOCK", token="someone else")
    with pytest.raises(run_lock.LockError, match="another run took over"):
        lease.check()
    lease.release()
    assert json.loads((tmp_path / "LOCK").read_text())["token"] == "someone else"


def test_a_lease_whose_process_is_gone_from_this_host_is_taken_over(tmp_path, caplog):
    dead = subprocess.Popen(["true"])  # its pid then names no running process
    dead.wait()
    write_lock(tmp_path / "LOCK", host=socket.gethostname(), pid=dead.pid)
    lease = run_lock.RunLock(str(tmp_path), use_flock=False, lease_seconds=600)
    lease.acquire()
    assert "took over the stale lock" in caplog.text and f"pid {dead.pid}" in caplog.text
    other = tmp_path / "other"
    other.mkdir()
    alive = subprocess.Popen(["sleep", "60"])
    try:
        write_lock(other / "LOCK", host=socket.gethostname(), pid=alive.pid)
        live = run_lock.RunLock(str(other), use_flock=False, lease_seconds=600)
        with pytest.raises(run_lock.LockError, match=f"pid {alive.pid}"):
            live.acquire()
    finally:
        alive.kill()
        alive.wait()
    # This process' own pid in a lock it does not hold: an earlier process (a restarted
    # container keeps its host name and often its pid).
    write_lock(other / "LOCK", host=socket.gethostname(), pid=os.getpid())
    live.acquire()
    live.release()
    lease.release()


def test_a_lease_is_renewed_while_its_run_lives(tmp_path):
    lease = run_lock.RunLock(str(tmp_path), use_flock=False, lease_seconds=0.5)
    lease.acquire()
    first = json.loads((tmp_path / "LOCK").read_text())["heartbeat"]
    time.sleep(0.5)
    assert json.loads((tmp_path / "LOCK").read_text())["heartbeat"] > first
    lease.release()
