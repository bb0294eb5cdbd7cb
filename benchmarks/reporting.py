"""What every benchmark shares to report: where the repository is, the machine a result was
measured on, the header a report opens with (the command, the date, the machine), writing it,
and running one measurement in a fresh process. Nothing here imports TensorFlow at load time,
so a benchmark that only writes a report does not pay for it."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from typing import Any

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_json(script: str, args: list[str], identity: dict[str, Any]) -> dict[str, Any]:
    """Runs `script` with `args` in a fresh Python process (CPU BFC allocator on) and returns the
    JSON object of its last output line, or `identity` with the error when the process fails."""
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_DIR, env.get("PYTHONPATH")]))
    command = [sys.executable, os.path.abspath(script), *args]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
    return {**identity, "error": f"process died: {tail}"[:140]}


def write_report(report: str, out: str | None) -> None:
    """Prints the report and, with `out`, writes it to that file."""
    print(report)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            f.write(report)


def mib(n: float) -> str:
    """Bytes as MiB with one decimal, as the reports print them."""
    return f"{n / 2**20:.1f}"


def report_header(script: str, started: datetime.datetime) -> list[str]:
    """The lines a report opens with: the command that ran `script`, when it started and how
    long it took, and the machine."""
    command = "python " + " ".join([os.path.relpath(script, REPO_DIR), *sys.argv[1:]])
    minutes = (datetime.datetime.now() - started).total_seconds() / 60
    return [
        f"Command: `{command}`",
        f"Date: {started:%Y-%m-%d %H:%M}, took {minutes:.1f} min",
        f"Machine: {machine()}",
    ]


def machine() -> str:
    """nproc, CPU model, Python, TensorFlow and Keras versions: what the numbers depend on."""
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import keras
    import tensorflow as tf

    return (
        f"{os.cpu_count()} CPUs ({cpu}), Python {platform.python_version()}, "
        f"TensorFlow {tf.__version__}, Keras {keras.__version__}"
    )
