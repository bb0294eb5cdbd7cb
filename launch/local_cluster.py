"""Runs `python -m framework.train` as N local workers of a `multi_worker_mirrored` cluster.

    python launch/local_cluster.py --num_workers=2 -- --gin_file=quickstart.gin --model_dir=runs/mw

Each worker gets a `TF_CONFIG` naming every worker at a free 127.0.0.1 port, exactly as hosts of a
real cluster would get theirs. Their output is streamed with a `[worker i]` prefix. The launcher
exits with the first failing worker's status (killing the others, which would otherwise wait
forever in a collective), with 42 when the workers were preempted (they saved a checkpoint, or
were stopped while starting up: restart them), and 0 when all finished. SIGTERM or SIGINT to
the launcher is passed on to every worker.

Two guarantees (Linux only):

- Nothing outside the cluster can reach the workers' TensorFlow gRPC servers: no other machine,
  and no other process of this one. TensorFlow (2.21 included) listens on every interface
  (0.0.0.0, which gRPC makes [::] dual-stack), whatever host TF_CONFIG names, and has no setting
  for the bind address. So before it starts any worker the launcher moves itself into a new
  network namespace whose only interface is loopback (`isolate_network`); the workers inherit it
  and reach each other on its 127.0.0.1. As root that is `unshare(CLONE_NEWNET)`; any other user
  needs unprivileged user namespaces (`unshare(CLONE_NEWUSER | CLONE_NEWNET)`, uid and gid mapped
  to themselves). Where neither is permitted the launcher starts no worker and exits with status 2
  and one line on stderr: it does not fall back to exposing an unauthenticated service that runs
  whatever graph it is sent. `--host_network` skips the namespace, with a warning; use it where
  the workers need the network themselves (a `gs://` model_dir, a download) or where a profiler
  must attach to them, since in the namespace they have loopback only.
- No worker outlives the launcher, however the launcher ends: each is started with a parent-death
  signal (`die_with_launcher`), so the kernel SIGKILLs it when the launcher exits, even when the
  launcher itself was SIGKILLed.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

# Run as a script (`python launch/local_cluster.py`), the launcher imports the framework from
# the checkout, as its workers do (`_python_path`): its exit statuses are the trainer's own
# (`framework.core.errors`, which imports no TensorFlow).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from framework.core.errors import PreemptedError
from launch import usage

STRATEGY_BINDING = "--gin.Runtime.strategy='multi_worker_mirrored'"
POLL_SECONDS = 0.2

# Linux ABI constants: unshare(2) flags, prctl(2) option, netdevice(7) ioctls and flag.
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1
IFREQ = struct.Struct("16sH22x")  # struct ifreq: the interface name, then ifr_flags

_libc = ctypes.CDLL(None, use_errno=True)


class IsolationError(RuntimeError):
    """The workers cannot be given a private network on this machine."""


def _unshare(flags: int) -> None:
    if _libc.unshare(flags) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


def isolate_network() -> None:
    """Moves this process (and so every child it starts) into a new network namespace.

    The namespace has only a loopback interface, brought up here: servers in it that listen on
    0.0.0.0 are reachable on its 127.0.0.1 and from nowhere else, not even from this machine's
    own loopback. Root (CAP_SYS_ADMIN) only needs a network namespace; any other user needs a
    user namespace too, in which it keeps its own uid and gid and, until the next exec, the
    capability to bring up the interface. A new user namespace needs a single-threaded process:
    call this before starting any thread. Raises `IsolationError` where neither is permitted.
    """
    uid, gid = os.geteuid(), os.getegid()
    try:
        try:
            _unshare(CLONE_NEWNET)
        except PermissionError:
            _unshare(CLONE_NEWUSER | CLONE_NEWNET)
            for name, text in [
                ("setgroups", "deny"),
                ("uid_map", f"{uid} {uid} 1"),
                ("gid_map", f"{gid} {gid} 1"),
            ]:
                with open(f"/proc/self/{name}", "w") as file:
                    file.write(text)
        with socket.socket() as sock:
            flags = IFREQ.unpack(fcntl.ioctl(sock, SIOCGIFFLAGS, IFREQ.pack(b"lo", 0)))[1]
            fcntl.ioctl(sock, SIOCSIFFLAGS, IFREQ.pack(b"lo", flags | IFF_UP))
    except OSError as error:
        raise IsolationError(
            f"cannot give the workers a private network namespace ({error}); without one their "
            "TensorFlow servers listen on every interface. Allow unprivileged user namespaces, "
            "or pass --host_network to run them exposed anyway"
        ) from error


def die_with_launcher() -> Callable[[], None]:
    """A `preexec_fn` that makes the child get SIGKILL when the launcher exits.

    PR_SET_PDEATHSIG is set in the forked child before it execs the worker and survives that
    exec; the kernel sends the signal when the thread that forked the child ends (the launcher's
    main thread, which starts every worker) for any reason, SIGKILL included. If the launcher is
    already gone by the time the child sets it, the child kills itself. SIGKILL, not SIGTERM:
    with the launcher gone nothing collects a worker's output or exit status, and SIGKILL is the
    one signal sure to end it; it keeps its last periodic checkpoint.

    The workers stay in the launcher's process group, as before: a terminal's Ctrl-C / Ctrl-Z and
    a supervisor's `kill -- -PGID` reach the whole cluster directly. A separate group would help
    only if the launcher could still kill it, which a SIGKILLed launcher cannot; the parent-death
    signal covers exactly that case.
    """
    launcher = os.getpid()

    def preexec() -> None:
        if _libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL)) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != launcher:
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def free_ports(count: int) -> list[int]:
    """Ports that are free on 127.0.0.1 now (held open together so they are distinct)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def tf_config(addresses: Sequence[str], index: int) -> str:
    """The TF_CONFIG of worker `index` in a cluster of `addresses` (worker 0 is the chief)."""
    return json.dumps(
        {"cluster": {"worker": list(addresses)}, "task": {"type": "worker", "index": index}}
    )


def _python_path() -> str:
    """PYTHONPATH with this checkout first: the workers import the framework from it wherever
    the launcher is started (they run in the caller's directory, where relative paths such as
    `--model_dir=runs/mw` point), installed or not."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)


def worker_command(train_args: Sequence[str]) -> list[str]:
    """The command every worker runs; the user's flags come last so they can override ours."""
    return [sys.executable, "-m", "framework.train", STRATEGY_BINDING, *train_args]


def _stream(process: subprocess.Popen, prefix: str) -> None:
    for line in process.stdout:
        sys.stdout.write(f"{prefix} {line}")
        sys.stdout.flush()


def _stop(processes: Sequence[subprocess.Popen], grace_seconds: float) -> None:
    """SIGTERM to the workers still running, then SIGKILL after the grace period."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + grace_seconds
    for process in processes:
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run_cluster(
    num_workers: int,
    train_args: Sequence[str],
    grace_seconds: float = 30.0,
    host_network: bool = False,
) -> int:
    """Starts the workers, streams their logs and returns the cluster's exit status.

    Unless `host_network`, this process first moves into a private network namespace (see
    `isolate_network`, which raises `IsolationError` where it cannot) and stays there.
    """
    if host_network:
        print(
            "[launcher] WARNING: --host_network: the workers' TensorFlow servers listen, "
            "unauthenticated, on every interface of this machine",
            file=sys.stderr,
            flush=True,
        )
    else:
        isolate_network()
    addresses = [f"127.0.0.1:{port}" for port in free_ports(num_workers)]
    processes = []
    for index in range(num_workers):  # all forks before any thread starts (preexec_fn)
        env = dict(os.environ, TF_CONFIG=tf_config(addresses, index), PYTHONPATH=_python_path())
        process = subprocess.Popen(
            worker_command(train_args),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            preexec_fn=die_with_launcher(),
        )
        processes.append(process)
    for index, (process, address) in enumerate(zip(processes, addresses)):
        threading.Thread(target=_stream, args=(process, f"[worker {index}]"), daemon=True).start()
        print(f"[launcher] worker {index} pid {process.pid} at {address}", flush=True)

    forwarded = threading.Event()

    def forward(signum, frame):
        forwarded.set()
        for process in processes:
            if process.poll() is None:
                process.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    # After a forwarded signal, a worker that saved and exited 42, or that the signal ended
    # before its handler was installed (while it started up), was preempted: restart it.
    preempted = {PreemptedError.exit_status, -signal.SIGTERM, -signal.SIGINT}
    while True:
        codes = [process.poll() for process in processes]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed and not (forwarded.is_set() and failed[0][1] in preempted):
            index, code = failed[0]
            print(
                f"[launcher] worker {index} exited with status {code}: stopping the others",
                flush=True,
            )
            _stop(processes, grace_seconds)
            return code if code > 0 else 1
        if all(code is not None for code in codes):
            if forwarded.is_set() and preempted.intersection(codes):
                return PreemptedError.exit_status
            return max(codes)
        time.sleep(POLL_SECONDS)


def main(argv: Sequence[str] | None = None) -> int:
    parser = usage.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num_workers", type=int, default=2)
    parser.add_argument(
        "--grace_seconds",
        type=float,
        default=30.0,
        help="how long stopping workers get before SIGKILL",
    )
    parser.add_argument(
        "--host_network",
        action="store_true",
        help="run the workers in this machine's network namespace: they can reach the network, "
        "but their TensorFlow servers listen, unauthenticated, on every interface",
    )
    parser.add_argument(
        "train_args", nargs=argparse.REMAINDER, help="flags for framework.train, after --"
    )
    args = parser.parse_args(argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    if args.num_workers < 1:
        parser.error("--num_workers must be at least 1")
    if not sys.platform.startswith("linux"):
        parser.error("needs Linux (network namespaces, PR_SET_PDEATHSIG)")
    try:
        return run_cluster(args.num_workers, train_args, args.grace_seconds, args.host_network)
    except IsolationError as error:
        print(f"[launcher] {error}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
