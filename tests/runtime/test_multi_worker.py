"""launch/local_cluster.py: real worker processes with TF_CONFIG on 127.0.0.1.

A SIGKILLed worker stops the launcher and a restart resumes; Ctrl-C saves a checkpoint at a step
both workers agree on (each worker turns it into SIGTERM, the preemption path), a restart resumes
there, and the run equals the same global batches on one
device (one run through three clusters: each cluster start costs two TensorFlow processes). The
workers' servers cannot be reached from outside the cluster (for root and for an unprivileged
user), a launcher that cannot ensure that refuses to start, and a SIGKILLed launcher takes its
workers with it. Workers that restore different checkpoints stop with one line. The workers of a
language-model run, each reading its own file, resume their streams where they stopped.
"""

import ipaddress
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

import pytest
import tensorflow as tf

from framework.core.errors import PreemptedError
from framework.data import text
from framework.trainer import Trainer
from launch import local_cluster
from tests import tiny
from tests.subprocesses import REPO_DIR, child_env, run_python

pytestmark = pytest.mark.slow  # subprocesses: the full tier only

TINY_FLAGS = [*tiny.GIN_FLAGS, "--gin.Trainer.remat_policy='dots_saveable'"]


def start_cluster(
    model_dir, *flags: str, prefix: Sequence[str] = (), run: Sequence[str] = TINY_FLAGS
) -> subprocess.Popen:
    """The launcher with 2 workers of the `run` (the tiny ViT); `prefix` is a command that runs
    it (unshare ...).

    Started as a user starts it from the directory that holds model_dir, with a relative
    --model_dir, which must mean that directory (not the checkout's). The workers' temporary
    directory is `worker_tmp` beside model_dir (`leftover_worker_checkpoints`).
    """
    (model_dir.parent / "worker_tmp").mkdir(exist_ok=True)
    return subprocess.Popen(
        [
            *prefix,
            sys.executable,
            str(REPO_DIR / "launch" / "local_cluster.py"),
            "--num_workers=2",
            "--grace_seconds=5",
            "--",
            *run,
            f"--model_dir={model_dir.name}",
            "--mode=train",
            *flags,
        ],
        cwd=model_dir.parent,
        env=child_env({"TMPDIR": str(model_dir.parent / "worker_tmp")}),
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


def leftover_worker_checkpoints(model_dir) -> list[str]:
    """The checkpoint files a cluster's workers left in their temporary directory: a worker
    other than the chief writes its save there and must delete it (`run_state`)."""
    return sorted(
        path.name for path in (model_dir.parent / "worker_tmp").glob("framework-ckpt-*/*")
    )


def launcher_lines(lines: Sequence[str]) -> list[tuple[int, int]]:
    """(pid, port) of every worker, from the launcher's `[launcher] worker i pid P at A:PORT`."""
    found = re.findall(
        r"^\[launcher\] worker \d+ pid (\d+) at 127\.0\.0\.1:(\d+)$", "".join(lines), re.M
    )
    return [(int(pid), int(port)) for pid, port in found]


def non_loopback_ipv4() -> str | None:
    """An IPv4 address of this machine that is not loopback, or None."""
    candidates = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("192.0.2.1", 9))  # a documentation address: UDP connect sends nothing
            candidates.append(sock.getsockname()[0])
        except OSError:
            pass
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
        candidates += [info[4][0] for info in infos]
    except OSError:
        pass
    return next((a for a in candidates if not ipaddress.ip_address(a).is_loopback), None)


def refuses(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=3).close()
    except OSError:
        return True
    return False


def alive(pid: int) -> bool:
    """Whether `pid` still runs: a zombie (dead, not yet reaped by its new parent) does not."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/status") as status:
            state = next(line for line in status if line.startswith("State:"))
    except (ProcessLookupError, FileNotFoundError):
        return False
    return state.split()[1] != "Z"


def cannot_run(command: Sequence[str]) -> str | None:
    """Why `command` fails on this machine, or None when it runs."""
    try:
        probe = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except OSError as error:
        return str(error)
    if probe.returncode != 0:
        return probe.stderr.strip() or f"exit status {probe.returncode}"
    return None


# Runs the launcher as uid 65534 of a user namespace, without capabilities: unshare(CLONE_NEWNET)
# is refused, so it takes the path of a non-root user (a user namespace of its own).
UNPRIVILEGED = ["unshare", "--user", "--map-user=65534", "--map-group=65534"]
# Then a user namespace whose root has no capabilities and may create no namespace: a non-root
# user where unprivileged user namespaces are disabled. Prefixes `sh -c SCRIPT sh COMMAND...`.
NO_NAMESPACES = [
    "unshare",
    "--user",
    "--map-root-user",
    "sh",
    "-c",
    "echo 0 > /proc/sys/user/max_user_namespaces && "
    'exec setpriv --inh-caps=-all --bounding-set=-all "$@"',
    "sh",
]


def test_tf_config_names_every_worker_and_this_task():
    config = json.loads(local_cluster.tf_config(["127.0.0.1:1", "127.0.0.1:2"], 1))
    assert config == {
        "cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
        "task": {"type": "worker", "index": 1},
    }
    assert len(set(local_cluster.free_ports(4))) == 4


def assert_reachable_only_inside_the_cluster(workers: list[tuple[int, int]]) -> None:
    """The workers train, so they reach each other on 127.0.0.1:PORT; nothing outside their
    network namespace reaches them: not another address of this machine, not the host's lo."""
    assert len(workers) == 2
    address = non_loopback_ipv4()
    for _, port in workers:
        if address is not None:
            assert refuses(address, port), f"worker port {port} is open on {address}"
        assert refuses("127.0.0.1", port), f"worker port {port} is open on the host's lo"


def test_a_killed_worker_stops_the_cluster_and_sigterm_saves_where_the_workers_agree(tmp_path):
    """One run through three clusters, each resuming where the one before stopped:

    1. as a user without capabilities (when this machine can run one), the launcher isolates its
       workers through a user namespace; a SIGKILLed worker stops it;
    2. started by this user (root in CI), it isolates them too, and the restart resumes from the
       last checkpoint; Ctrl-C (SIGINT, passed on to the workers) saves a checkpoint at a step
       both workers agree on;
    3. the restart resumes there and finishes.

    The result equals the same run with the same interruptions on one device (same global
    batches, initial weights and schedules: only the order of float sums differs, in the
    all-reduce).
    """
    model_dir = tmp_path / "mw"
    prefix = [] if cannot_run([*UNPRIVILEGED, "true"]) else UNPRIVILEGED
    cluster = start_cluster(model_dir, "--gin.Trainer.train_steps=100000", prefix=prefix)
    # A worker logs step 10 before the chief has saved it; by step 15 the chief, which takes part
    # in every step, has written step 10's checkpoint.
    lines = wait_for(cluster, r"\[worker 1\].*step 15/100000")
    assert_reachable_only_inside_the_cluster(launcher_lines(lines))
    pid = int(re.search(r"worker 1 pid (\d+)", "".join(lines)).group(1))
    killed_at = time.monotonic()
    subprocess.run(["kill", "-KILL", str(pid)], check=True)
    output = cluster.communicate(timeout=60)[0]
    assert cluster.returncode != 0
    assert time.monotonic() - killed_at < 30
    assert "worker 1 exited with status -9" in output
    killed = int(tf.train.latest_checkpoint(model_dir / "checkpoints").rsplit("-", 1)[1])
    assert killed >= 10
    assert not (REPO_DIR / model_dir.name).exists()  # the relative --model_dir: the caller's
    # The SIGKILLed worker may have left its copy of a save: the restart's worker 1 removes it.

    cluster = start_cluster(model_dir, "--gin.Trainer.train_steps=100000")
    lines = wait_for(cluster, rf"\[worker 1\].*step {killed + 10}/100000")
    assert f"restored step {killed}" in "".join(lines)
    assert_reachable_only_inside_the_cluster(launcher_lines(lines))
    cluster.send_signal(signal.SIGINT)
    output = cluster.communicate(timeout=120)[0]
    assert cluster.returncode == PreemptedError.exit_status, output[-3000:]
    everything = "".join(lines) + output
    assert "[worker 1]" in output and "multi_worker_mirrored with 2 replica(s)" in everything
    assert output.count("Ctrl-C: stopping as if preempted") == 2, output[-3000:]
    saved = sorted(
        int(m) for m in re.findall(r"preempted: saved a checkpoint at step (\d+)", output)
    )
    assert len(saved) == 2 and saved[0] == saved[1] and saved[0] >= killed + 10, output[-3000:]
    assert leftover_worker_checkpoints(model_dir) == []

    end = saved[0] + 5
    restart = start_cluster(model_dir, f"--gin.Trainer.train_steps={end}")
    output = restart.communicate(timeout=300)[0]
    assert restart.returncode == 0, output[-3000:]
    assert f"restored step {saved[0]}" in output
    assert (model_dir / "config.gin").exists()
    assert leftover_worker_checkpoints(model_dir) == []

    args = {**tiny.TRAINER_ARGS, "remat_policy": "dots_saveable"}
    for stop in (killed, saved[0]):  # the clusters' interruptions
        interrupted = Trainer(str(tmp_path / "one"), **args, train_steps=100000)
        interrupted.train(max_steps=stop - interrupted.step)
    single = Trainer(str(tmp_path / "one"), **args, train_steps=end)
    single.train()
    restored = Trainer(str(model_dir), **args, train_steps=end)  # the workers' last save
    assert restored.step == single.step == end
    loss_one, loss_mw = single.evaluate()["loss"], restored.evaluate()["loss"]
    assert abs(loss_mw - loss_one) / loss_one < 1e-4, (loss_mw, loss_one)


def test_a_launcher_that_cannot_isolate_the_workers_refuses_to_start(tmp_path):
    if reason := cannot_run([*NO_NAMESPACES, "true"]):
        pytest.skip(f"cannot set up a machine without user namespaces: {reason}")
    cluster = start_cluster(tmp_path, prefix=NO_NAMESPACES)
    output = cluster.communicate(timeout=60)[0]
    assert cluster.returncode == 2, output
    assert output.startswith("[launcher] cannot give the workers a private network namespace")
    assert output.count("\n") == 1 and "--host_network" in output and "[worker" not in output


def test_a_sigkilled_launcher_leaves_no_worker_running(tmp_path):
    cluster = start_cluster(tmp_path, "--gin.Trainer.train_steps=100000")
    pids = [pid for pid, _ in launcher_lines(wait_for(cluster, r"\[worker 1\].*step 10/100000"))]
    assert len(pids) == 2 and all(alive(pid) for pid in pids)
    cluster.kill()
    cluster.communicate(timeout=30)
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [pid for pid in pids if alive(pid)]
    for pid in survivors:  # leave nothing training behind, then fail
        os.kill(pid, signal.SIGKILL)
    assert not survivors, f"workers {survivors} outlived their SIGKILLed launcher"


def test_sigterm_while_the_workers_start_up_asks_for_a_restart(tmp_path):
    """A preemption notice before the workers installed their handlers ends them with SIGTERM
    itself (status -15): that is a preemption too, status 42 (it was 1, a failure)."""
    cluster = start_cluster(tmp_path / "run", "--gin.Trainer.train_steps=100000")
    wait_for(cluster, r"^\[launcher\] worker 1 pid")  # printed before the workers import anything
    cluster.send_signal(signal.SIGTERM)
    output = cluster.communicate(timeout=120)[0]
    assert cluster.returncode == PreemptedError.exit_status, output[-3000:]
    assert "stopping the others" not in output


@pytest.mark.parametrize("argv", [["--num_workers=0", "--", "--mode=train"]])
def test_bad_launcher_usage(argv):
    with pytest.raises(SystemExit):
        local_cluster.main(argv)


# Starts 2 workers as the launcher does (private network namespace, TF_CONFIG), but each with a
# model_dir of its own: the way a worker that sees other checkpoints than the chief looks.
DIVERGENT_WORKERS = """
    import json, os, subprocess
    from launch import local_cluster

    local_cluster.isolate_network()
    addresses = [f"127.0.0.1:{{port}}" for port in local_cluster.free_ports(2)]
    workers = [
        subprocess.Popen(
            local_cluster.worker_command([*{flags!r}, f"--model_dir={{model_dir}}"]),
            env=dict(os.environ, TF_CONFIG=local_cluster.tf_config(addresses, index)),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for index, model_dir in enumerate({model_dirs!r})
    ]
    outputs = [worker.communicate(timeout=240)[0] for worker in workers]
    print(json.dumps({{"codes": [w.returncode for w in workers], "outputs": outputs}}))
"""


def test_workers_that_restore_different_checkpoints_stop_with_one_line(tmp_path):
    chief_dir, other_dir = tmp_path / "chief", tmp_path / "other"
    trained = tmp_path / "trained"  # this process holds its lock: the workers get copies
    for steps, model_dir in ((5, chief_dir), (5, other_dir)):
        Trainer(str(trained), **tiny.TRAINER_ARGS, train_steps=20).train(max_steps=steps)
        shutil.copytree(trained, model_dir, ignore=shutil.ignore_patterns("LOCK"))
    before = {path.name: path.read_bytes() for path in (chief_dir / "checkpoints").iterdir()}
    flags = [*TINY_FLAGS, "--gin.Trainer.train_steps=20", "--mode=train"]
    script = DIVERGENT_WORKERS.format(flags=flags, model_dirs=[str(chief_dir), str(other_dir)])
    result = run_python(script, timeout=300)
    for code, output in zip(result["codes"], result["outputs"], strict=True):
        assert code == 2, output[-3000:]
        errors = [line for line in output.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, output[-3000:]
        assert "the workers restored different checkpoints" in errors[0]
        assert "(worker 0: ckpt-5, worker 1: ckpt-10)" in errors[0]
    after = {path.name: path.read_bytes() for path in (chief_dir / "checkpoints").iterdir()}
    assert after == before  # nothing trained on, nothing saved


def test_text_workers_resume_their_streams_where_they_stopped(tmp_path):
    """A decoder LM on two files, one per worker ('read_own'): restarted, each worker's pipeline
    seeks the position of its own stream that the chief's checkpoint holds for both."""
    paragraphs = pathlib.Path(text.SAMPLE_CORPUS).read_text().split("\n\n")
    for index, part in enumerate((paragraphs[::2], paragraphs[1::2])):
        (tmp_path / f"part{index}.txt").write_text("\n\n".join(part))
    corpus = dict(files=str(tmp_path / "part*.txt"), vocab_path=str(tmp_path / "vocab.txt"))
    text.TextCorpus(**corpus, vocab_size=256).vocab()  # learned once, not by both workers
    run = [
        "--gin_file=lm_quickstart.gin",
        *(f"--gin.data.TextCorpus.{name}='{value}'" for name, value in corpus.items()),
        "--gin.VOCAB_SIZE=256",
        "--gin.SEQUENCE_LENGTH=32",
        "--gin.Trainer.global_batch_size=4",
        "--gin.Trainer.steps_per_loop=2",
        "--gin.Trainer.warmup_steps=1",
        "--gin.Trainer.eval_every=None",
    ]
    model_dir = tmp_path / "lm"
    for steps in (4, 6):
        cluster = start_cluster(model_dir, f"--gin.Trainer.train_steps={steps}", run=run)
        output = cluster.communicate(timeout=300)[0]
        assert cluster.returncode == 0, output[-3000:]
    assert "restored step 4" in output
    for pipeline in (0, 1):
        said = rf"\[worker {pipeline}\] .*pipeline {pipeline} resumes its training stream at step 4"
        assert re.search(said, output), output[-3000:]
    assert "reading the training stream" not in output
