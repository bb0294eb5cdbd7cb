"""The launcher's subcommands: create, setup, run, resume, watch, logs, status, stop, delete,
versions; each a sequence of gcloud commands and remote scripts (`gcloud`, `remote`)."""

from __future__ import annotations

import argparse
import shlex
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from framework.core.errors import PreemptedError
from framework.core.releases import SUPPORTED_TENSORFLOW, is_supported_tensorflow
from launch.tpu.errors import LaunchError
from launch.tpu.gcloud import (
    QUEUED_WAITING,
    READY,
    RECREATE_STATES,
    TRANSIENT_STATES,
    Runner,
    accelerator_type,
    create_command,
    delete_command,
    described_state,
    project,
    slice_state,
    ssh,
    tpus,
)
from launch.tpu.records import RECORDED, record_path, save_record
from launch.tpu.remote import (
    EXIT_NOT_READY,
    EXIT_REFUSED,
    TF_VERSION_SNIPPET,
    USER_CONFIGS,
    install_script,
    libtpu_service_script,
    logs_script,
    start_script,
    stop_script,
    training_state_script,
)
from launch.tpu.topology import (
    TpuRuntime,
    default_runtime,
    is_multi_host,
    newest_runtime,
    tpu_generation,
)

# The checkout the launcher ships to the TPU VMs.
PROJECT_DIR = Path(__file__).resolve().parents[2]


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
    if found and all(is_supported_tensorflow(version) for _, version in found):
        print(f"TensorFlow {', '.join(v for _, v in found)} on every worker", flush=True)
        return
    seen = ", ".join("missing" if n == "none" else f"{n} {v}" for n, v in found) or "unknown"
    raise LaunchError(
        f"the TPU VM's TensorFlow is {seen}; this project supports TensorFlow "
        f"{' and '.join(SUPPORTED_TENSORFLOW)}: recreate the TPU with a runtime that carries one "
        f"(`python launch/tpu_pod.py versions --zone={args.zone}` lists them)",
        EXIT_REFUSED,
    )


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
    command = [*tpus(args, "queued-resources", "describe"), "--format=value(state.state)"]
    deadline = time.monotonic() + args.wait_minutes * 60
    while True:
        state = described_state(runner, command)
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
            + [f"--zone={args.zone}", *project(args), "--worker=all"]
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
    The peak TFLOP/s of one TensorFlow device (what MFU is measured against: TPUs report no type
    to TensorFlow) is bound from the accelerator type, and so is the accelerator type itself
    where the TPU compiler plans for its chip (so `Trainer.remat_policy = "auto"` plans for the
    chip the run has; `Runtime` accepts no other); a binding of the user's own wins.
    """
    generation = tpu_generation(accelerator_type)
    bindings = []
    if not any("Runtime.peak_tflops" in arg for arg in args.train_args):
        bindings.append(f"--gin.Runtime.peak_tflops={generation.peak_flops_per_device / 1e12}")
    plannable = generation.compile_only_topology is not None
    if plannable and not any("Runtime.accelerator_type" in arg for arg in args.train_args):
        bindings.append(f'--gin.Runtime.accelerator_type="{accelerator_type}"')
    if is_multi_host(accelerator_type):
        flags = ["--gin_file=runtime/tpu_pod.gin", f'--gin.Runtime.tpu="{args.name}"']
        environment = {"TPU_NAME": args.name, "TPU_LOAD_LIBRARY": "0"}
    else:
        flags = ["--gin_file=runtime/tpu_vm.gin"]
        environment = {
            "NEXT_PLUGGABLE_DEVICE_USE_C_API": "true",
            "TF_PLUGGABLE_DEVICE_LIBRARY_PATH": "/lib/libtpu.so",
        }
    return [*args.train_args, *flags, *bindings], environment


def start_training(args: argparse.Namespace, runner: Runner) -> None:
    train_args, environment = training_command(args, accelerator_type(args, runner))
    train_args, files = shipped_gin_files(train_args)
    runner.run(ssh(args, "0", start_script(train_args, environment, files)))


def flag_values(train_args: Sequence[str], flag: str) -> list[tuple[int, str]]:
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
    for i, name in flag_values(train_args, "gin_file"):
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
        for _, name in flag_values(train_args, "gin_file")
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
                training.status == PreemptedError.exit_status and not training.stopped
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
    output = runner.output([*command, *project(args), "--format=value(version)"])
    if output is None:
        return
    names = sorted(name for name in output.split() if name.startswith("tpu-vm-tf-"))
    for name in names:
        runtime = TpuRuntime.parse(name)
        print(name + ("  (supported TensorFlow)" if runtime and runtime.supported() else ""))
    examples = ["v4-8", "v4-32", "v5litepod-8", "v5litepod-16"]
    for accelerator in [args.accelerator_type] if args.accelerator_type else examples:
        newest = newest_runtime(names, accelerator) or "none: pass --runtime_version yourself"
        print(f"newest for {accelerator}: {newest}")
