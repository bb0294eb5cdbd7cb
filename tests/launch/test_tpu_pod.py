"""launch/tpu_pod.py against a stand-in gcloud (tests/fake_gcloud.py): no cloud, no TPU.

The stand-in plays the TPU's states and runs the launcher's remote scripts with bash in a
directory per worker, so these tests cover the lifecycle itself (queued create, detached run,
logs, status, stop, preemption and resume), not only the command strings.
"""

import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from framework.memory import tpu
from launch import tpu_pod
from launch.tpu import commands, options, records, topology
from tests import fake_gcloud
from tests.subprocesses import REPO_DIR, TESTS_DIR

FLAGS = [
    "--gin_file=vit_b16.gin",
    "--gin_param=Trainer.train_steps = 100",
    "--gin.Trainer.remat_policy='nothing_saveable'",
    "--model_dir=gs://bucket/runs/a b",
]


class Cloud:
    """The stand-in gcloud on PATH: its state, the calls it got and the workers' directories."""

    def __init__(self, root: Path, **state):
        self.root = root
        self.dir = root / "cloud"
        for role, directory in [("gcloud", "bin"), *[(r, "remote-bin") for r in ROLES]]:
            wrapper = self.dir / directory / role
            wrapper.parent.mkdir(parents=True, exist_ok=True)
            fake = TESTS_DIR / "fake_gcloud.py"
            wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} -S {fake} {role} "$@"\n')
            wrapper.chmod(0o755)
        self.write_state({"tpu": None, "queued": None, **state})

    def env(self) -> dict[str, str]:
        return {
            "PATH": f"{self.dir / 'bin'}:/usr/bin:/bin",
            "HOME": os.environ.get("HOME", str(self.root)),
            "XDG_CACHE_HOME": str(self.root / "cache"),
            "FAKE_GCLOUD_DIR": str(self.dir),
        }

    def launch(self, *args: str, status: int = 0) -> subprocess.CompletedProcess:
        result = subprocess.run(
            [sys.executable, "launch/tpu_pod.py", *args],
            cwd=REPO_DIR,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == status, result.stdout + result.stderr
        return result

    def write_state(self, state: dict) -> None:
        fake_gcloud.write_atomically(self.dir / "state.json", json.dumps(state))

    def update(self, **changes) -> None:
        self.write_state({**json.loads((self.dir / "state.json").read_text()), **changes})

    def calls(self) -> list[list[str]]:
        path = self.dir / "calls.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def worker(self, index: int) -> Path:
        return self.dir / "workers" / str(index)

    def lines(self, worker: int, name: str) -> list:
        path = self.worker(worker) / name
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def wait_for_log(self, text: str, worker: int = 0) -> None:
        log = self.worker(worker) / "framework-tpu" / "train.log"
        deadline = time.monotonic() + 10
        while not (log.exists() and text in log.read_text()):
            assert time.monotonic() < deadline, f"{text!r} never reached {log}"
            time.sleep(0.05)


ROLES = ("python3", "sudo", "curl")
TPU = ["--name=pod1", "--zone=us-central2-b", "--poll_seconds=0"]


@pytest.fixture
def cloud(tmp_path):
    cloud = Cloud(tmp_path)
    yield cloud
    fake_gcloud.kill_trainers(cloud.dir)


def started(cloud: Cloud, accelerator_type: str, *create: str) -> None:
    """A TPU created, set up and training (detached) with FLAGS."""
    cloud.launch("create", *TPU, f"--accelerator_type={accelerator_type}", *create)
    cloud.launch("setup", *TPU)
    cloud.launch("run", *TPU, "--", *FLAGS)
    cloud.wait_for_log("fake trainer: step")


def verbs(calls: list[list[str]]) -> list[str]:
    return [" ".join(call[2:4]) for call in calls]


# --- Runtimes and accelerator types -----------------------------------------------------------


@pytest.mark.parametrize(
    "accelerator_type, multi_host",
    [
        ("v4-8", False),
        ("v5litepod-8", False),
        ("v5litepod-4", False),
        ("v6e-8", False),
        ("v5p-8", False),
        ("v4-16", True),
        ("v4-32", True),
        ("v5litepod-16", True),
        ("v5p-16", True),
        ("v6e-16", True),
    ],
)
def test_default_runtime_follows_the_hosts_of_the_accelerator_type(accelerator_type, multi_host):
    assert topology.is_multi_host(accelerator_type) is multi_host
    pod = "-pod" if multi_host else ""
    assert topology.default_runtime(accelerator_type) == f"tpu-vm-tf-2.20.0{pod}-pjrt"


def bindings(accelerator_type: str, *train_args: str) -> list[str]:
    """The gin bindings the launcher adds to `train_args` for a slice of `accelerator_type`."""
    flags = commands.training_command("pod1", accelerator_type, train_args)[0]
    return [flag for flag in flags[len(train_args) :] if flag.startswith("--gin.Runtime.")]


def test_the_peak_tflops_follow_the_accelerator_type_unless_the_user_binds_them():
    # Per TensorFlow device: a TensorCore (half a chip) on v2 and v3, a chip from v4 on.
    peaks = {"v2-8": "22.5", "v3-32": "61.5", "v4-8": "275.0", "v5p-16": "459.0"}
    peaks |= {"v5litepod-16": "197.0", "v5e-4": "197.0", "v6e-16": "918.0"}
    for accelerator_type, peak in peaks.items():
        assert f"--gin.Runtime.peak_tflops={peak}" in bindings(accelerator_type)
    mine = "--gin.Runtime.peak_tflops=100"
    assert not any("peak_tflops" in flag for flag in bindings("v4-8", mine))


def test_the_accelerator_type_is_bound_where_the_runtime_takes_it():
    """`Runtime.accelerator_type` (so that `remat_policy = "auto"` plans with the TPU compiler)
    is bound for every chip the TPU compiler plans for, never for one `Runtime` would refuse."""
    for name in topology.GENERATIONS:
        accelerator_type = f"{name}-8"
        bound = any("Runtime.accelerator_type" in flag for flag in bindings(accelerator_type))
        try:
            tpu.tpu_chip(accelerator_type)  # what `Runtime` checks at start
        except ValueError:
            assert not bound, accelerator_type
        else:
            assert bound, accelerator_type
    assert bindings("v6e-16")[-1] == '--gin.Runtime.accelerator_type="v6e-16"'
    assert not any("accelerator_type" in flag for flag in bindings("v3-8"))
    mine = "--gin.Runtime.accelerator_type='v5e'"
    assert not any("accelerator_type" in flag for flag in bindings("v5litepod-16", mine))


def test_newest_runtime_of_a_zone_for_the_supported_tensorflow():
    names = [
        "tpu-vm-tf-2.19.0-pjrt",
        "tpu-vm-tf-2.20.0-pjrt",
        "tpu-vm-tf-2.20.0-pod-pjrt",
        "tpu-vm-tf-2.20.0-pod-pjrt-v5e-and-v6",
        "tpu-vm-tf-2.20.0-se",
        "tpu-ubuntu2204-base",
    ]
    assert topology.newest_runtime(names, "v4-8") == "tpu-vm-tf-2.20.0-pjrt"
    assert topology.newest_runtime(names, "v4-32") == "tpu-vm-tf-2.20.0-pod-pjrt"
    assert topology.newest_runtime(names, "v5litepod-16") == "tpu-vm-tf-2.20.0-pod-pjrt-v5e-and-v6"
    assert topology.newest_runtime(names[:1], "v4-8") is None


def test_versions_lists_the_zones_tensorflow_runtimes(cloud):
    cloud.update(versions=["tpu-ubuntu2204-base", "tpu-vm-tf-2.19.0-pjrt", "tpu-vm-tf-2.20.0-pjrt"])
    out = cloud.launch("versions", "--zone=us-central2-b", "--accelerator_type=v4-8").stdout
    assert "tpu-vm-tf-2.19.0-pjrt\n" in out and "tpu-vm-tf-2.20.0-pjrt  (supported" in out
    assert "newest for v4-8: tpu-vm-tf-2.20.0-pjrt" in out and "ubuntu" not in out
    assert cloud.calls()[0][2:5] == ["tpu-vm", "versions", "list"]


def test_create_uses_the_default_runtime_unless_given(cloud):
    out = cloud.launch("create", *TPU, "--accelerator_type=v5litepod-16", "--dry_run").stdout
    assert "--version=tpu-vm-tf-2.20.0-pod-pjrt" in out
    override = ["--accelerator_type=v4-8", "--runtime_version=tpu-vm-tf-2.21.0-pjrt", "--dry_run"]
    assert "--version=tpu-vm-tf-2.21.0-pjrt" in cloud.launch("create", *TPU, *override).stdout
    error = cloud.launch("create", *TPU, "--accelerator_type=v9-8", status=2).stderr
    assert error.startswith("error: unknown accelerator type 'v9-8'")


def test_the_launchers_import_neither_tensorflow_nor_jax_nor_gin():
    """They run on a workstation where none of them need be installed: what they share with the
    framework (exit statuses, TensorFlow releases, TPU generations) imports none either."""
    script = (
        "import sys, launch.tpu_pod, launch.local_cluster; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'tensorflow', 'jax', 'gin'}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_DIR, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0 and result.stdout == "[]\n", result.stdout + result.stderr


@pytest.mark.parametrize(
    "launcher, args, output",
    [
        ("tpu_pod.py", ["versions", "--zone=z", "--dry_run"], "would run: gcloud"),
        ("local_cluster.py", ["--num_workers=0"], "--num_workers must be at least 1"),
    ],
)
def test_the_launchers_run_from_the_checkout_alone(tmp_path, launcher, args, output):
    """Started as scripts from another directory with no site-packages (`-S`: nothing installed),
    they find the framework modules they use in their own checkout."""
    result = subprocess.run(
        [sys.executable, "-S", str(REPO_DIR / "launch" / launcher), *args],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert output in result.stdout + result.stderr, result.stdout + result.stderr


# --- The command line ---------------------------------------------------------------------------


def test_the_command_line_is_parsed_once_into_frozen_records(tmp_path, monkeypatch):
    """What the command line leaves out comes from the TPU's record, in a new record."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    record = records.record_path(options.Tpu("pod1", "us-central2-b", None))
    record.parent.mkdir(parents=True)
    recorded = {"accelerator_type": "v4-32", "queued": True, "train_args": FLAGS}
    record.write_text(json.dumps(recorded))
    launch = tpu_pod.parse_args(["resume", *TPU, "--spot", "--libtpu_flags=--a=1 --b=2"])
    assert launch.spec == options.SliceSpec("v4-32", None, True, None, True)
    assert launch.train_args == tuple(FLAGS) and launch.libtpu_flags == ("--a=1", "--b=2")
    assert launch.tpu == options.Tpu("pod1", "us-central2-b", None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        launch.spec.accelerator_type = "v4-8"
    given = tpu_pod.parse_args(["status", *TPU, "--accelerator_type=v4-8", "--project=p"])
    assert given.spec.accelerator_type == "v4-8" and given.spec.queued is None  # another record
    created = tpu_pod.parse_args(["create", *TPU, "--accelerator_type=v4-8"])
    assert created.spec == options.SliceSpec("v4-8") and created.polling.poll_seconds == 0


# --- Dry runs ---------------------------------------------------------------------------------


def test_dry_run_prints_the_exact_commands_and_runs_nothing(cloud):
    pod = [*TPU, "--accelerator_type=v4-32", "--dry_run"]
    commands = {}
    for subcommand, extra in [
        ("create", ["--queued", "--spot"]),
        ("setup", []),
        ("run", ["--", *FLAGS]),
        ("status", []),
        ("logs", ["--worker=all", "--follow"]),
        ("stop", []),
        ("resume", ["--", *FLAGS]),
        ("delete", ["--queued"]),
    ]:
        lines = cloud.launch(subcommand, *pod, *extra).stdout.splitlines()
        assert all(line.startswith("would run: ") for line in lines if "recreating" not in line)
        commands[subcommand] = [
            shlex.split(line.removeprefix("would run: ")) for line in lines if "would run" in line
        ]
    assert cloud.calls() == [] and not (cloud.root / "cache").exists()
    create, poll = commands["create"]
    assert create[:6] == ["gcloud", "compute", "tpus", "queued-resources", "create", "pod1"]
    assert {"--node-id=pod1", "--spot", "--runtime-version=tpu-vm-tf-2.20.0-pod-pjrt"} <= {*create}
    assert poll[3:5] == ["queued-resources", "describe"]
    describe, start = commands["run"]
    assert describe[3:5] == ["tpu-vm", "describe"] and "--worker=0" in start
    assert "TPU_NAME=pod1 TPU_LOAD_LIBRARY=0" in start[-1]
    assert [c[4] for c in commands["resume"]][:4] == ["describe", "delete", "create", "ssh"]


def test_dry_run_without_an_accelerator_type_asks_for_one(cloud):
    error = cloud.launch("run", *TPU, "--dry_run", "--", *FLAGS, status=2).stderr
    assert "pass --accelerator_type" in error


# --- Queued resources -------------------------------------------------------------------------


def test_queued_create_waits_until_the_slice_is_active(cloud):
    cloud.update(queued_polls=2)
    out = cloud.launch("create", *TPU, "--accelerator_type=v4-32", "--queued", "--spot").stdout
    assert out.count("WAITING_FOR_RESOURCES; waiting") == 2
    assert verbs(cloud.calls()) == ["queued-resources create", *["queued-resources describe"] * 3]
    assert "READY" in cloud.launch("status", *TPU).stdout  # the queued flag was recorded


def test_queued_create_is_bounded_and_no_wait_skips_the_wait(cloud):
    cloud.update(queued_polls=100)
    args = [*TPU, "--accelerator_type=v4-8", "--queued"]
    error = cloud.launch("create", *args, "--wait_minutes=0", status=75).stderr
    assert "still WAITING_FOR_RESOURCES after 0 min" in error
    cloud.launch("create", *args, "--no_wait")
    assert verbs(cloud.calls()).count("queued-resources describe") == 1


# --- Set-up -----------------------------------------------------------------------------------


def test_setup_installs_around_the_images_tensorflow(cloud):
    (cloud.root / "user.txt").write_text("keep")
    cloud.launch("create", *TPU, "--accelerator_type=v5litepod-8")
    (cloud.worker(0) / "notes.txt").write_text("the user's")
    out = cloud.launch("setup", *TPU).stdout
    assert "TensorFlow 2.20.0 on every worker" in out
    pip = cloud.lines(0, "pip-calls.jsonl")
    constraints = ["-c", "$D/constraints.txt".replace("$D", str(cloud.worker(0) / "framework-tpu"))]
    assert pip == [
        ["list", "--format=freeze", "--exclude-editable"],
        ["install", "--no-deps", "-e", "."],
        ["install", "--no-deps", *constraints, "tensorflow-text==2.20.*"],
        ["install", *constraints, "-r", constraints[1].replace("constraints", "requirements")],
    ]
    remote = cloud.worker(0) / "framework-tpu"
    assert (remote / "requirements.txt").read_text().split() == [
        "gin-config==0.5.0",
        "absl-py>=2.1",
    ]
    assert (remote / "src" / "framework" / "train.py").is_file()
    assert (cloud.worker(0) / "notes.txt").read_text() == "the user's"
    assert not list(cloud.worker(0).glob("*.tar.gz"))  # the archive was unpacked and removed
    local_archive = next(word for word in out.split() if word.startswith("--output="))
    assert not Path(local_archive.removeprefix("--output=")).exists()
    sudo = cloud.lines(0, "sudo-calls.jsonl")  # stale TPU holders, single host only
    assert sudo[0][:2] == ["lsof", "-t"] and ["rm", "-f", "/tmp/libtpu_lockfile"] in sudo


def test_setup_refuses_a_tensorflow_outside_the_supported_range(cloud):
    cloud.update(tensorflow="2.19.0")
    cloud.launch("create", *TPU, "--accelerator_type=v4-32")
    error = cloud.launch("setup", *TPU, status=3).stderr.strip()
    assert error.count("\n") == 0 and "tensorflow-tpu 2.19.0" in error
    assert "supports TensorFlow 2.20 and 2.21" in error
    assert "tpu-vm scp" not in verbs(cloud.calls())


def test_setup_never_replaces_a_directory_it_did_not_make(cloud):
    cloud.launch("create", *TPU, "--accelerator_type=v4-8")
    mine = cloud.worker(0) / "framework-tpu" / "mine.txt"
    mine.parent.mkdir()
    mine.write_text("mine")
    error = cloud.launch("setup", *TPU, status=3).stderr
    assert "~/framework-tpu exists and was not made by launch/tpu_pod.py" in error
    assert mine.read_text() == "mine" and not (mine.parent / "src").exists()


def test_libtpu_flags_go_to_the_pod_hosts_tpu_runtime_service(cloud):
    pod = [*TPU, "--accelerator_type=v4-32", "--dry_run"]
    out = cloud.launch("setup", *pod, "--libtpu_flags=--xla_a=true --xla_b=1").stdout
    service = shlex.split(out.splitlines()[-1].removeprefix("would run: "))
    assert "--worker=all" in service
    assert '"--env=LIBTPU_INIT_ARGS=--xla_a=true --xla_b=1"' in service[-1]
    assert "systemctl restart tpu-runtime" in service[-1]
    single = [*TPU, "--accelerator_type=v4-8", "--dry_run", "--libtpu_flags=--xla_a=true"]
    assert "for pod slices" in cloud.launch("setup", *single, status=2).stderr


# --- Running ----------------------------------------------------------------------------------


def test_a_pod_slice_runs_one_client_on_worker_0(cloud):
    started(cloud, "v4-32")
    (call,) = cloud.lines(0, "train-calls.jsonl")
    assert call["argv"] == [
        *FLAGS,
        "--gin_file=runtime/tpu_pod.gin",
        '--gin.Runtime.tpu="pod1"',
        "--gin.Runtime.peak_tflops=275.0",  # a v4 chip (one TensorFlow device)
        '--gin.Runtime.accelerator_type="v4-32"',
    ]
    assert call["env"]["TPU_NAME"] == "pod1" and call["env"]["TPU_LOAD_LIBRARY"] == "0"
    assert call["env"]["NEXT_PLUGGABLE_DEVICE_USE_C_API"] is None
    assert call["cwd"].endswith("framework-tpu/src")
    assert all(cloud.lines(worker, "train-calls.jsonl") == [] for worker in (1, 2, 3))
    assert all(cloud.lines(worker, "pip-calls.jsonl") for worker in (0, 1, 2, 3))  # set up all
    assert cloud.lines(0, "sudo-calls.jsonl") == []  # the hosts' TPU service keeps the TPU
    out = cloud.launch("logs", *TPU, "--worker=all", "--lines=2").stdout
    assert "[worker 0] fake trainer: step" in out
    assert all(f"[worker {w}] (no training log on this worker)" in out for w in (1, 2, 3))


def test_a_single_host_runs_locally_with_the_pjrt_plugin(cloud):
    started(cloud, "v5litepod-8")
    (call,) = cloud.lines(0, "train-calls.jsonl")
    assert call["argv"] == [
        *FLAGS,
        "--gin_file=runtime/tpu_vm.gin",
        "--gin.Runtime.peak_tflops=197.0",
        '--gin.Runtime.accelerator_type="v5litepod-8"',
    ]
    assert call["env"]["NEXT_PLUGGABLE_DEVICE_USE_C_API"] == "true"
    assert call["env"]["TF_PLUGGABLE_DEVICE_LIBRARY_PATH"] == "/lib/libtpu.so"
    assert call["env"]["TPU_NAME"] is None


def test_a_users_own_gin_file_is_copied_to_the_vm(cloud, tmp_path):
    """A config that exists only on the caller's machine reaches the VM, which has the committed
    tree only; the package's configs are named as they are."""
    own = tmp_path / "my experiment.gin"
    own.write_text("Trainer.train_steps = 7\n# a 'quoted' $HOME line\n")
    cloud.launch("create", *TPU, "--accelerator_type=v5litepod-8")
    cloud.launch("setup", *TPU)
    cloud.launch("run", *TPU, "--", "--gin_file=vit_b16.gin", "--gin_file", str(own), *FLAGS[3:])
    cloud.wait_for_log("fake trainer: step")
    (call,) = cloud.lines(0, "train-calls.jsonl")
    assert call["argv"][:3] == [
        "--gin_file=vit_b16.gin",
        "--gin_file",
        "user_configs/0-my experiment.gin",
    ]
    copy = cloud.worker(0) / "framework-tpu" / "src" / "user_configs" / "0-my experiment.gin"
    assert copy.read_text() == own.read_text()


def test_a_detached_run_is_followed_stopped_with_sigterm_and_reported(cloud):
    started(cloud, "v4-8")
    status = cloud.launch("status", *TPU).stdout
    assert "TPU pod1 (v4-8, us-central2-b): READY" in status
    assert "training: running on worker 0 (pid " in status
    assert "already running" in cloud.launch("run", *TPU, "--", *FLAGS, status=3).stderr
    logs = subprocess.Popen(
        [sys.executable, "launch/tpu_pod.py", "logs", *TPU, "--follow", "--lines=1"],
        cwd=REPO_DIR,
        env=cloud.env(),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    watchdog = threading.Timer(20, os.killpg, (logs.pid, signal.SIGKILL))
    watchdog.start()
    try:
        streamed = [logs.stdout.readline() for _ in range(4)]
    finally:
        watchdog.cancel()
        os.killpg(logs.pid, signal.SIGKILL)
        logs.wait()
    assert streamed[0].startswith("running: gcloud") and "fake trainer: step" in streamed[-1]
    out = cloud.launch("stop", *TPU).stdout
    assert "sent SIGTERM to training" in out and "training exited with status 42" in out
    cloud.wait_for_log("preempted: saved a checkpoint")
    assert "training: exited with status 42 after `stop`" in cloud.launch("status", *TPU).stdout
    assert "training is not running" in cloud.launch("stop", *TPU).stdout


def test_run_refuses_a_tpu_that_is_not_ready(cloud):
    cloud.launch("create", *TPU, "--accelerator_type=v4-8", "--spot")
    cloud.update(describe_states=["PREEMPTED"])
    error = cloud.launch("run", *TPU, "--", *FLAGS, status=75).stderr
    assert "TPU pod1 is PREEMPTED: `resume` recreates it" in error


# --- Preemption -------------------------------------------------------------------------------


def test_a_preempted_slice_resumes_the_same_command_from_the_same_model_dir(cloud):
    started(cloud, "v4-8", "--spot")
    cloud.update(describe_states=["PREEMPTED"])
    status = cloud.launch("status", *TPU).stdout
    assert "READY" not in status and "PREEMPTED" in status and "`resume`" in status
    before = len(cloud.calls())
    out = cloud.launch("resume", *TPU).stdout
    assert "TPU pod1 is PREEMPTED: recreating it" in out
    recreated = cloud.calls()[before:]
    assert [call[3] for call in recreated if call[2] == "tpu-vm"][:4] == [
        "describe",
        "delete",
        "create",
        "ssh",  # the TensorFlow check of `setup`
    ]
    assert "--spot" in next(call for call in recreated if call[3] == "create")
    cloud.wait_for_log("fake trainer: step")
    (call,) = cloud.lines(0, "train-calls.jsonl")  # on the new VM's fresh disk
    assert call["argv"][: len(FLAGS)] == FLAGS  # model_dir=gs://bucket/runs/a b, as recorded
    assert "nothing to resume" in cloud.launch("resume", *TPU).stdout


def test_run_until_done_resumes_after_a_preemption_and_ends_when_training_does(cloud):
    cloud.update(train_seconds=1.0)
    cloud.launch("create", *TPU, "--accelerator_type=v4-8", "--spot", "--queued")
    cloud.launch("setup", *TPU)
    cloud.update(describe_states=["READY", "PREEMPTED"])
    out = cloud.launch("run", *TPU, "--until_done", "--", *FLAGS).stdout
    assert "TPU pod1: PREEMPTED; resume 1 of 10" in out
    assert "training on pod1 finished" in out
    assert verbs(cloud.calls()).count("queued-resources create") == 2
    assert [c["argv"][: len(FLAGS)] for c in cloud.lines(0, "train-calls.jsonl")] == [FLAGS]


# --- Failures ---------------------------------------------------------------------------------


def test_an_ssh_failure_stops_the_launcher_with_its_status(cloud):
    cloud.launch("create", *TPU, "--accelerator_type=v4-8")
    cloud.update(fail_ssh=255)
    error = cloud.launch("status", *TPU, status=255).stderr
    assert "Connection timed out" in error and "failed with status 255" in error


def test_a_failing_step_stops_the_launcher_with_its_status(tmp_path):
    fake_gcloud = tmp_path / "gcloud"
    fake_gcloud.write_text('#!/bin/sh\necho "$@" >> calls\nexit 3\n')
    fake_gcloud.chmod(0o755)
    result = subprocess.run(
        [sys.executable, str(REPO_DIR / "launch/tpu_pod.py"), "delete", *TPU],
        cwd=tmp_path,
        env={"PATH": f"{tmp_path}:/usr/bin:/bin", "XDG_CACHE_HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 3 and "failed with status 3" in result.stderr
    assert (tmp_path / "calls").read_text().startswith("compute tpus tpu-vm delete pod1")


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", *TPU], "needs the flags for framework.train"),
        (["setup", *TPU, "--", "--x"], "takes no training flags"),
        (["create", "--zone=z"], "--name"),
        (["logs", *TPU, "--worker=first"], "--worker must be"),
        (["setup", *TPU, "--libtpu_flags=--a='b'"], "must be a plain --flag=value"),
        (["resume", *TPU, "--accelerator_type=v4-8"], "no recorded run"),
        (["run", *TPU, "--", "--model_dir=runs/x"], "--model_dir=runs/x is relative"),
        (["run", *TPU, "--", "--model_dir", "runs/x"], "--model_dir=runs/x is relative"),
        (["run", *TPU, "--", "--gin_file=mine.gin"], "--gin_file=mine.gin is neither a file here"),
    ],
)
def test_bad_usage(cloud, args, message):
    """One `error:` line that says what to do, not argparse's usage block."""
    stderr = cloud.launch(*args, status=2).stderr
    assert [line for line in stderr.splitlines() if message in line][0].startswith("error: ")
    assert "usage:" not in stderr


def test_the_local_clusters_bad_usage_is_one_error_line():
    result = subprocess.run(
        [sys.executable, str(REPO_DIR / "launch" / "local_cluster.py"), "--num_workers=0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr == "error: --num_workers must be at least 1 (see --help)\n"
