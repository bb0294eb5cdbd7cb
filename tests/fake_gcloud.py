"""A stand-in for `gcloud` (and the TPU VMs behind it) for tests/launch/test_tpu_pod.py.

The test puts small wrappers on PATH that run this file with a role as the first argument:

- `gcloud`: records every call in calls.jsonl and plays the TPU's life from state.json: a queued
  resource that becomes ACTIVE after N polls, a TPU that is READY and later PREEMPTED (from a list
  of states that successive `describe` calls play), a failing ssh. `ssh` runs the remote script
  with bash in a directory per worker (workers/I, its HOME), so the launcher's remote scripts
  really run: detached start, pid file, SIGTERM, log tail.
- `python3`, `sudo`, `curl`: what the remote scripts call on a worker. `python3 -m pip` only
  records; `python3 -m framework.train` is a fake trainer (saves and exits 42 on SIGTERM, like
  the real one); `python3 -c CODE` runs CODE against a fake site-packages holding the
  TensorFlow distribution the state names. `sudo` records and does nothing (no process or file
  of this machine is touched); `curl` answers the metadata server's worker number.

Only the Python standard library: every call is a fresh interpreter, kept fast.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKERS = {"v4-8": 1, "v4-32": 4, "v5litepod-8": 1, "v5litepod-16": 4, "v6e-8": 1}
TRAIN_ENV = (
    "TPU_NAME",
    "TPU_LOAD_LIBRARY",
    "NEXT_PLUGGABLE_DEVICE_USE_C_API",
    "TF_PLUGGABLE_DEVICE_LIBRARY_PATH",
)
SAFETY_SECONDS = 30  # a fake trainer never outlives a test run by more than this
NOT_FOUND = "ERROR: (gcloud) NOT_FOUND: Resource 'projects/p/locations/z/nodes/{}' was not found\n"


def sandbox() -> Path:
    return Path(os.environ["FAKE_GCLOUD_DIR"])


def load_state() -> dict:
    return json.loads((sandbox() / "state.json").read_text())


def save_state(state: dict) -> None:
    write_atomically(sandbox() / "state.json", json.dumps(state, indent=1))


def write_atomically(path: Path, text: str) -> None:
    """A background fake trainer reads the state while a gcloud call writes it: a reader sees
    the old file or the new one, never one truncated in between."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_text(text)
    os.replace(partial, path)


def worker_home(index: int) -> Path:
    return sandbox() / "workers" / str(index)


def kill_trainers(directory: Path) -> None:
    """SIGKILLs the fake trainers started under `directory` (a lost VM takes them along)."""
    for pid_file in directory.glob("workers/*/framework-tpu/train.pid"):
        try:
            pid = int(pid_file.read_text())
            if b"fake_gcloud" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
        except (ValueError, OSError):
            pass


def fresh_workers(count: int) -> None:
    """A new slice: empty home directories, as a recreated TPU VM has."""
    kill_trainers(sandbox())
    shutil.rmtree(sandbox() / "workers", ignore_errors=True)
    for index in range(count):
        worker_home(index).mkdir(parents=True)


# --- gcloud -----------------------------------------------------------------------------------


def flags(argv: list[str]) -> dict[str, str]:
    return dict(arg[2:].split("=", 1) for arg in argv if arg.startswith("--") and "=" in arg)


def create_tpu(state: dict, accelerator_type: str, runtime: str) -> None:
    workers = WORKERS.get(accelerator_type, 1)
    state["tpu"] = {"state": "READY", "acceleratorType": accelerator_type, "runtime": runtime}
    state["tpu"]["workers"] = workers
    fresh_workers(workers)


def tpu_vm(state: dict, verb: str, argv: list[str]) -> int:
    options = flags(argv)
    tpu = state.get("tpu")
    if verb == "create":
        create_tpu(state, options["accelerator-type"], options["version"])
        return 0
    if verb == "versions":
        print("\n".join(state.get("versions", [])))
        return 0
    if tpu is None:
        sys.stderr.write(NOT_FOUND.format(argv[0]))
        return 1
    if verb == "describe":
        if state.get("describe_states"):
            tpu["state"] = state["describe_states"].pop(0)
            if tpu["state"] == "PREEMPTED":
                kill_trainers(sandbox())
        field = options["format"].removeprefix("value(").removesuffix(")")
        print(tpu[field] if field in tpu else tpu["state"])
        return 0
    if verb == "delete":
        state["tpu"] = None
        fresh_workers(0)
        return 0
    if verb == "scp":
        return scp(tpu, argv[0], argv[1].split(":", 1)[1], options["worker"])
    if verb == "ssh":
        return ssh(state, tpu, options["worker"], options["command"])
    return unknown(argv)


def queued_resources(state: dict, verb: str, argv: list[str]) -> int:
    options = flags(argv)
    if verb == "create":
        state["queued"] = {"state": "WAITING_FOR_RESOURCES", "polls": state.get("queued_polls", 0)}
        state["queued"].update(accelerator=options["accelerator-type"])
        state["queued"].update(runtime=options["runtime-version"])
        return 0
    queued = state.get("queued")
    if queued is None:
        sys.stderr.write(NOT_FOUND.format(argv[0]))
        return 1
    if verb == "describe":
        if queued["state"] == "WAITING_FOR_RESOURCES" and queued["polls"] <= 0:
            queued["state"] = "ACTIVE"
            create_tpu(state, queued["accelerator"], queued["runtime"])
        queued["polls"] -= 1
        tpu_state = (state.get("tpu") or {}).get("state")
        print("SUSPENDED" if tpu_state == "PREEMPTED" else queued["state"])
        return 0
    if verb == "delete":
        state["queued"] = state["tpu"] = None
        fresh_workers(0)
        return 0
    return unknown(argv)


def scp(tpu: dict, source: str, destination: str, worker: str) -> int:
    for index in workers_of(tpu, worker):
        (worker_home(index) / destination).write_bytes(Path(source).read_bytes())
    return 0


def workers_of(tpu: dict, worker: str) -> range:
    return range(tpu["workers"]) if worker == "all" else range(int(worker), int(worker) + 1)


def ssh(state: dict, tpu: dict, worker: str, command: str) -> int:
    """Runs `command` with bash on each selected worker, concurrently as gcloud does."""
    failure = state.pop("fail_ssh", None)
    if failure or tpu["state"] != "READY":
        sys.stderr.write("ssh: connect to host 10.0.0.2 port 22: Connection timed out\n")
        return failure or 255
    remote_bin = sandbox() / "remote-bin"
    processes = []
    for index in workers_of(tpu, worker):
        environment = {
            "HOME": str(worker_home(index)),
            "PATH": f"{remote_bin}:/usr/bin:/bin",
            "FAKE_GCLOUD_DIR": str(sandbox()),
            "FAKE_WORKER_NUMBER": str(index),
        }
        processes.append(
            subprocess.Popen(["bash", "-c", command], cwd=worker_home(index), env=environment)
        )
    statuses = [process.wait() for process in processes]
    return next((status for status in statuses if status), 0)


def unknown(argv: list[str]) -> int:
    sys.stderr.write(f"fake gcloud: unsupported call {argv}\n")
    return 2


def gcloud(argv: list[str]) -> int:
    with open(sandbox() / "calls.jsonl", "a") as calls:
        calls.write(json.dumps(argv) + "\n")
    if argv[:2] != ["compute", "tpus"]:
        return unknown(argv)
    state = load_state()
    resource, verb, rest = argv[2], argv[3], argv[4:]
    if resource == "tpu-vm":
        status = tpu_vm(state, verb, rest)
    elif resource == "queued-resources":
        status = queued_resources(state, verb, rest)
    else:
        status = unknown(argv)
    save_state(state)
    return status


# --- The worker's commands --------------------------------------------------------------------


def record(name: str, entry: object) -> None:
    with open(Path(os.environ["HOME"]) / name, "a") as log:
        log.write(json.dumps(entry) + "\n")


def fake_site() -> Path:
    """site-packages with the TensorFlow distribution the state names, and the project.

    Built once per TensorFlow version and moved into place whole: the workers of a pod run
    their remote scripts at the same time.
    """
    tensorflow = load_state().get("tensorflow", "2.20.0")
    site = sandbox() / f"site-{tensorflow}"
    if site.is_dir():
        return site
    requirements = ["tensorflow==2.21.*", "tensorflow-text==2.21.*", "gin-config==0.5.0"]
    requirements += ["absl-py>=2.1", 'pytest>=8; extra == "test"']
    distributions = {
        f"tensorflow_tpu-{tensorflow}": f"Name: tensorflow-tpu\nVersion: {tensorflow}\n",
        "framework-0.1.0": "Name: framework\nVersion: 0.1.0\n"
        + "".join(f"Requires-Dist: {requirement}\n" for requirement in requirements),
    }
    building = Path(tempfile.mkdtemp(dir=sandbox()))
    for name, metadata in distributions.items():
        (building / f"{name}.dist-info").mkdir()
        (building / f"{name}.dist-info" / "METADATA").write_text(metadata)
    try:
        building.rename(site)
    except OSError:  # another worker was first
        shutil.rmtree(building)
    return site


def python3(argv: list[str]) -> int:
    if argv[:2] == ["-m", "pip"]:
        record("pip-calls.jsonl", argv[2:])
        if argv[2] == "list":
            print(f"tensorflow-tpu=={load_state().get('tensorflow', '2.20.0')}\nnumpy==2.1.0")
        return 0
    if argv[:2] == ["-m", "framework.train"]:
        return fake_train(argv[2:])
    environment = {**os.environ, "PYTHONPATH": str(fake_site())}
    return subprocess.run([sys.executable, "-S", *argv], env=environment).returncode


def fake_train(argv: list[str]) -> int:
    """Trains until SIGTERM (then "saves" and exits 42) or for the state's train_seconds."""
    environment = {name: os.environ.get(name) for name in TRAIN_ENV}
    record("train-calls.jsonl", {"argv": argv, "cwd": os.getcwd(), "env": environment})
    terminated = []
    signal.signal(signal.SIGTERM, lambda *_: terminated.append(True))
    seconds = load_state().get("train_seconds")
    deadline = time.monotonic() + (seconds if seconds is not None else SAFETY_SECONDS)
    print("fake trainer: started", flush=True)
    step = 0
    while not terminated and time.monotonic() < deadline:
        step += 1
        print(f"fake trainer: step {step}", flush=True)
        time.sleep(0.05)
    if terminated:
        print(f"preempted: saved a checkpoint at step {step}", flush=True)
        return 42
    print("fake trainer: finished" if seconds is not None else "fake trainer: safety stop")
    return 0 if seconds is not None else 1


def sudo(argv: list[str]) -> int:
    record("sudo-calls.jsonl", argv)
    return 0


def curl(argv: list[str]) -> int:
    print(os.environ["FAKE_WORKER_NUMBER"] if "agent-worker-number" in argv[-1] else "")
    return 0


ROLES = {"gcloud": gcloud, "python3": python3, "sudo": sudo, "curl": curl}

if __name__ == "__main__":
    sys.exit(ROLES[sys.argv[1]](sys.argv[2:]))
