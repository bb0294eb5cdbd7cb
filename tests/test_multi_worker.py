"""launch/local_cluster.py: real worker processes with TF_CONFIG on 127.0.0.1.

The same global batch over 2 workers trains like one device; SIGTERM saves a checkpoint at a step
both workers agree on and a restart resumes there; a SIGKILLed worker stops the launcher.
"""

import json
import re
import signal
import subprocess
import sys
import time

import pytest
import tensorflow as tf

from framework.trainer import Trainer
from launch import local_cluster
from tests import tiny
from tests.subprocesses import REPO_DIR, child_env

TINY_FLAGS = [*tiny.GIN_FLAGS, "--gin.Trainer.remat_policy='dots_saveable'"]


def start_cluster(model_dir, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "launch/local_cluster.py",
            "--num_workers=2",
            "--grace_seconds=5",
            "--",
            *TINY_FLAGS,
            f"--model_dir={model_dir}",
            "--mode=train",
            *flags,
        ],
        cwd=REPO_DIR,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for(process: subprocess.Popen, pattern: str, timeout: float = 240) -> list[str]:
    """Reads the launcher's output until a line matches `pattern`; returns the lines read."""
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        if re.search(pattern, line):
            return lines
    process.kill()
    raise AssertionError(f"no line matching {pattern!r}:\n" + "".join(lines[-40:]))


def test_tf_config_names_every_worker_and_this_task():
    config = json.loads(local_cluster.tf_config(["127.0.0.1:1", "127.0.0.1:2"], 1))
    assert config == {
        "cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
        "task": {"type": "worker", "index": 1},
    }
    assert len(set(local_cluster.free_ports(4))) == 4


def test_two_workers_train_like_one_device_with_remat(tmp_path):
    cluster = start_cluster(tmp_path / "mw", "--gin.Trainer.train_steps=10")
    output = cluster.communicate(timeout=300)[0]
    assert cluster.returncode == 0, output[-3000:]
    assert "[worker 1]" in output and "multi_worker_mirrored with 2 replica(s)" in output
    assert (tmp_path / "mw" / "config.gin").exists()

    args = {**tiny.TRAINER_ARGS, "remat_policy": "dots_saveable", "train_steps": 10}
    single = Trainer(str(tmp_path / "one"), **args)
    single.train()
    restored = Trainer(str(tmp_path / "mw"), **args)  # the workers' final checkpoint
    assert restored.step == 10
    loss_one, loss_mw = single.evaluate()["loss"], restored.evaluate()["loss"]
    # Same examples, same initial weights; only the order of float sums differs (all-reduce).
    assert abs(loss_mw - loss_one) / loss_one < 1e-4, (loss_mw, loss_one)


def test_sigterm_saves_where_the_workers_agree_and_a_restart_resumes(tmp_path):
    cluster = start_cluster(tmp_path, "--gin.Trainer.train_steps=100000")
    wait_for(cluster, r"\[worker 0\].*step 10/100000")
    cluster.send_signal(signal.SIGTERM)
    output = cluster.communicate(timeout=120)[0]
    assert cluster.returncode == local_cluster.PREEMPTED_EXIT_CODE, output[-3000:]
    saved = sorted(
        int(m) for m in re.findall(r"preempted: saved a checkpoint at step (\d+)", output)
    )
    assert len(saved) == 2 and saved[0] == saved[1] and saved[0] >= 10, output[-3000:]

    restart = start_cluster(tmp_path, f"--gin.Trainer.train_steps={saved[0] + 5}")
    output = restart.communicate(timeout=300)[0]
    assert restart.returncode == 0, output[-3000:]
    assert f"restored step {saved[0]}" in output


def test_a_killed_worker_stops_the_launcher_and_the_restart_resumes(tmp_path):
    cluster = start_cluster(tmp_path, "--gin.Trainer.train_steps=100000")
    lines = wait_for(cluster, r"\[worker 1\].*step 10/100000")
    pid = int(re.search(r"worker 1 pid (\d+)", "".join(lines)).group(1))
    killed_at = time.monotonic()
    subprocess.run(["kill", "-KILL", str(pid)], check=True)
    output = cluster.communicate(timeout=60)[0]
    assert cluster.returncode != 0
    assert time.monotonic() - killed_at < 30
    assert "worker 1 exited with status -9" in output

    last = int(tf.train.latest_checkpoint(tmp_path / "checkpoints").rsplit("-", 1)[1])
    assert last >= 10
    restart = start_cluster(tmp_path, f"--gin.Trainer.train_steps={last + 5}")
    output = restart.communicate(timeout=300)[0]
    assert restart.returncode == 0, output[-3000:]
    assert f"restored step {last}" in output


@pytest.mark.parametrize("argv", [["--num_workers=0", "--", "--mode=train"]])
def test_bad_launcher_usage(argv):
    with pytest.raises(SystemExit):
        local_cluster.main(argv)
