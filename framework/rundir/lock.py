"""One writer per model_dir: a `LOCK` file that a run's chief takes before it writes anything.

A double-submitted job, or a resume started while the old run still trains, would otherwise
interleave two runs' checkpoints in one directory. The lock file holds who took it (host, pid,
start time, command), so the second run stops with one line naming the holder.

- On a local or NFS directory the file is held with `flock`: the kernel releases it when the
  holder's process ends, however it ends, so a lock left by a killed run is free at once and is
  taken over with a warning.
- On other filesystems (`gs://`, ...) nothing is held open: the lock is a lease. Its holder rewrites
  the file every `lease_seconds / 5`; a lock whose heartbeat is older than `lease_seconds`, or
  whose process is gone from this very host, is stale and is taken over with a warning. Object
  stores give `tf.io.gfile` no create-if-absent, so two runs that start within the same second
  can both write the file: each reads it back after a pause and only the one it names goes on,
  and `check()` (called before every checkpoint save) stops a run whose lock was taken over.

Within one process, a new lock on the same directory (a notebook re-creating its `Trainer`)
takes over from the old one, whose `check()` then fails.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import fcntl
import json
import logging
import os
import shlex
import socket
import sys
import threading
import time
import uuid

import tensorflow as tf

from framework.core import files
from framework.core.errors import FrameworkError

LOCK_FILE = "LOCK"
DEFAULT_LEASE_SECONDS = 300.0
SETTLE_SECONDS = 1.0  # how long a lease waits before reading back that it holds the lock

_held: dict[str, RunLock] = {}  # lock path -> the lock this process holds there


class LockError(FrameworkError):
    """Another run holds (or took over) the model_dir: a problem the user can fix."""


@dataclasses.dataclass(frozen=True)
class Holder:
    """What a lock file says about the run that holds it."""

    host: str
    pid: int
    started: float
    heartbeat: float
    command: str
    token: str
    released: bool = False

    def describe(self) -> str:
        started = datetime.datetime.fromtimestamp(self.started, datetime.timezone.utc)
        return (
            f"pid {self.pid} on {self.host}, started {started:%Y-%m-%d %H:%M:%S} UTC: "
            f"{self.command}"
        )

    def is_gone(self) -> bool:
        """Whether the holder was a process on this host that no longer runs."""
        if self.host != socket.gethostname():
            return False
        if self.pid == os.getpid():  # an earlier process of this pid (a restarted container)
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, another user's
            return False
        return False


def _parse(data: str | bytes) -> Holder | None:
    try:
        return Holder(**json.loads(data))
    except (ValueError, TypeError):
        return None


class RunLock:
    """The lock of one model_dir. `acquire()` takes it or raises `LockError` naming the holder."""

    def __init__(
        self,
        model_dir: str,
        *,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        command: str | None = None,
        use_flock: bool | None = None,
    ):
        if lease_seconds <= 0:
            raise ValueError(f"lease_seconds must be positive, got {lease_seconds}")
        self.model_dir = model_dir
        self.path = files.join(model_dir, LOCK_FILE)
        self.lease_seconds = lease_seconds
        self.use_flock = files.is_local(model_dir) if use_flock is None else use_flock
        now = time.time()
        self.holder = Holder(
            host=socket.gethostname(),
            pid=os.getpid(),
            started=now,
            heartbeat=now,
            command=command or shlex.join(sys.argv),
            token=uuid.uuid4().hex,
        )
        self._fd: int | None = None
        self._lost: str | None = None
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def acquire(self) -> None:
        """Takes the lock, taking over a stale one with a warning; raises LockError if held."""
        tf.io.gfile.makedirs(self.model_dir)
        previous = _held.get(self.path)
        if previous is not None:
            logging.info("taking over %s from an earlier Trainer of this process", self.path)
            self._fd = previous._hand_over(f"a later Trainer of this process took {self.path}")
            self._write()
        elif self.use_flock:
            self._acquire_flock()
        else:
            self._acquire_lease()
        if not self.use_flock:
            self._heartbeat = threading.Thread(
                target=self._beat, daemon=True, name="run-lock-heartbeat"
            )
            self._heartbeat.start()
        _held[self.path] = self
        atexit.register(self.release)

    def check(self) -> None:
        """Raises LockError if this lock is no longer held (taken over by another run, or its
        flocked file removed or replaced, which lets another run take a new one)."""
        if self._lost is None and self._fd is not None and not self._flocked_file_is_there():
            self._lost = f"{self.path} was removed or replaced while this run held it"
        if self._lost is None and not self.use_flock:
            try:
                current = self._read()
            except tf.errors.OpError as error:  # unknown is not lost: the next check reads again
                logging.warning("cannot read the lock %s: %s", self.path, error.message)
                return
            if current is None or current.token != self.holder.token:
                holder = current.describe() if current else "its file is gone"
                self._lost = f"another run took over {self.path} ({holder})"
        if self._lost is not None:
            raise LockError(f"{self._lost}; this run stops without saving")

    def _flocked_file_is_there(self) -> bool:
        try:
            return os.stat(self.path.removeprefix("file://")).st_ino == os.fstat(self._fd).st_ino
        except FileNotFoundError:
            return False

    def release(self) -> None:
        """Marks the lock released (a next run takes it without a warning) and lets it go."""
        if _held.get(self.path) is not self:
            return
        del _held[self.path]
        self._stop_heartbeat()
        self.holder = dataclasses.replace(self.holder, released=True)
        try:
            if self._lost is None and (self.use_flock or self._owns_file()):
                self._write()
        except tf.errors.OpError as error:  # at exit: the lease runs out by itself
            logging.warning("cannot release the lock %s: %s", self.path, error.message)
        finally:
            if self._fd is not None:
                os.close(self._fd)  # closing also drops the flock
                self._fd = None

    def _hand_over(self, reason: str) -> int | None:
        """Gives up this lock to a new one in the same process: returns the flock descriptor."""
        self._lost = reason
        self._stop_heartbeat()
        fd, self._fd = self._fd, None
        _held.pop(self.path, None)
        return fd

    def _stop_heartbeat(self) -> None:
        """Stops the lease's heartbeat and waits for a write it may be doing."""
        self._stop.set()
        if self._heartbeat is not None and self._heartbeat is not threading.current_thread():
            self._heartbeat.join()

    def _acquire_flock(self) -> None:
        path = self.path.removeprefix("file://")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            # The holder writes who it is right after taking the lock: give it a moment.
            for _ in range(20):
                holder = _parse(os.pread(fd, 1 << 16, 0).decode(errors="replace"))
                if holder is not None:
                    break
                time.sleep(0.05)
            os.close(fd)
            raise LockError(self._held_message(holder)) from None
        except OSError as error:  # a filesystem without flock
            os.close(fd)
            raise LockError(
                f"cannot lock {path}: {error.strerror}; this filesystem has no flock. Use a "
                "model_dir on a local disk, NFS or gs://"
            ) from None
        self._fd = fd
        previous = _parse(os.pread(fd, 1 << 16, 0).decode(errors="replace"))
        if previous is not None and not previous.released:
            logging.warning(
                "took over %s from a run that no longer runs (%s)", self.path, previous.describe()
            )
        self._write()

    def _acquire_lease(self) -> None:
        previous = self._read()
        if previous is not None and not previous.released:
            age = time.time() - previous.heartbeat
            if not previous.is_gone() and age < self.lease_seconds:
                raise LockError(self._held_message(previous))
            logging.warning(
                "took over the stale lock %s (last heartbeat %.0f s ago: %s)",
                self.path,
                age,
                previous.describe(),
            )
        self._write()
        time.sleep(SETTLE_SECONDS)
        current = self._read()
        if current is None or current.token != self.holder.token:
            raise LockError(self._held_message(current))

    def _beat(self) -> None:
        """Keeps the lease fresh; notices when another run took the lock over."""
        while not self._stop.wait(self.lease_seconds / 5):
            try:
                if not self._owns_file():
                    self._lost = f"another run took over {self.path}"
                    return
                self.holder = dataclasses.replace(self.holder, heartbeat=time.time())
                self._write()
            except tf.errors.OpError as error:  # a storage hiccup: the next beat tries again
                logging.warning("cannot renew the lock %s: %s", self.path, error.message)

    def _owns_file(self) -> bool:
        current = self._read()
        return current is not None and current.token == self.holder.token

    def _held_message(self, holder: Holder | None) -> str:
        who = holder.describe() if holder else "an unreadable lock file"
        message = (
            f"{self.model_dir} is in use by another run ({who}). Wait for it to finish, stop it, "
            "or use another --model_dir."
        )
        if self.use_flock:  # the kernel frees it when the holder ends: the holder runs
            return message
        return (
            f"{message} If that run is gone, its lease runs out {self.lease_seconds:.0f} s "
            f"after its last heartbeat; or remove {self.path}."
        )

    def _read(self) -> Holder | None:
        try:
            data = files.with_retries(lambda: files.read_bytes(self.path), "reading the lock")
        except tf.errors.NotFoundError:
            return None
        return _parse(data)

    def _write(self) -> None:
        data = json.dumps(dataclasses.asdict(self.holder))
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, data.encode(), 0)
            os.fsync(self._fd)
        else:
            files.write_bytes(self.path, data)
