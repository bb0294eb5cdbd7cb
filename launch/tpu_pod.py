"""Creates a Cloud TPU VM or pod slice, installs the project on it, and trains there detached.

    python launch/tpu_pod.py create   --name=NAME --zone=ZONE --accelerator_type=v4-32 [--spot]
                                      [--queued [--no_wait]]
    python launch/tpu_pod.py setup    --name=NAME --zone=ZONE
    python launch/tpu_pod.py run      --name=NAME --zone=ZONE [--until_done] -- \
        --gin_file=vit_b16.gin --model_dir=gs://BUCKET/runs/vit_b16
    python launch/tpu_pod.py logs     --name=NAME --zone=ZONE [--follow] [--worker=all]
    python launch/tpu_pod.py status   --name=NAME --zone=ZONE
    python launch/tpu_pod.py stop     --name=NAME --zone=ZONE
    python launch/tpu_pod.py resume   --name=NAME --zone=ZONE
    python launch/tpu_pod.py delete   --name=NAME --zone=ZONE
    python launch/tpu_pod.py versions --zone=ZONE [--accelerator_type=v4-32]

Every step is a `gcloud` (or `git`) command; `--dry_run` prints them exactly and runs nothing.
Otherwise they run one after the other and the first failure stops the launcher with that
command's exit status (nothing is retried silently).

How a TPU runs TensorFlow decides the shape of `run`. A single-host TPU VM (v4-8, v5litepod-8,
v6e-8, ...) runs the client itself: `tpu='local'` with the PJRT plug-in (libtpu). A multi-host
slice (v4-16 and up, v5litepod-16 and up, v5p-16 and up) runs the image's TPU worker service on
every host, and ONE TensorFlow client on worker 0 drives all of them through
`TPUClusterResolver(tpu=NAME)`; a client per host would be several chiefs writing one model_dir.
`run` therefore always starts a single training process, on worker 0, detached from the ssh
session (it outlives a dropped connection); `logs`, `status` and `stop` look at it later, and
`resume` recreates a preempted Spot slice and restarts the recorded command. What `create` and
`run` were given is kept in a small record per TPU under ~/.cache/framework/tpu_pod/ so that
`resume` can repeat it.

No TPU is reachable from this project's CI: the tests drive this launcher against a stand-in
`gcloud` (tests/fake_gcloud.py) that plays TPU states and runs the remote scripts in local
directories; what only a real TPU can show is listed in docs/launch.md.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parent.parent
# The TensorFlow versions the project supports, and the one TPU runtimes carry: the
# `tensorflow-tpu` wheels stop at 2.20.0, so a TPU VM runs 2.20 even where the project
# is tested on 2.21.
SUPPORTED_TENSORFLOW = ("2.20", "2.21")
TPU_TENSORFLOW = "2.20.0"
# Accelerator types name TensorCores (v2, v3, v4, v5p: 2 per chip, 4 chips per host) or chips
# (v5e, v6e: up to 8 per host); either way a type above 8 spans several hosts.
CORE_NAMED = ("v2", "v3", "v4", "v5p")
CHIP_NAMED = ("v5litepod", "v5e", "v6e")
# Peak bfloat16 TFLOP/s of one TensorFlow TPU device (what MFU is measured against: TPUs report
# no type to TensorFlow, so the launcher binds `Runtime.peak_tflops`). From Google's datasheets,
# per chip: v2 45, v3 123, v4 275, v5p 459, v5e 197, v6e 918; TensorFlow makes one device per
# TensorCore on v2 and v3 (two per chip) and one per chip from v4 on (megacore).
TPU_PEAK_TFLOPS = {
    "v2": 22.5,
    "v3": 61.5,
    "v4": 275.0,
    "v5p": 459.0,
    "v5litepod": 197.0,
    "v5e": 197.0,
    "v6e": 918.0,
}
# Families whose chips the TPU compiler can plan for on any host (framework/memory/tpu.py's
# TPU_CHIPS; a test compares the two): the launcher binds `Runtime.accelerator_type` for them, so
# that `Trainer.remat_policy = "auto"` plans with the TPU compiler for the chip the run has.
PLANNABLE = ("v4", "v5p", "v5litepod", "v5e", "v6e")
SINGLE_HOST_MAX = 8
# Remote paths: everything the launcher writes on a worker lives in this one directory, marked
# as its own so that `setup` never replaces a directory it did not make.
REMOTE_DIR = "$HOME/framework-tpu"
USER_CONFIGS = "user_configs"  # the user's own gin files, in the VM's checkout
MARKER = ".made-by-launch-tpu_pod"
WORKER_NUMBER_URL = (
    "http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number"
)
RUNTIME_SERVICE = "/etc/systemd/system/tpu-runtime.service"
PREEMPTED_EXIT_CODE = 42  # framework.train: SIGTERM arrived, a checkpoint was saved
EXIT_REFUSED = 3  # a remote check refused to go on (its message says why)
EXIT_NOT_READY = 75  # the TPU is not in a state to do this now (EX_TEMPFAIL)
READY = "READY"
RECREATE_STATES = {"PREEMPTED", "TERMINATED", "NOT_FOUND", "SUSPENDED", "FAILED"}
TRANSIENT_STATES = {
    "CREATING",
    "STARTING",
    "RESTARTING",
    "REPAIRING",
    "ACCEPTED",
    "PROVISIONING",
    "WAITING_FOR_RESOURCES",
    "SUSPENDING",
    "DELETING",
}
QUEUED_WAITING = {"CREATING", "ACCEPTED", "PROVISIONING", "WAITING_FOR_RESOURCES"}
RECORDED = ("accelerator_type", "runtime_version", "spot", "reserved", "queued")
# One line per TensorFlow distribution, read from package metadata: importing TensorFlow on a TPU
# VM would load libtpu and could take the TPU from a running job.
TF_DISTRIBUTIONS = ("tensorflow-tpu", "tensorflow", "tensorflow-cpu", "tf-nightly-tpu")
TF_VERSION_SNIPPET = (
    "import importlib.metadata as m; "
    'names = {d.metadata["Name"].lower().replace("_", "-"): d.version for d in m.distributions()}; '
    f"found = [(n, names[n]) for n in {list(TF_DISTRIBUTIONS)} if n in names]; ".replace("'", '"')
    + 'print(*[f"tensorflow-distribution {n} {v}" for n, v in found] '
    'or ["tensorflow-distribution none -"], sep="\\n")'
)
TF_MINOR_SNIPPET = (
    "import importlib.metadata as m; "
    'names = {d.metadata["Name"].lower().replace("_", "-"): d.version for d in m.distributions()}; '
    f"print(next(names[n] for n in {list(TF_DISTRIBUTIONS)} if n in names)".replace("'", '"')
    + '.rsplit(".", 1)[0])'
)
# The project's own requirements minus TensorFlow and tensorflow-text (and the test extras):
# read from the installed metadata, so setup.py stays the one list.
LIGHT_REQUIREMENTS_SNIPPET = (
    "import importlib.metadata as m; "
    'print(*[r for r in m.requires("framework") or [] '
    'if "extra ==" not in r and not r.lower().startswith("tensorflow")], sep="\\n")'
)


class LaunchError(Exception):
    """A step cannot go on: one line for the user and the launcher's exit status."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


# --- Running commands -------------------------------------------------------------------------


class Runner:
    """Runs commands one at a time and stops at the first failure; `dry_run` only prints them."""

    def __init__(self, dry_run: bool):
        self.dry_run = dry_run

    def _announce(self, command: Sequence[str]) -> None:
        print(("would run: " if self.dry_run else "running: ") + shlex.join(command), flush=True)

    def run(self, command: Sequence[str]) -> None:
        """Runs `command` with its output on the terminal; a failure raises with its status."""
        self._announce(command)
        if not self.dry_run:
            _check(command, _execute(command, capture=False))

    def capture(self, command: Sequence[str]) -> subprocess.CompletedProcess | None:
        """Runs `command` for its output (None in a dry run); the caller checks its status."""
        self._announce(command)
        return None if self.dry_run else _execute(command, capture=True)

    def output(self, command: Sequence[str]) -> str | None:
        """The standard output of a command that must succeed (None in a dry run)."""
        result = self.capture(command)
        if result is None:
            return None
        _check(command, result)
        return result.stdout


def _execute(command: Sequence[str], capture: bool) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(command, check=False, capture_output=capture, text=True)
    except FileNotFoundError:
        raise LaunchError(
            f"{command[0]} is not installed (the Google Cloud SDK provides gcloud)", 127
        ) from None


def _check(command: Sequence[str], result: subprocess.CompletedProcess) -> None:
    if result.returncode != 0:
        if result.stderr:
            sys.stderr.write(result.stderr)
        raise LaunchError(
            f"`{shlex.join(command[:6])} ...` failed with status {result.returncode}",
            result.returncode,
        )


# --- gcloud commands --------------------------------------------------------------------------


def _project(args: argparse.Namespace) -> list[str]:
    return [f"--project={args.project}"] if args.project else []


def _tpus(args: argparse.Namespace, resource: str, verb: str) -> list[str]:
    """`gcloud compute tpus RESOURCE VERB NAME --zone=... [--project=...]`."""
    return [
        "gcloud",
        "compute",
        "tpus",
        resource,
        verb,
        args.name,
        f"--zone={args.zone}",
        *_project(args),
    ]


def ssh(args: argparse.Namespace, worker: str, script: str) -> list[str]:
    """`gcloud ... ssh` running the shell `script` on one worker (an index) or on `all`."""
    return [*_tpus(args, "tpu-vm", "ssh"), f"--worker={worker}", f"--command={script}"]


def create_command(args: argparse.Namespace) -> list[str]:
    """A TPU VM directly (gcloud waits until it is READY), or a queued resource request."""
    tier = ["--spot"] if args.spot else ["--reserved"] if args.reserved else []
    if args.queued:
        return [
            *_tpus(args, "queued-resources", "create"),
            f"--node-id={args.name}",
            f"--accelerator-type={args.accelerator_type}",
            f"--runtime-version={args.runtime_version}",
            *tier,
        ]
    return [
        *_tpus(args, "tpu-vm", "create"),
        f"--accelerator-type={args.accelerator_type}",
        f"--version={args.runtime_version}",
        *tier,
    ]


def delete_command(args: argparse.Namespace) -> list[str]:
    """Deletes the TPU; `--force` also deletes a queued resource's TPU."""
    if args.queued:
        return [*_tpus(args, "queued-resources", "delete"), "--force", "--quiet"]
    return [*_tpus(args, "tpu-vm", "delete"), "--quiet"]


# --- Accelerator types and runtimes -----------------------------------------------------------


def accelerator_family(accelerator_type: str) -> tuple[str, int]:
    """('v4', 32) for 'v4-32'; unknown generations are an error rather than a guess."""
    match = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", accelerator_type)
    if not match or match[1] not in (*CORE_NAMED, *CHIP_NAMED):
        known = ", ".join(f"{family}-N" for family in (*CORE_NAMED, *CHIP_NAMED))
        raise LaunchError(f"unknown accelerator type {accelerator_type!r} (known: {known})", 2)
    return match[1], int(match[2])


def is_multi_host(accelerator_type: str) -> bool:
    """Whether the slice spans several TPU VMs (and so needs a `-pod-` runtime and one client)."""
    _, size = accelerator_family(accelerator_type)
    return size > SINGLE_HOST_MAX


def default_runtime(accelerator_type: str) -> str:
    """`tpu-vm-tf-X.Y.Z[-pod]-pjrt`, Cloud TPU's naming for TensorFlow runtimes (see docs)."""
    pod = "-pod" if is_multi_host(accelerator_type) else ""
    return f"tpu-vm-tf-{TPU_TENSORFLOW}{pod}-pjrt"


@dataclass(frozen=True)
class Runtime:
    """A TensorFlow TPU runtime name taken apart: `tpu-vm-tf-2.20.0-pod-pjrt[-HARDWARE]`."""

    name: str
    tensorflow: tuple[int, int, int]
    pod: bool
    pjrt: bool
    hardware: str | None

    @classmethod
    def parse(cls, name: str) -> Runtime | None:
        match = re.fullmatch(r"tpu-vm-tf-(\d+)\.(\d+)\.(\d+)(-pod)?(-pjrt|-se)?(?:-(.+))?", name)
        if not match:
            return None
        version = (int(match[1]), int(match[2]), int(match[3]))
        return cls(name, version, bool(match[4]), match[5] == "-pjrt", match[6])

    def supported(self) -> bool:
        return f"{self.tensorflow[0]}.{self.tensorflow[1]}" in SUPPORTED_TENSORFLOW

    def fits(self, accelerator_type: str) -> bool:
        """Pod-ness matches, and a hardware suffix (seen as `-v5e-and-v6`) names this family."""
        family, _ = accelerator_family(accelerator_type)
        hardware = {"v5e-and-v6": CHIP_NAMED, "v5p-and-below": CORE_NAMED}
        fits_hardware = self.hardware is None or family in hardware.get(self.hardware, ())
        return self.pod == is_multi_host(accelerator_type) and fits_hardware


def newest_runtime(names: Sequence[str], accelerator_type: str) -> str | None:
    """The newest PJRT TensorFlow runtime among `names` for a supported TensorFlow.

    Of two builds of one TensorFlow version, the one made for this hardware family wins.
    """
    runtimes = [Runtime.parse(name) for name in names]
    fitting = [
        runtime
        for runtime in runtimes
        if runtime and runtime.pjrt and runtime.supported() and runtime.fits(accelerator_type)
    ]
    newest = max(fitting, key=lambda r: (r.tensorflow, r.hardware is not None), default=None)
    return newest.name if newest else None


# --- The local record of each TPU -------------------------------------------------------------


def record_path(args: argparse.Namespace) -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return (
        cache
        / "framework"
        / "tpu_pod"
        / f"{args.project or 'default'}.{args.zone}.{args.name}.json"
    )


def load_record(args: argparse.Namespace) -> dict:
    path = record_path(args)
    return json.loads(path.read_text()) if path.is_file() else {}


def save_record(
    args: argparse.Namespace, runner: Runner, replace: bool = False, **fields: object
) -> None:
    """Adds `fields` to the TPU's record (what `resume` repeats), or starts a new record with
    them (`replace`); nothing in a dry run."""
    if runner.dry_run:
        return
    path = record_path(args)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {} if replace else load_record(args)
    path.write_text(json.dumps({**record, **fields}, indent=1) + "\n")


def apply_record(args: argparse.Namespace) -> None:
    """Fills the options not given on the command line from the TPU's record."""
    record = load_record(args)
    for field in RECORDED:
        if getattr(args, field) is None:
            setattr(args, field, record.get(field))
    if not args.train_args:
        args.train_args = record.get("train_args", [])


def accelerator_type(args: argparse.Namespace, runner: Runner) -> str:
    """The TPU's accelerator type: given, recorded at `create`, or asked from gcloud."""
    if args.accelerator_type:
        return args.accelerator_type
    if runner.dry_run:
        raise LaunchError(
            f"no record of {args.name}: pass --accelerator_type (a dry run asks gcloud nothing)", 2
        )
    output = runner.output([*_tpus(args, "tpu-vm", "describe"), "--format=value(acceleratorType)"])
    args.accelerator_type = output.strip()
    return args.accelerator_type


# --- Remote shell scripts ---------------------------------------------------------------------


def _script(*statements: str) -> str:
    """One shell line (so `--dry_run` prints one line per command) that stops at a failure."""
    return "; ".join(["set -e", f'D="{REMOTE_DIR}"', *statements])


def _refuse(condition: str, message: str) -> str:
    return (
        f"if {condition}; then echo {shlex.quote('error: ' + message)} >&2; exit {EXIT_REFUSED}; fi"
    )


# Runs its arguments (the training command) with output to the log, recording pid and exit status.
DETACHED = (
    'cd "$FRAMEWORK_TPU_DIR"; echo "=== $(date -u +%FT%TZ) start: $*" >> train.log; '
    'cd src; "$@" >> ../train.log 2>&1 & echo $! > ../train.pid; wait $!; echo $? > ../train.exit'
)
TRAINING_ALIVE = '[ -f "$D/train.pid" ] && kill -0 "$(cat "$D/train.pid")" 2>/dev/null'


def _clean_tpu_holders() -> str:
    """Stops processes that still hold a single-host TPU (a crashed run keeps libtpu's devices).

    Only on single-host VMs: on a pod the image's TPU worker service holds the devices and must
    keep them. The lock file is libtpu's own; Google's TF test harness removes it the same way.
    """
    return (
        "pids=$(sudo lsof -t /dev/accel* /dev/vfio/* 2>/dev/null | sort -u | tr '\\n' ' '); "
        'if [ -n "${pids// /}" ]; then echo "stopping stale TPU holders: $pids"; '
        "sudo kill -9 $pids || true; fi; sudo rm -f /tmp/libtpu_lockfile"
    )


def install_script(archive: str, multi_host: bool) -> str:
    """Unpacks the project into the launcher's directory and installs it around the image's TF.

    TPU images ship TensorFlow as the `tensorflow-tpu` distribution, which pip does not count as
    `tensorflow`: `pip install -e .` would install the CPU wheel over it. So the project goes in
    with `--no-deps`, tensorflow-text matching the image's TensorFlow goes in with `--no-deps`
    (it requires `tensorflow` by name), and the remaining light requirements (gin-config,
    absl-py, matplotlib, ...) are installed under a constraints file that pins every package
    already installed: pip fails rather than replace one of the image's packages.
    """
    return _script(
        _refuse(
            f'[ -e "$D" ] && [ ! -e "$D/{MARKER}" ]',
            "~/framework-tpu exists and was not made by launch/tpu_pod.py; move it away",
        ),
        _refuse(TRAINING_ALIVE, "training is running on this TPU VM: `stop` it before `setup`"),
        *([] if multi_host else [_clean_tpu_holders()]),
        f'mkdir -p "$D" && touch "$D/{MARKER}"',
        'rm -rf "$D/src" && mkdir "$D/src"',
        f'tar -xzf "$HOME/{archive}" -C "$D/src" && rm -f "$HOME/{archive}"',
        'cd "$D/src"',
        'python3 -m pip list --format=freeze --exclude-editable > "$D/constraints.txt"',
        "python3 -m pip install --no-deps -e .",
        f"tf=$(python3 -c {shlex.quote(TF_MINOR_SNIPPET)})",
        'python3 -m pip install --no-deps -c "$D/constraints.txt" "tensorflow-text==$tf.*"',
        f'python3 -c {shlex.quote(LIGHT_REQUIREMENTS_SNIPPET)} > "$D/requirements.txt"',
        'python3 -m pip install -c "$D/constraints.txt" -r "$D/requirements.txt"',
        'echo "installed $D/src on the image\'s TensorFlow $tf"',
    )


def libtpu_service_script(flags: Sequence[str]) -> str:
    """Sets LIBTPU_INIT_ARGS of the TPU worker service that a pod runtime runs on every host.

    On a pod slice the client on worker 0 does not load libtpu (TPU_LOAD_LIBRARY=0); each host's
    `tpu-runtime` container does, so libtpu flags only take effect in that container's
    environment. The service's docker command gets `"--env=LIBTPU_INIT_ARGS=..."` (one word for
    systemd, replacing an earlier one) and is restarted; empty flags remove the setting.
    """
    setting = f' "--env=LIBTPU_INIT_ARGS={" ".join(flags)}"' if flags else ""
    edit = (
        'sudo sed -i -e \'s| "--env=LIBTPU_INIT_ARGS=[^"]*"||\' '
        f"-e 's|--name=tpu-runtime|--name=tpu-runtime{setting}|' {RUNTIME_SERVICE}"
    )
    return _script(
        _refuse(
            f"! grep -q -- --name=tpu-runtime {RUNTIME_SERVICE}",
            f"no tpu-runtime docker command in {RUNTIME_SERVICE}: is this a -pod- runtime?",
        ),
        edit,
        "sudo systemctl daemon-reload && sudo systemctl restart tpu-runtime",
        f"echo {shlex.quote('tpu-runtime restarted with LIBTPU_INIT_ARGS=' + ' '.join(flags))}",
    )


def start_script(
    train_args: Sequence[str], environment: dict[str, str], files: dict[str, str] | None = None
) -> str:
    """Starts `python3 -m framework.train` detached on this worker and returns at once, after
    writing `files` (path in the checkout: text) there.

    `setsid nohup` puts training in a session of its own with no terminal, so a dropped ssh
    connection does not end it; its pid (the Python process itself, so `stop` signals the
    trainer and not a shell) goes to train.pid and its exit status to train.exit.
    """
    train = shlex.join(["python3", "-m", "framework.train", *train_args])
    exports = " ".join(f"{name}={shlex.quote(value)}" for name, value in environment.items())
    writes = [
        f'mkdir -p "$D/src/{USER_CONFIGS}"; printf %s {base64.b64encode(text.encode()).decode()} '
        f'| base64 -d > "$D/src/{path}"'
        for path, text in (files or {}).items()
    ]
    return _script(
        _refuse('[ ! -d "$D/src" ]', "the project is not installed on this TPU VM: run `setup`"),
        _refuse(TRAINING_ALIVE, "training is already running on this TPU: `stop` it first"),
        *writes,
        'rm -f "$D/train.pid" "$D/train.exit" "$D/train.stop"',
        f'export FRAMEWORK_TPU_DIR="$D" {exports}',
        f"{{ setsid nohup bash -c {shlex.quote(DETACHED)} train {train} "
        "> /dev/null 2>&1 < /dev/null & }",
        'for _ in $(seq 100); do [ -s "$D/train.pid" ] && break; sleep 0.1; done',
        'echo "training started on worker 0 (pid $(cat "$D/train.pid")); log: $D/train.log"',
    )


def training_state_script() -> str:
    """Prints one line: `training running PID`, `exited STATUS [stopped]`, `lost` or `never`."""
    return _script(
        f'if {TRAINING_ALIVE}; then echo "training running $(cat "$D/train.pid")"; '
        'elif [ -f "$D/train.exit" ]; then echo "training exited $(cat "$D/train.exit")'
        '$([ -f "$D/train.stop" ] && echo " stopped")"; '
        'elif [ -f "$D/train.pid" ]; then echo "training lost"; '
        'else echo "training never"; fi'
    )


def stop_script(timeout_seconds: int) -> str:
    """SIGTERM to the trainer (it saves a checkpoint and exits 42), then waits for its exit."""
    polls = max(1, timeout_seconds * 5)
    return _script(
        f"if ! {{ {TRAINING_ALIVE}; }}; then echo 'training is not running'; exit 0; fi",
        'pid=$(cat "$D/train.pid"); touch "$D/train.stop"; kill -TERM "$pid"',
        f'echo "sent SIGTERM to training (pid $pid); waiting up to {timeout_seconds} s for it '
        'to save a checkpoint and exit"',
        f'for _ in $(seq {polls}); do [ -f "$D/train.exit" ] && break; sleep 0.2; done',
        _refuse(
            'kill -0 "$pid" 2>/dev/null',
            f"training is still running after {timeout_seconds} s (see `logs`)",
        ),
        'echo "training exited with status $(cat "$D/train.exit" 2>/dev/null || echo unknown)"',
    )


def logs_script(lines: int, follow: bool, label: bool) -> str:
    """The training log's tail (or a stream); with `label`, each line says which worker."""
    if follow:
        tail = f'tail -n {lines} -F "$D/train.log" 2>&1'
    else:
        tail = (
            f'{{ if [ -f "$D/train.log" ]; then tail -n {lines} "$D/train.log"; '
            "else echo '(no training log on this worker)'; fi; }"
        )
    if not label:
        return _script(tail)
    worker = f"w=$(curl -sf -H Metadata-Flavor:Google {WORKER_NUMBER_URL} || echo '?')"
    return _script(worker, f'{tail} | sed -u "s/^/[worker $w] /"')


# --- Asking gcloud and the workers ------------------------------------------------------------


def _described_state(runner: Runner, command: list[str]) -> str | None:
    """The state a `describe` prints; NOT_FOUND when the resource does not exist."""
    result = runner.capture(command)
    if result is None:
        return None
    if result.returncode != 0 and "NOT_FOUND" in result.stderr:
        return "NOT_FOUND"
    _check(command, result)
    return result.stdout.strip()


def slice_state(args: argparse.Namespace, runner: Runner) -> str | None:
    """READY, PREEMPTED, ...; for a queued resource its own state until it is ACTIVE."""
    if args.queued:
        queued = _described_state(
            runner, [*_tpus(args, "queued-resources", "describe"), "--format=value(state.state)"]
        )
        if queued != "ACTIVE":
            return queued
    return _described_state(runner, [*_tpus(args, "tpu-vm", "describe"), "--format=value(state)"])


@dataclass(frozen=True)
class Training:
    """What worker 0 says about the training process the launcher started."""

    state: str  # running, exited, lost (no exit status: killed with its shell), never
    status: int | None = None
    stopped: bool = False  # `stop` sent the SIGTERM (not a maintenance event)
    pid: int | None = None


def training_state(args: argparse.Namespace, runner: Runner) -> Training | None:
    output = runner.output(ssh(args, "0", training_state_script()))
    if output is None:
        return None
    line = next((line for line in output.splitlines() if line.startswith("training ")), "")
    words = line.split()[1:] or ["lost"]
    if words[0] == "running":
        return Training("running", pid=int(words[1]))
    if words[0] == "exited":
        return Training("exited", status=int(words[1]), stopped="stopped" in words)
    return Training(words[0])


def check_tensorflow(args: argparse.Namespace, runner: Runner) -> None:
    """Fails with one line unless every worker's TensorFlow is a version the project supports."""
    output = runner.output(ssh(args, "all", f"python3 -c {shlex.quote(TF_VERSION_SNIPPET)}"))
    if output is None:
        return
    found = sorted(
        {
            (words[1], words[2])
            for words in (line.split() for line in output.splitlines())
            if len(words) == 3 and words[0] == "tensorflow-distribution"
        }
    )
    minors = {".".join(version.split(".")[:2]) for _, version in found}  # "-" for none
    if found and minors <= set(SUPPORTED_TENSORFLOW):
        print(f"TensorFlow {', '.join(v for _, v in found)} on every worker", flush=True)
        return
    seen = ", ".join("missing" if n == "none" else f"{n} {v}" for n, v in found) or "unknown"
    raise LaunchError(
        f"the TPU VM's TensorFlow is {seen}; this project supports TensorFlow "
        f"{' and '.join(SUPPORTED_TENSORFLOW)}: recreate the TPU with a runtime that carries one "
        f"(`python launch/tpu_pod.py versions --zone={args.zone}` lists them)",
        EXIT_REFUSED,
    )


# --- Subcommands ------------------------------------------------------------------------------


def create(args: argparse.Namespace, runner: Runner) -> None:
    if not args.accelerator_type:
        raise LaunchError("`create` needs --accelerator_type (e.g. v4-8, v5litepod-16)", 2)
    args.runtime_version = args.runtime_version or default_runtime(args.accelerator_type)
    try:
        runner.run(create_command(args))
    except LaunchError as error:
        raise LaunchError(
            f"{error} (does runtime {args.runtime_version} exist in {args.zone}? "
            f"`python launch/tpu_pod.py versions --zone={args.zone}` lists them)",
            error.status,
        ) from None
    recorded = {field: getattr(args, field) for field in RECORDED}
    save_record(args, runner, replace=True, **recorded, train_args=args.train_args)
    if args.queued and not args.no_wait:
        wait_until_active(args, runner)


def wait_until_active(args: argparse.Namespace, runner: Runner) -> None:
    """Polls a queued resource until it is ACTIVE, for at most --wait_minutes."""
    command = [*_tpus(args, "queued-resources", "describe"), "--format=value(state.state)"]
    deadline = time.monotonic() + args.wait_minutes * 60
    while True:
        state = _described_state(runner, command)
        if state is None or state == "ACTIVE":
            return
        if state not in QUEUED_WAITING:
            raise LaunchError(f"queued resource {args.name} is {state}, not waiting for capacity")
        if time.monotonic() >= deadline:
            raise LaunchError(
                f"queued resource {args.name} is still {state} after {args.wait_minutes:g} min; "
                "`status` checks again later, `delete` withdraws the request",
                EXIT_NOT_READY,
            )
        print(f"queued resource {args.name}: {state}; waiting", flush=True)
        time.sleep(args.poll_seconds)


def setup(args: argparse.Namespace, runner: Runner) -> None:
    """Checks TensorFlow on every worker, then copies the committed tree there and installs it."""
    multi_host = is_multi_host(accelerator_type(args, runner))
    if args.libtpu_flags is not None and not multi_host:
        raise LaunchError(
            "--libtpu_flags is for pod slices; on a single host use Runtime.libtpu_flags", 2
        )
    check_tensorflow(args, runner)
    archive = f"framework-{uuid.uuid4().hex[:12]}.tar.gz"
    local = Path(tempfile.gettempdir()) / archive
    try:
        runner.run(
            [
                "git",
                "-C",
                str(PROJECT_DIR),
                "archive",
                "--format=tar.gz",
                f"--output={local}",
                "HEAD",
            ]
        )
        runner.run(
            ["gcloud", "compute", "tpus", "tpu-vm", "scp", str(local), f"{args.name}:{archive}"]
            + [f"--zone={args.zone}", *_project(args), "--worker=all"]
        )
    finally:
        local.unlink(missing_ok=True)
    runner.run(ssh(args, "all", install_script(archive, multi_host)))
    if args.libtpu_flags is not None:
        runner.run(ssh(args, "all", libtpu_service_script(args.libtpu_flags.split())))


def training_command(
    args: argparse.Namespace, accelerator_type: str
) -> tuple[list[str], dict[str, str]]:
    """The trainer's flags and environment: one client for the whole pod, or the local TPU.

    The runtime config comes last so it wins over a model config (as in launch/multi_gpu.sh);
    `--gin.` bindings still override it. On a pod the TPU's name reaches the resolver both as the
    `Runtime.tpu` binding and as TPU_NAME, and TPU_LOAD_LIBRARY=0 keeps the client from loading
    libtpu, which the hosts' TPU worker services own (Google's TF pod tests set the same two).
    The device's peak TFLOP/s and the accelerator type itself (for the TPU compiler's plans)
    are bound from the accelerator type, unless the user binds them.
    """
    peak = []
    family = accelerator_family(accelerator_type)[0]
    if not any("Runtime.peak_tflops" in arg for arg in args.train_args):
        peak = [f"--gin.Runtime.peak_tflops={TPU_PEAK_TFLOPS[family]}"]
    if family in PLANNABLE and not any("Runtime.accelerator_type" in a for a in args.train_args):
        peak.append(f'--gin.Runtime.accelerator_type="{accelerator_type}"')
    if is_multi_host(accelerator_type):
        flags = ["--gin_file=runtime/tpu_pod.gin", f'--gin.Runtime.tpu="{args.name}"']
        environment = {"TPU_NAME": args.name, "TPU_LOAD_LIBRARY": "0"}
    else:
        flags = ["--gin_file=runtime/tpu_vm.gin"]
        environment = {
            "NEXT_PLUGGABLE_DEVICE_USE_C_API": "true",
            "TF_PLUGGABLE_DEVICE_LIBRARY_PATH": "/lib/libtpu.so",
        }
    return [*args.train_args, *flags, *peak], environment


def start_training(args: argparse.Namespace, runner: Runner) -> None:
    train_args, environment = training_command(args, accelerator_type(args, runner))
    train_args, files = shipped_gin_files(train_args)
    runner.run(ssh(args, "0", start_script(train_args, environment, files)))


def _flag_values(train_args: Sequence[str], flag: str) -> list[tuple[int, str]]:
    """(index of the value, value) of each `--flag=X` or `--flag X` among the training flags."""
    found = []
    for i, arg in enumerate(train_args):
        if arg.startswith(f"--{flag}="):
            found.append((i, arg.split("=", 1)[1]))
        elif arg == f"--{flag}" and i + 1 < len(train_args):
            found.append((i + 1, train_args[i + 1]))
    return found


def shipped_gin_files(train_args: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """The training flags with each --gin_file that names a file on this machine pointed at the
    copy the start script writes into the VM's checkout, and those copies' contents by path.

    The VM has the committed tree only (`setup`), so a user's own config would not be found
    there, or another file of the same name would be. A name that is no file here is one of the
    package's configs (`configs/`), read on the VM. `include` lines inside a shipped
    file must name the package's configs too.
    """
    flags, files = list(train_args), {}
    for i, name in _flag_values(train_args, "gin_file"):
        if not Path(name).is_file():
            continue
        copy = f"{USER_CONFIGS}/{len(files)}-{Path(name).name}"
        files[copy] = Path(name).read_text()
        flags[i] = f"--gin_file={copy}" if flags[i].startswith("--gin_file=") else copy
    return flags, files


def unknown_gin_files(train_args: Sequence[str]) -> list[str]:
    """The --gin_file values that are neither a file here nor one of the package's configs."""
    configs = PROJECT_DIR / "framework" / "configs"
    return [
        name
        for _, name in _flag_values(train_args, "gin_file")
        if not Path(name).is_file() and not (configs / name).is_file()
    ]


def require_ready(args: argparse.Namespace, runner: Runner) -> None:
    state = slice_state(args, runner)
    if state not in (None, READY):
        advice = "`resume` recreates it" if state in RECREATE_STATES else "try again when READY"
        raise LaunchError(f"TPU {args.name} is {state}: {advice}", EXIT_NOT_READY)


def run(args: argparse.Namespace, runner: Runner) -> None:
    require_ready(args, runner)
    save_record(args, runner, train_args=args.train_args)
    start_training(args, runner)
    if args.until_done and not runner.dry_run:
        watch(args, runner)


def recreate(args: argparse.Namespace, runner: Runner, state: str | None) -> None:
    """Deletes the preempted slice (unless it is gone), creates it again and sets it up."""
    if state != "NOT_FOUND":
        runner.run(delete_command(args))
    args.no_wait = False  # `setup` needs the new slice ACTIVE
    create(args, runner)
    setup(args, runner)


def resume(args: argparse.Namespace, runner: Runner) -> None:
    """Brings the recorded run back: restarts it, or recreates a preempted slice first."""
    if not args.train_args:
        raise LaunchError(f"no recorded run for {args.name}: give the training flags after --", 2)
    accelerator_type(args, runner)
    state = slice_state(args, runner)
    if state == READY:
        training = training_state(args, runner)
        if training and training.state == "running":
            print(f"training is running on {args.name} (pid {training.pid}): nothing to resume")
            return
    elif state is None or state in RECREATE_STATES:
        print(f"TPU {args.name} is {state or 'PREEMPTED (dry run)'}: recreating it", flush=True)
        recreate(args, runner, state)
    else:
        raise LaunchError(f"TPU {args.name} is {state}: try again when it is READY", EXIT_NOT_READY)
    save_record(args, runner, train_args=args.train_args)
    start_training(args, runner)


def watch(args: argparse.Namespace, runner: Runner) -> None:
    """`run --until_done`: polls until training finishes, resuming after preemptions.

    A run that ends with status 0 is done; SIGTERM from a maintenance event (status 42 without
    `stop`) or a lost trainer is restarted, a preempted slice is recreated; `stop` or any other
    status ends the watch with that status.
    """
    resumes = 0
    while True:
        time.sleep(args.poll_seconds)
        state = slice_state(args, runner)
        if state in TRANSIENT_STATES:
            continue
        if state == READY:
            training = training_state(args, runner)
            if training.state == "running":
                continue
            if training.state == "exited" and training.status == 0:
                print(f"training on {args.name} finished", flush=True)
                return
            restartable = training.state in ("lost", "never") or (
                training.status == PREEMPTED_EXIT_CODE and not training.stopped
            )
            if not restartable:
                status = training.status if training.status is not None else 1
                raise LaunchError(f"training ended with status {status} (see `logs`)", status)
        elif state not in RECREATE_STATES:
            raise LaunchError(f"TPU {args.name} is {state}; stopped watching", EXIT_NOT_READY)
        resumes += 1
        if resumes > args.max_resumes:
            raise LaunchError(f"gave up after {args.max_resumes} resumes", EXIT_NOT_READY)
        print(f"TPU {args.name}: {state}; resume {resumes} of {args.max_resumes}", flush=True)
        if state != READY:
            recreate(args, runner, state)
        start_training(args, runner)


def logs(args: argparse.Namespace, runner: Runner) -> None:
    script = logs_script(args.lines, args.follow, label=args.worker == "all")
    runner.run(ssh(args, args.worker, script))


def status(args: argparse.Namespace, runner: Runner) -> None:
    state = slice_state(args, runner)
    if state is None:
        runner.run(ssh(args, "0", training_state_script()))
        return
    print(f"TPU {args.name} ({args.accelerator_type or 'type unknown'}, {args.zone}): {state}")
    if state != READY:
        advice = " (`resume` recreates it)" if state in RECREATE_STATES else ""
        print(f"training: not running{advice}")
        return
    training = training_state(args, runner)
    described = {
        "running": f"running on worker 0 (pid {training.pid})",
        "exited": f"exited with status {training.status}"
        + (" after `stop`" if training.stopped else ""),
        "lost": "not running, and it left no exit status (killed?)",
        "never": "never started on this TPU",
    }
    print(f"training: {described[training.state]}")


def stop(args: argparse.Namespace, runner: Runner) -> None:
    runner.run(ssh(args, "0", stop_script(args.stop_timeout)))


def delete(args: argparse.Namespace, runner: Runner) -> None:
    runner.run(delete_command(args))
    if not runner.dry_run:
        record_path(args).unlink(missing_ok=True)


def versions(args: argparse.Namespace, runner: Runner) -> None:
    """The zone's TensorFlow runtimes, marking those of a supported TensorFlow."""
    command = ["gcloud", "compute", "tpus", "tpu-vm", "versions", "list", f"--zone={args.zone}"]
    output = runner.output([*command, *_project(args), "--format=value(version)"])
    if output is None:
        return
    names = sorted(name for name in output.split() if name.startswith("tpu-vm-tf-"))
    for name in names:
        runtime = Runtime.parse(name)
        print(name + ("  (supported TensorFlow)" if runtime and runtime.supported() else ""))
    examples = ["v4-8", "v4-32", "v5litepod-8", "v5litepod-16"]
    for accelerator in [args.accelerator_type] if args.accelerator_type else examples:
        newest = newest_runtime(names, accelerator) or "none: pass --runtime_version yourself"
        print(f"newest for {accelerator}: {newest}")


SUBCOMMANDS = {
    "create": create,
    "setup": setup,
    "run": run,
    "logs": logs,
    "status": status,
    "stop": stop,
    "resume": resume,
    "delete": delete,
    "versions": versions,
}


# --- Command line -----------------------------------------------------------------------------


def _split_at_double_dash(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """The launcher's own arguments, and the training flags after the first `--`."""
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="run/resume: ... -- FLAGS FOR framework.train"
    )
    parser.add_argument("subcommand", choices=SUBCOMMANDS)
    parser.add_argument("--name", help="the TPU VM (and queued resource) name")
    parser.add_argument("--zone", required=True, help="e.g. us-central2-b")
    parser.add_argument("--project", help="GCP project (default: gcloud's configured one)")
    parser.add_argument("--accelerator_type", help="e.g. v4-8, v4-32, v5litepod-16, v5p-32")
    parser.add_argument("--runtime_version", help="default: tpu-vm-tf-2.20.0[-pod]-pjrt")
    tier = parser.add_mutually_exclusive_group()
    tier.add_argument("--spot", action="store_true", default=None, help="preemptible capacity")
    tier.add_argument("--reserved", action="store_true", default=None, help="a reservation")
    parser.add_argument("--queued", action="store_true", default=None, help="a queued resource")
    parser.add_argument("--no_wait", action="store_true", help="create --queued: do not wait")
    parser.add_argument("--wait_minutes", type=float, default=60, help="create --queued: bound")
    parser.add_argument("--poll_seconds", type=float, default=30, help="between state checks")
    parser.add_argument("--until_done", action="store_true", help="run: resume until finished")
    parser.add_argument("--max_resumes", type=int, default=10, help="run --until_done: bound")
    parser.add_argument("--libtpu_flags", help="setup on a pod: LIBTPU_INIT_ARGS of the hosts")
    parser.add_argument("--worker", default="0", help="logs: a worker index or 'all'")
    parser.add_argument("--lines", type=int, default=100, help="logs: lines of the tail")
    parser.add_argument("--follow", action="store_true", help="logs: keep streaming")
    parser.add_argument("--stop_timeout", type=int, default=600, help="stop: seconds to wait")
    parser.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
    return parser


def _model_dir(train_args: Sequence[str]) -> str | None:
    """The last --model_dir among the training flags."""
    values = _flag_values(train_args, "model_dir")
    return values[-1][1] if values else None


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = _parser()
    own, train_args = _split_at_double_dash(argv)
    args = parser.parse_args(own)
    args.train_args = train_args
    if train_args and args.subcommand not in ("run", "resume"):
        parser.error(f"`{args.subcommand}` takes no training flags")
    if args.subcommand == "run" and not train_args:
        parser.error("`run` needs the flags for framework.train after --")
    model_dir = _model_dir(train_args)
    if model_dir is not None and "://" not in model_dir and not os.path.isabs(model_dir):
        parser.error(
            f"--model_dir={model_dir} is relative: the trainer runs on the TPU VM, where it would "
            "name a directory on the VM's disk (lost with the VM), not one under this directory; "
            "use gs://BUCKET/... (or an absolute path on the VM)"
        )
    unknown = unknown_gin_files(train_args)
    if unknown:
        parser.error(
            f"--gin_file={unknown[0]} is neither a file here nor one of the package's configs "
            "(configs/): the launcher copies files from this machine to the TPU VM"
        )
    if args.subcommand != "versions" and not args.name:
        parser.error(f"`{args.subcommand}` needs --name")
    if args.worker != "all" and not args.worker.isdigit():
        parser.error(f"--worker must be 'all' or a worker index, got {args.worker!r}")
    for flag in (args.libtpu_flags or "").split():
        if not flag.startswith("--") or re.search(r"[\"'\\|$%`&]", flag):
            parser.error(f"--libtpu_flags: {flag!r} must be a plain --flag=value")
    if args.subcommand not in ("create", "versions"):  # `create` starts a new record
        apply_record(args)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        SUBCOMMANDS[args.subcommand](args, Runner(args.dry_run))
    except LaunchError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.status
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
