"""launch/tpu_pod.py: the gcloud commands it would run (no TPU is reachable from here)."""

import shlex
import subprocess
import sys

import pytest

from tests.subprocesses import REPO_DIR

TPU = ["--name=pod1", "--zone=us-central2-b"]
TRAIN_FLAGS = [
    "--gin_file=vit_b16.gin",
    "--gin.Trainer.tpu='local'",
    "--gin_param=Trainer.train_steps = 100",
    "--model_dir=gs://bucket/runs/a b",
]


def dry_run(*args: str) -> list[list[str]]:
    result = subprocess.run(
        [sys.executable, "launch/tpu_pod.py", "--dry_run", *args],
        cwd=REPO_DIR,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert all(line.startswith("would run: ") for line in lines), lines
    return [shlex.split(line.removeprefix("would run: ")) for line in lines]


def test_create_tpu_vm_and_queued_resource():
    (vm,) = dry_run("create", *TPU, "--accelerator_type=v4-32", "--spot")
    assert vm[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "create", "pod1"]
    assert {"--zone=us-central2-b", "--accelerator-type=v4-32", "--spot"} <= set(vm)
    assert any(a.startswith("--version=tpu-vm-tf-2.21") for a in vm)
    (queued,) = dry_run("create", *TPU, "--queued", "--reserved", "--project=p")
    assert queued[:6] == ["gcloud", "compute", "tpus", "queued-resources", "create", "pod1"]
    assert {"--node-id=pod1", "--reserved", "--project=p"} <= set(queued)


def test_setup_copies_and_installs_on_all_workers():
    archive, scp, install = dry_run("setup", *TPU)
    assert archive[:2] == ["git", "-C"] and "archive" in archive
    assert scp[4] == "scp" and "pod1:~/" in scp and "--worker=all" in scp
    assert "--worker=all" in install and "pip install -e ." in install[-1]


def test_run_passes_training_flags_through_the_remote_shell_unchanged():
    (ssh,) = dry_run("run", *TPU, "--", *TRAIN_FLAGS)
    assert ssh[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "pod1"]
    assert "--worker=all" in ssh
    remote = ssh[-1].removeprefix("--command=")
    assert remote.startswith("set -o pipefail;")
    words = shlex.split(remote.split("&&", 1)[1].split("2>&1")[0])
    assert words == ["python3", "-m", "framework.train", *TRAIN_FLAGS]


def test_logs_and_delete():
    (logs,) = dry_run("logs", *TPU, "--lines=5")
    assert logs[-1] == "--command=tail -n 5 ~/framework-train.log"
    (delete,) = dry_run("delete", *TPU)
    assert delete[4:6] == ["delete", "pod1"] and "--quiet" in delete


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", *TPU], "needs the flags for framework.train"),
        (["setup", *TPU, "--", "--x"], "takes no training flags"),
        (["create", "--zone=z"], "--name"),
    ],
)
def test_bad_usage(args, message):
    result = subprocess.run(
        [sys.executable, "launch/tpu_pod.py", *args],
        cwd=REPO_DIR,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2 and message in result.stderr


def test_a_failing_step_stops_the_launcher_with_its_status(tmp_path):
    fake_gcloud = tmp_path / "gcloud"
    fake_gcloud.write_text('#!/bin/sh\necho "$@" >> calls\nexit 3\n')
    fake_gcloud.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, str(REPO_DIR / "launch/tpu_pod.py"), "delete", *TPU],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 3 and "failed with status 3" in result.stderr
    assert (tmp_path / "calls").read_text().startswith("compute tpus tpu-vm delete pod1")
