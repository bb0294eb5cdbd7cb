"""Runs a Python script in a fresh interpreter, for tests that need a clean TensorFlow process.

pytest runs every test module in one process, but some settings only take effect before TensorFlow
starts: logical CPU devices, the CPU BFC allocator, XLA flags. Such checks run here instead.
"""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

TESTS_DIR = pathlib.Path(__file__).resolve().parent
REPO_DIR = TESTS_DIR.parent


def child_env(env: dict[str, str | None] | None = None) -> dict[str, str]:
    """This process' environment with the repo importable and `env` applied (None removes)."""
    result = dict(os.environ)
    result["PYTHONPATH"] = os.pathsep.join([str(REPO_DIR), str(TESTS_DIR)])
    result["TF_CPP_MIN_LOG_LEVEL"] = "2"
    for name, value in (env or {}).items():
        if value is None:
            result.pop(name, None)
        else:
            result[name] = value
    return result


def run_json(args: list[str], env: dict[str, str | None] | None = None, timeout: int = 300) -> dict:
    """Runs `python ARGS`, which prints one JSON object as its last line of output; returns it."""
    proc = subprocess.run(
        [sys.executable, *args],
        env=child_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_python(script: str, env: dict[str, str | None] | None = None, timeout: int = 300) -> dict:
    """Runs `script` (dedented), which prints one JSON object as its last line; returns it."""
    return run_json(["-c", textwrap.dedent(script)], env, timeout)


def command(*args: str, launcher: tuple[str, ...] = ("-m", "framework.train")) -> list[str]:
    """`python -m framework.train ARGS` (or another `launcher`) with this interpreter."""
    return [sys.executable, *launcher, *args]


def run_binary(
    *args: str, launcher: tuple[str, ...] = ("-m", "framework.train"), cwd=REPO_DIR
) -> subprocess.CompletedProcess:
    """Runs the training binary (or `launcher`) with `args`; its output is captured."""
    return subprocess.run(
        command(*args, launcher=launcher),
        cwd=cwd,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
