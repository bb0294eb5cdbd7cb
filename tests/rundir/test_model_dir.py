"""One writer per model_dir, through the binary: two runs started together, exactly one trains.

(A killed holder's lock taken over by the restart is checked by the fault-injection benchmark's
smoke test in tests/benchmarks/test_run_benchmarks.py, which kills and restarts the binary.)
"""

import re
import subprocess
import sys

import pytest

from tests import tiny
from tests.subprocesses import REPO_DIR, child_env

pytestmark = pytest.mark.slow  # subprocesses: the full tier only


def start(model_dir) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "framework.train",
            *tiny.GIN_FLAGS,
            "--gin.Trainer.train_steps=10",
            "--mode=train",
            f"--model_dir={model_dir}",
        ],
        cwd=REPO_DIR,
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_two_runs_started_together_one_trains_the_other_names_it(tmp_path):
    runs = [start(tmp_path), start(tmp_path)]
    errors = [run.communicate(timeout=300)[1] for run in runs]
    codes = sorted(run.returncode for run in runs)
    assert codes == [0, 2], errors
    winner, loser = (0, 1) if runs[0].returncode == 0 else (1, 0)
    error_lines = [line for line in errors[loser].splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and "Traceback" not in errors[loser], errors[loser]
    assert f"pid {runs[winner].pid} on" in error_lines[0], error_lines[0]
    assert "in use by another run" in error_lines[0]
    assert re.search(r"step 10/10", errors[winner])
    saved = sorted(p.name for p in (tmp_path / "checkpoints").glob("ckpt-*.index"))
    assert saved == ["ckpt-10.index", "ckpt-5.index"]
