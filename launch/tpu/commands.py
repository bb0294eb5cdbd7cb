"""The launcher's subcommands: create, setup, run, resume, watch, logs, status, stop, delete,
versions; each a sequence of gcloud commands and remote scripts (`gcloud`, `remote`), handed the
parts of the command line it reads (`options`)."""

from __future__ import annotations

import shlex
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
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
    create_command,
    delete_command,
    described_state,
    project_flag,
    slice_state,
    ssh,
    tpus,
    with_accelerator_type,
)
from launch.tpu.options import Polling, SliceSpec, Tpu, TrainingJob
from launch.tpu.records import record_path, save_record
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


def training_state(tpu: Tpu, runner: Runner) -> Training | None:
    """What worker 0 says about training (None in a dry run, which asks nothing)."""
    output = runner.output(ssh(tpu, "0", training_state_script()))
    if output is None:
        return None
    line = next((line for line in output.splitlines() if line.startswith("training ")), "")
    words = line.split()[1:] or ["lost"]
    if words[0] == "running":
        return Training("running", pid=int(words[1]))
    if words[0] == "exited":
        return Training("exited", status=int(words[1]), stopped="stopped" in words)
    return Training(words[0])


def check_tensorflow(tpu: Tpu, runner: Runner) -> None:
    """Fails with one line unless every worker's TensorFlow is a version the project supports."""
    output = runner.output(ssh(tpu, "all", f"python3 -c {shlex.quote(TF_VERSION_SNIPPET)}"))
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
        f"(`python launch/tpu_pod.py versions --zone={tpu.zone}` lists them)",
        EXIT_REFUSED,
    )


def creatable(spec: SliceSpec) -> SliceSpec:
    """`spec` ready for `create`: it must name an accelerator type, and the runtime defaults to
    the one for that type (`topology.default_runtime`)."""
    if not spec.accelerator_type:
        raise LaunchError("`create` needs --accelerator_type (e.g. v4-8, v5litepod-16)", 2)
    runtime_version = spec.runtime_version or default_runtime(spec.accelerator_type)
    return replace(spec, runtime_version=runtime_version)


def create(
    tpu: Tpu,
    spec: SliceSpec,
    train_args: Sequence[str],
    runner: Runner,
    *,
    polling: Polling,
    wait: bool,
) -> None:
    """Creates the slice and starts its record with `spec` and `train_args`; with `wait`, a
    queued resource is then polled until it is ACTIVE."""
    spec = creatable(spec)
    try:
        runner.run(create_command(tpu, spec))
    except LaunchError as error:
        raise LaunchError(
            f"{error} (does runtime {spec.runtime_version} exist in {tpu.zone}? "
            f"`python launch/tpu_pod.py versions --zone={tpu.zone}` lists them)",
            error.status,
        ) from None
    save_record(tpu, runner, replace=True, **asdict(spec), train_args=list(train_args))
    if spec.queued and wait:
        wait_until_active(tpu, polling, runner)


def wait_until_active(tpu: Tpu, polling: Polling, runner: Runner) -> None:
    """Polls a queued resource until it is ACTIVE, for at most --wait_minutes."""
    command = [*tpus(tpu, "queued-resources", "describe"), "--format=value(state.state)"]
    deadline = time.monotonic() + polling.wait_minutes * 60
    while True:
        state = described_state(runner, command)
        if state is None or state == "ACTIVE":
            return
        if state not in QUEUED_WAITING:
            raise LaunchError(f"queued resource {tpu.name} is {state}, not waiting for capacity")
        if time.monotonic() >= deadline:
            raise LaunchError(
                f"queued resource {tpu.name} is still {state} after {polling.wait_minutes:g} min; "
                "`status` checks again later, `delete` withdraws the request",
                EXIT_NOT_READY,
            )
        print(f"queued resource {tpu.name}: {state}; waiting", flush=True)
        time.sleep(polling.poll_seconds)


def setup(
    tpu: Tpu, accelerator_type: str, libtpu_flags: Sequence[str] | None, runner: Runner
) -> None:
    """Checks TensorFlow on every worker, then copies the committed tree there and installs it;
    on a pod, `libtpu_flags` (unless None) become the hosts' LIBTPU_INIT_ARGS."""
    multi_host = is_multi_host(accelerator_type)
    if libtpu_flags is not None and not multi_host:
        raise LaunchError(
            "--libtpu_flags is for pod slices; on a single host use Runtime.libtpu_flags", 2
        )
    check_tensorflow(tpu, runner)
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
            ["gcloud", "compute", "tpus", "tpu-vm", "scp", str(local), f"{tpu.name}:{archive}"]
            + [f"--zone={tpu.zone}", *project_flag(tpu.project), "--worker=all"]
        )
    finally:
        local.unlink(missing_ok=True)
    runner.run(ssh(tpu, "all", install_script(archive, multi_host)))
    if libtpu_flags is not None:
        runner.run(ssh(tpu, "all", libtpu_service_script(libtpu_flags)))


def training_command(
    name: str, accelerator_type: str, train_args: Sequence[str]
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
    if not any("Runtime.peak_tflops" in arg for arg in train_args):
        bindings.append(f"--gin.Runtime.peak_tflops={generation.peak_flops_per_device / 1e12}")
    plannable = generation.compile_only_topology is not None
    if plannable and not any("Runtime.accelerator_type" in arg for arg in train_args):
        bindings.append(f'--gin.Runtime.accelerator_type="{accelerator_type}"')
    if is_multi_host(accelerator_type):
        flags = ["--gin_file=runtime/tpu_pod.gin", f'--gin.Runtime.tpu="{name}"']
        environment = {"TPU_NAME": name, "TPU_LOAD_LIBRARY": "0"}
    else:
        flags = ["--gin_file=runtime/tpu_vm.gin"]
        environment = {
            "NEXT_PLUGGABLE_DEVICE_USE_C_API": "true",
            "TF_PLUGGABLE_DEVICE_LIBRARY_PATH": "/lib/libtpu.so",
        }
    return [*train_args, *flags, *bindings], environment


def start_training(
    tpu: Tpu, accelerator_type: str, train_args: Sequence[str], runner: Runner
) -> None:
    """Starts framework.train with `train_args` on worker 0, detached."""
    command, environment = training_command(tpu.name, accelerator_type, train_args)
    command, files = shipped_gin_files(command)
    runner.run(ssh(tpu, "0", start_script(command, environment, files)))


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


def require_ready(tpu: Tpu, queued: bool | None, runner: Runner) -> None:
    """Fails unless the TPU is READY (or this is a dry run, which asks nothing)."""
    state = slice_state(tpu, queued, runner)
    if state not in (None, READY):
        advice = "`resume` recreates it" if state in RECREATE_STATES else "try again when READY"
        raise LaunchError(f"TPU {tpu.name} is {state}: {advice}", EXIT_NOT_READY)


def run(job: TrainingJob, runner: Runner, *, until_done: bool) -> None:
    """Records the job's flags and starts training on a READY TPU; `until_done` then watches it
    (`watch`, which recreates a preempted slice)."""
    tpu = job.tpu
    require_ready(tpu, job.spec.queued, runner)
    save_record(tpu, runner, train_args=list(job.train_args))
    job = replace(job, spec=with_accelerator_type(tpu, job.spec, runner))
    start_training(tpu, job.spec.accelerator_type, job.train_args, runner)
    if until_done and not runner.dry_run:
        watch(job, runner)


def recreate(job: TrainingJob, runner: Runner, *, state: str | None) -> None:
    """Deletes the preempted slice (unless it is gone), creates it again and sets it up."""
    tpu, spec = job.tpu, job.spec
    if state != "NOT_FOUND":
        runner.run(delete_command(tpu, spec.queued))
    # `setup` needs the slice ACTIVE.
    create(tpu, spec, job.train_args, runner, polling=job.polling, wait=True)
    setup(tpu, spec.accelerator_type, job.libtpu_flags, runner)


def resume(job: TrainingJob, runner: Runner) -> None:
    """Brings the recorded run back: restarts it, or recreates a preempted slice first."""
    tpu = job.tpu
    if not job.train_args:
        raise LaunchError(f"no recorded run for {tpu.name}: give the training flags after --", 2)
    job = replace(job, spec=with_accelerator_type(tpu, job.spec, runner))
    state = slice_state(tpu, job.spec.queued, runner)
    if state == READY:
        training = training_state(tpu, runner)
        if training and training.state == "running":
            print(f"training is running on {tpu.name} (pid {training.pid}): nothing to resume")
            return
    elif state is None or state in RECREATE_STATES:
        print(f"TPU {tpu.name} is {state or 'PREEMPTED (dry run)'}: recreating it", flush=True)
        recreate(job, runner, state=state)
    else:
        raise LaunchError(f"TPU {tpu.name} is {state}: try again when it is READY", EXIT_NOT_READY)
    save_record(tpu, runner, train_args=list(job.train_args))
    start_training(tpu, job.spec.accelerator_type, job.train_args, runner)


def watch(job: TrainingJob, runner: Runner) -> None:
    """`run --until_done`: polls until training finishes, resuming after preemptions.

    A run that ends with status 0 is done; SIGTERM from a maintenance event (status 42 without
    `stop`) or a lost trainer is restarted, a preempted slice is recreated; `stop` or any other
    status ends the watch with that status. The job's spec has the accelerator type (`run`
    knows it).
    """
    tpu, polling = job.tpu, job.polling
    resumes = 0
    while True:
        time.sleep(polling.poll_seconds)
        state = slice_state(tpu, job.spec.queued, runner)
        if state in TRANSIENT_STATES:
            continue
        if state == READY:
            training = training_state(tpu, runner)
            if training.state == "running":
                continue
            if training.state == "exited" and training.status == 0:
                print(f"training on {tpu.name} finished", flush=True)
                return
            restartable = training.state in ("lost", "never") or (
                training.status == PreemptedError.exit_status and not training.stopped
            )
            if not restartable:
                status = training.status if training.status is not None else 1
                raise LaunchError(f"training ended with status {status} (see `logs`)", status)
        elif state not in RECREATE_STATES:
            raise LaunchError(f"TPU {tpu.name} is {state}; stopped watching", EXIT_NOT_READY)
        resumes += 1
        if resumes > polling.max_resumes:
            raise LaunchError(f"gave up after {polling.max_resumes} resumes", EXIT_NOT_READY)
        print(f"TPU {tpu.name}: {state}; resume {resumes} of {polling.max_resumes}", flush=True)
        if state != READY:
            recreate(job, runner, state=state)
        start_training(tpu, job.spec.accelerator_type, job.train_args, runner)


def logs(tpu: Tpu, worker: str, lines: int, follow: bool, runner: Runner) -> None:
    """The training log's last `lines` on `worker` (an index or `all`), or a stream (`follow`)."""
    script = logs_script(lines, follow, label=worker == "all")
    runner.run(ssh(tpu, worker, script))


def status(tpu: Tpu, spec: SliceSpec, runner: Runner) -> None:
    """The TPU's state and whether training runs on it (or how it ended)."""
    state = slice_state(tpu, spec.queued, runner)
    if state is None:
        runner.run(ssh(tpu, "0", training_state_script()))
        return
    print(f"TPU {tpu.name} ({spec.accelerator_type or 'type unknown'}, {tpu.zone}): {state}")
    if state != READY:
        advice = " (`resume` recreates it)" if state in RECREATE_STATES else ""
        print(f"training: not running{advice}")
        return
    training = training_state(tpu, runner)
    described = {
        "running": f"running on worker 0 (pid {training.pid})",
        "exited": f"exited with status {training.status}"
        + (" after `stop`" if training.stopped else ""),
        "lost": "not running, and it left no exit status (killed?)",
        "never": "never started on this TPU",
    }
    print(f"training: {described[training.state]}")


def stop(tpu: Tpu, timeout_seconds: int, runner: Runner) -> None:
    """SIGTERM to training, which saves a checkpoint; waits up to `timeout_seconds` for its exit."""
    runner.run(ssh(tpu, "0", stop_script(timeout_seconds)))


def delete(tpu: Tpu, queued: bool | None, runner: Runner) -> None:
    """Deletes the TPU (with its queued resource) and, unless a dry run, its record."""
    runner.run(delete_command(tpu, queued))
    if not runner.dry_run:
        record_path(tpu).unlink(missing_ok=True)


def versions(zone: str, project: str | None, accelerator_type: str | None, runner: Runner) -> None:
    """The zone's TensorFlow runtimes, marking those of a supported TensorFlow, and the newest
    for `accelerator_type` (or for a few common types)."""
    command = ["gcloud", "compute", "tpus", "tpu-vm", "versions", "list", f"--zone={zone}"]
    output = runner.output([*command, *project_flag(project), "--format=value(version)"])
    if output is None:
        return
    names = sorted(name for name in output.split() if name.startswith("tpu-vm-tf-"))
    for name in names:
        runtime = TpuRuntime.parse(name)
        print(name + ("  (supported TensorFlow)" if runtime and runtime.supported() else ""))
    examples = ["v4-8", "v4-32", "v5litepod-8", "v5litepod-16"]
    for accelerator in [accelerator_type] if accelerator_type else examples:
        newest = newest_runtime(names, accelerator) or "none: pass --runtime_version yourself"
        print(f"newest for {accelerator}: {newest}")
