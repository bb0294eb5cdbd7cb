"""Runs `python -m framework.train` as N local workers of a `multi_worker_mirrored` cluster.

    python launch/local_cluster.py --num_workers=2 -- --gin_file=quickstart.gin --model_dir=runs/mw

Each worker gets a `TF_CONFIG` naming every worker at a free 127.0.0.1 port, exactly as hosts of a
real cluster would get theirs. Their output is streamed with a `[worker i]` prefix. The launcher
exits with the first failing worker's status (killing the others, which would otherwise wait
forever in a collective), with 42 when the workers were preempted and saved a checkpoint, and 0
when all finished. SIGTERM or SIGINT to the launcher is passed on to every worker.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

STRATEGY_BINDING = "--gin.Trainer.strategy='multi_worker_mirrored'"
PREEMPTED_EXIT_CODE = 42
POLL_SECONDS = 0.2


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


def run_cluster(num_workers: int, train_args: Sequence[str], grace_seconds: float = 30.0) -> int:
    """Starts the workers, streams their logs and returns the cluster's exit status."""
    addresses = [f"127.0.0.1:{port}" for port in free_ports(num_workers)]
    processes = []
    for index in range(num_workers):
        env = dict(os.environ, TF_CONFIG=tf_config(addresses, index))
        process = subprocess.Popen(
            worker_command(train_args),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        processes.append(process)
        threading.Thread(target=_stream, args=(process, f"[worker {index}]"), daemon=True).start()
    for index, (process, address) in enumerate(zip(processes, addresses)):
        print(f"[launcher] worker {index} pid {process.pid} at {address}", flush=True)

    forwarded = threading.Event()

    def forward(signum, frame):
        forwarded.set()
        for process in processes:
            if process.poll() is None:
                process.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while True:
        codes = [process.poll() for process in processes]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed and not (forwarded.is_set() and failed[0][1] == PREEMPTED_EXIT_CODE):
            index, code = failed[0]
            print(
                f"[launcher] worker {index} exited with status {code}: stopping the others",
                flush=True,
            )
            _stop(processes, grace_seconds)
            return code if code > 0 else 1
        if all(code is not None for code in codes):
            return max(codes)
        time.sleep(POLL_SECONDS)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num_workers", type=int, default=2)
    parser.add_argument(
        "--grace_seconds",
        type=float,
        default=30.0,
        help="how long stopping workers get before SIGKILL",
    )
    parser.add_argument(
        "train_args", nargs=argparse.REMAINDER, help="flags for framework.train, after --"
    )
    args = parser.parse_args(argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    if args.num_workers < 1:
        parser.error("--num_workers must be at least 1")
    return run_cluster(args.num_workers, train_args, args.grace_seconds)


if __name__ == "__main__":
    sys.exit(main())
