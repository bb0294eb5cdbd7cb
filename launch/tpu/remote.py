"""The shell scripts the launcher runs on the TPU VMs over ssh: install the project, configure the
TPU runtime service, start training detached, and report, stop or tail it."""

from __future__ import annotations

import base64
import shlex
from collections.abc import Sequence

# Remote paths: everything the launcher writes on a worker lives in this one directory, marked
# as its own so that `setup` never replaces a directory it did not make.
REMOTE_DIR = "$HOME/framework-tpu"
USER_CONFIGS = "user_configs"  # the user's own gin files, in the VM's checkout
MARKER = ".made-by-launch-tpu_pod"
WORKER_NUMBER_URL = (
    "http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number"
)
RUNTIME_SERVICE = "/etc/systemd/system/tpu-runtime.service"
EXIT_REFUSED = 3  # a remote check refused to go on (its message says why)
EXIT_NOT_READY = 75  # the TPU is not in a state to do this now (EX_TEMPFAIL)
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
