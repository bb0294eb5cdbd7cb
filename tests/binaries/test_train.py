"""`python -m framework.train`: flags, gin, the run record, and one-line errors for bad input."""

import concurrent.futures
import errno
import gc
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading

import gin
import pytest
import tensorflow as tf

from framework import cli, train
from framework.data import text
from framework.trainer import settings, trainer
from tests.data.images.test_sources import write_tfrecords
from tests.subprocesses import REPO_DIR, child_env, command, run_binary, run_python

TINY_RUN = [
    "--gin_file=quickstart.gin",
    "--gin.Trainer.train_steps=4",
    "--gin.Trainer.steps_per_loop=2",
    "--gin.Trainer.global_batch_size=8",
    "--gin.data.shapes.image_size=8",
    "--gin.data.shapes.eval_examples=16",
    "--gin.models.VisionTransformer.image_size=8",
    "--gin.models.VisionTransformer.depth=1",
    "--gin_param=models.VisionTransformer.dim = 16",
    "--gin_bindings=models.VisionTransformer.mlp_dim = 16",
    "--gin.Trainer.count_flops=False",
]


# Runs the binary with files limited to 16 KiB, as a full disk would: a write past the limit fails
# with EFBIG (SIGXFSZ, which would kill the process, is ignored). The run record and summaries
# fit, the first checkpoint does not. An rlimit needs no root, and no preexec_fn in this threaded
# process.
FILE_SIZE_LIMITED = """
import os, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384))
os.execv(sys.executable, [sys.executable, "-m", "framework.train", *sys.argv[1:]])
"""


# Runs the binary with SIGINT at its default, which Python turns into KeyboardInterrupt: a test
# run started in the background of a shell would otherwise pass its ignored SIGINT on.
SIGINT_DEFAULT = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)
os.execv(sys.executable, [sys.executable, "-m", "framework.train", *sys.argv[1:]])
"""


def the_error_line(stderr: str) -> str:
    """The one `error:` line of a failed run, its last line (and that there is no traceback)."""
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.rstrip().splitlines()[-1] == lines[0], stderr[-3000:]
    return lines[0]


def checksums(directory) -> dict[str, str]:
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in directory.rglob("*")
        if path.is_file()
    }


@pytest.mark.slow
def test_run_writes_config_command_checkpoints_and_resumes(tmp_path):
    first = run_binary(*TINY_RUN, f"--model_dir={tmp_path}")
    assert first.returncode == 0, first.stderr[-3000:]
    config = (tmp_path / "config.gin").read_text()
    assert "Trainer.train_steps = 4" in config and "VisionTransformer.dim = 16" in config
    assert "--gin.Trainer.train_steps=4" in (tmp_path / "command").read_text()
    assert "step 4/4" in first.stderr and "eval at step 4" in first.stderr
    assert f"done: the run is in {tmp_path} (checkpoints in {tmp_path}/checkpoints" in first.stderr
    second = run_binary(*TINY_RUN, "--gin.Trainer.train_steps=6", f"--model_dir={tmp_path}")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "restored step 4" in second.stderr and "step 6/6" in second.stderr
    assert list(tmp_path.glob("config-*.gin")), "the first run's config.gin was not kept"
    before = checksums(tmp_path / "checkpoints")
    other_model = run_binary(
        *TINY_RUN, "--gin.models.VisionTransformer.dim=8", f"--model_dir={tmp_path}"
    )
    assert other_model.returncode == 2, other_model.stderr[-3000:]
    line = the_error_line(other_model.stderr)  # last: not TensorFlow's unplaced values after it
    assert "cannot be restored" in line and "config.gin beside them" in line, line
    assert checksums(tmp_path / "checkpoints") == before


@pytest.mark.slow
def test_multi_gpu_launcher_writes_a_relative_model_dir_where_it_is_started(tmp_path):
    """From another directory, --model_dir=runs/x is that directory's runs/x (on a machine
    without GPUs the launcher trains mirrored on the CPU, with a warning)."""
    run = subprocess.run(
        ["bash", str(REPO_DIR / "launch" / "multi_gpu.sh"), *TINY_RUN, "--model_dir=runs/x"],
        cwd=tmp_path,
        env=child_env({"PYTHONPATH": None}),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "mirrored" in run.stderr and "step 4/4" in run.stderr
    assert tf.train.latest_checkpoint(tmp_path / "runs" / "x" / "checkpoints").endswith("ckpt-4")
    assert not (REPO_DIR / "runs" / "x").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, message",
    [
        (["--gin.Trainer.train_steps"], "should look like --gin.NAME=VALUE"),
        (["--mode=sing"], "flag --mode=sing: value should be one of"),
        (["--nope=1"], "Unknown command line flag 'nope'"),
    ],
)
def test_bad_input_is_one_line_and_leaves_the_model_dir_alone(args, message, tmp_path):
    (tmp_path / "empty.gin").write_text("")
    earlier = tmp_path / "run"  # an earlier run's record, which a bad config must not replace
    (earlier / "checkpoints").mkdir(parents=True)
    (earlier / "config.gin").write_text("Trainer.train_steps = 4\n")
    (earlier / "checkpoints" / "checkpoint").write_text("precious")
    before = checksums(earlier)
    args = [arg.format(tmp=tmp_path) for arg in args]
    if not any(arg.startswith("--model_dir") for arg in args):
        args.append(f"--model_dir={earlier}")
    result = run_binary(*TINY_RUN[1:], *args)
    assert result.returncode == 2, result.stderr[-3000:]
    assert message in the_error_line(result.stderr)
    assert checksums(earlier) == before


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gin_file={tmp}/empty.gin"], "does not set Trainer.model_fn or Trainer.dataset_fn"),
        (["--gin.Trainer.no_such_setting=1"], "bad gin configuration"),
        (
            ["--gin.Trainer.train_steps=ten"],
            "cannot read the value 'ten' in the binding 'Trainer.train_steps = ten': a value is",
        ),
        (["--gin.Runtime.strategy='tpu_v9'"], "unknown strategy"),
        (["--gin_file=missing.gin"], "gin file 'missing.gin' not found"),
        (["--gin.Trainer.learning_rate='fast'"], "Trainer.learning_rate must be a positive number"),
        (["--model_dir=/proc/not_writable"], "not writable"),
        (
            [  # a fresh model_dir: the run lock is taken before the data set is built
                "--gin_file=lm_quickstart.gin",
                "--gin.data.TextCorpus.files=['docs']",
                "--gin.data.TextCorpus.vocab_path='{tmp}/vocab.txt'",
                "--model_dir={tmp}/lm",
            ],
            "TextCorpus.files: 'docs' is a directory",
        ),
        (  # a mistyped model_dir: it scored fresh random weights and exited 0
            ["--mode=eval"],
            "--mode=eval: no checkpoint in {tmp}/run/checkpoints to evaluate: train first",
        ),
        (  # no network here (or no such bucket): one line that says what to check
            ["--model_dir=gs://framework-tests-no-such-bucket/run"],
            "check the network, the bucket's name and that these credentials may write",
        ),
    ],
)
def test_a_bad_config_stops_before_anything_is_written(args, message, tmp_path):
    """In this process (the one-line report of a UsageError is the subprocess tests' part)."""
    (tmp_path / "empty.gin").write_text("")
    _refused_in_process(args, message.format(tmp=tmp_path), tmp_path)


def test_a_checkpoints_link_to_storage_that_is_not_there_is_refused(tmp_path):
    """A run would start afresh beside a run whose checkpoints are on storage not mounted,
    then fail at its first save."""
    run = tmp_path / "kept"
    run.mkdir()
    (run / "checkpoints").symlink_to(tmp_path / "unmounted")
    _refused_in_process(
        [f"--model_dir={run}"], "which is not there (storage not mounted?)", tmp_path
    )
    assert (run / "checkpoints").is_symlink() and not (tmp_path / "unmounted").exists()


def test_a_run_record_that_is_not_utf8_is_kept_as_it_is(tmp_path):
    """A config.gin in another encoding (or with a flipped bit) stopped every restart with a
    UnicodeDecodeError traceback; reading a run's config names the file."""
    from framework import trained_model

    earlier = b"# r\xe9glage\nTrainer.train_steps = 10\n"
    (tmp_path / "config.gin").write_bytes(earlier)
    train.write_run_record(str(tmp_path), "Trainer.train_steps = 20\n", "second")
    assert [p.read_bytes() for p in tmp_path.glob("config-*.gin")] == [earlier]
    assert (tmp_path / "config.gin").read_text() == "Trainer.train_steps = 20\n"
    (tmp_path / "config.gin").write_bytes(earlier)
    with pytest.raises(
        cli.UsageError, match=r"config.gin is not UTF-8 text \(byte 0xe9 at offset 3"
    ):
        trained_model.read_config(str(tmp_path))


@pytest.mark.parametrize(
    "records, message",
    [
        ("not_tfrecords", "the data cannot be read (corrupted record at 0"),
        ("other_keys", "have no bytes feature 'image/encoded' (data.tfrecord.image_key)"),
    ],
)
def test_bad_training_records_stop_before_anything_is_written(records, message, tmp_path):
    """The training split's data is checked as the evaluation split's is, when the run is
    built; what tf.data cannot read is one line too (both were tracebacks)."""
    good = write_tfrecords(tmp_path / "good", count=8, files=1)
    bad = tmp_path / "bad"
    if records == "not_tfrecords":
        bad.mkdir()
        (bad / "part-00").write_text("not a record")
    else:
        write_tfrecords(bad, count=8, files=1, image_key="img")
    args = [
        "--gin.Trainer.dataset_fn=@data.tfrecord",
        f"--gin.data.tfrecord.train_files='{bad}/part-*'",
        f"--gin.data.tfrecord.eval_files='{good}'",
        "--gin.data.tfrecord.image_size=8",
    ]
    _refused_in_process(args, message, tmp_path)


def _refused_in_process(args: list[str], message: str, tmp_path) -> None:
    """`framework.train` with `args` raises a UsageError with `message` and leaves no run."""
    model_dir = (
        [] if any(a.startswith("--model_dir") for a in args) else [f"--model_dir={tmp_path}/run"]
    )
    argv = ["train", *TINY_RUN[1:], *model_dir, *args]
    gin.clear_config()
    try:
        train.FLAGS(cli.rewrite_gin_shorthand([arg.format(tmp=tmp_path) for arg in argv]))
        with pytest.raises(cli.UsageError, match=re.escape(message)):
            train.main(["train"])
    finally:
        train.FLAGS.unparse_flags()
        gin.clear_config()
    for run in (tmp_path / "run", tmp_path / "lm"):  # made, then removed when refused
        assert not run.exists(), [p.name for p in run.iterdir()]


@pytest.mark.slow
def test_gin_file_is_required_to_name_a_model_dir():
    result = run_binary("--gin_file=quickstart.gin")
    assert result.returncode == 2 and "--model_dir is required" in result.stderr
    # A file that does not exist is named first: that is what to fix.
    result = run_binary("--gin_file=does_not_exist.gin")
    line = the_error_line(result.stderr)
    assert result.returncode == 2 and "gin file 'does_not_exist.gin' not found" in line


@pytest.mark.slow
def test_a_value_gin_cannot_read_is_named_without_python_internals(tmp_path):
    result = run_binary(*TINY_RUN, "--gin.Trainer.train_steps=ten", f"--model_dir={tmp_path}")
    line = the_error_line(result.stderr)
    assert result.returncode == 2 and "cannot read the value 'ten'" in line
    assert "0x" not in line and "ast." not in line, line


@pytest.mark.slow
def test_a_full_disk_is_one_line(tmp_path):
    result = run_binary(*TINY_RUN, f"--model_dir={tmp_path}", launcher=("-c", FILE_SIZE_LIMITED))
    assert result.returncode == 2, result.stderr[-3000:]
    line = the_error_line(result.stderr)
    assert re.search(r"cannot write \S+: File too large\. Free disk space", line), line


@pytest.mark.slow
def test_a_new_config_that_cannot_be_written_leaves_the_runs_config_in_place(tmp_path):
    """A restart with other settings on a full disk: the run's config.gin stays (it was once
    moved aside before the new one was written) and no temporary file is left."""
    result = run_python(
        f"""
        import json, os, resource, signal
        from framework import train
        train.write_run_record({str(tmp_path)!r}, "steps = 10\\n", "first")
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))
        try:
            train.write_run_record({str(tmp_path)!r}, "steps = 20\\n" * 100, "second")
        except Exception as error:
            failed = type(error).__name__
        print(json.dumps(dict(failed=failed, files=sorted(os.listdir({str(tmp_path)!r})))))
        """
    )
    assert result["failed"], result
    assert [f for f in result["files"] if ".tmp-" in f] == [], result
    assert (tmp_path / "config.gin").read_text() == "steps = 10\n"
    assert (tmp_path / "command").read_text() == "first\n"


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_and_exits_130(tmp_path):
    args = [
        *TINY_RUN,
        "--gin.Trainer.train_steps=100000",
        "--gin.Trainer.checkpoint_every=100000",  # only the interrupt saves
        "--mode=train",
        f"--model_dir={tmp_path}",
    ]
    proc = subprocess.Popen(
        command(*args, launcher=("-c", SIGINT_DEFAULT)),
        cwd=REPO_DIR,
        env=child_env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    watchdog = threading.Timer(300, proc.kill)
    watchdog.start()
    try:
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if re.search(r"\] step \d+/100000", line):
                proc.send_signal(signal.SIGINT)
                break
        stderr = "".join(seen) + proc.communicate()[1]
    finally:
        watchdog.cancel()
    assert proc.returncode == 130, stderr[-3000:]
    step = re.search(r"interrupted at step (\d+); saved ", the_error_line(stderr)).group(1)
    assert (tmp_path / "checkpoints" / f"ckpt-{step}.index").exists()


def test_a_ctrl_c_that_python_dropped_stops_the_run_all_the_same(monkeypatch):
    """A KeyboardInterrupt raised while a garbage-collection callback runs (jax registers one)
    is printed as "Exception ignored" and dropped; the run must stop all the same, where it
    next checks (after it is built, and after each loop)."""
    monkeypatch.setattr(cli.runner, "_interrupts", [])
    with pytest.raises(KeyboardInterrupt):  # delivered as usual
        cli.runner._interrupt(signal.SIGINT, None)
    cli.runner._interrupts.clear()
    previous = signal.signal(signal.SIGINT, cli.runner._interrupt)
    sent = []

    def ctrl_c_during_collection(phase, info):
        if not sent:
            sent.append(phase)
            signal.raise_signal(signal.SIGINT)

    gc.callbacks.append(ctrl_c_during_collection)
    try:
        gc.collect()  # the handler raises inside the callback: Python drops it
    finally:
        gc.callbacks.remove(ctrl_c_during_collection)
        signal.signal(signal.SIGINT, previous)
    assert sent
    with pytest.raises(KeyboardInterrupt):
        cli.raise_if_interrupted()
    with pytest.raises(KeyboardInterrupt):  # the action the binary gives the trainer
        train._stop_on_a_dropped_ctrl_c(None, {})


@pytest.mark.parametrize(
    "setting, value, message",
    [
        ("train_steps", "ten", "Trainer.train_steps must be a positive integer, got 'ten'"),
        ("train_steps", 4.5, "Trainer.train_steps must be a positive integer, got 4.5"),
        ("learning_rate", -1, "Trainer.learning_rate must be a positive number, got -1"),
        ("eval_every", 0, "Trainer.eval_every must be a positive integer or None, got 0"),
        ("weight_decay", "0.1", "Trainer.weight_decay must be a non-negative number, got '0.1'"),
        ("clip_norm", float("inf"), "Trainer.clip_norm must be a positive number or None"),
    ],
)
def test_trainer_settings_are_checked_before_anything_is_built(setting, value, message, tmp_path):
    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        trainer.Trainer(str(tmp_path / "run"), model_fn=None, dataset_fn=None, **{setting: value})
    assert not (tmp_path / "run").exists()


def test_a_full_disk_and_device_memory_are_told_apart():
    def message(error):
        return train.out_of_resources(error, "/runs/a")

    full = tf.errors.ResourceExhaustedError(None, None, "/runs/a/x.tmp; No space left on device")
    assert message(full).startswith("cannot write /runs/a/x.tmp: No space left on device.")
    too_large = OSError(errno.EFBIG, "File too large")
    assert message(too_large).startswith("cannot write to /runs/a: File too large.")
    oom = message(tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor"))
    assert oom.startswith("out of device memory: OOM when allocating tensor. Try a remat policy")
    assert "global_batch_size" in oom and "framework.planner" in oom
    assert message(OSError(errno.EACCES, "Permission denied")) is None


def test_a_write_refused_mid_run_is_one_line():
    def message(error):
        return train.unwritable(error, "/runs/a")

    read_only = tf.errors.PermissionDeniedError(
        None, None, "/runs/a/checkpoints/ckpt-15_temp; Read-only file system [Op:SaveV2]"
    )
    assert message(read_only).startswith(
        "cannot write /runs/a/checkpoints/ckpt-15_temp: Read-only file system. Make it writable"
    )
    assert message(OSError(errno.EACCES, "Permission denied")).startswith(
        "cannot write to /runs/a: Permission denied."
    )
    assert message(OSError(errno.ENOSPC, "No space left on device")) is None


@pytest.mark.parametrize(
    "entry, make, message",
    [
        ("checkpoints", "file", "checkpoints is a file, which a run never writes there"),
        ("LOCK", "directory", "LOCK is a directory, which a run never writes there"),
        ("config.gin", "directory", "config.gin is a directory"),
        ("train", "file", "train is a file, which a run never writes there"),
        ("checkpoints", "unwritable", "checkpoints' is not writable"),
    ],
)
def test_a_model_dir_whose_entries_a_run_cannot_use_stops_at_once(entry, make, message, tmp_path):
    """Checked before anything is built: found later, the run would have trained (or logged a
    fresh start) and then failed with a traceback at its first save."""
    path = tmp_path / entry
    if make == "file":
        path.write_text("not a checkpoint")
    elif make == "directory":
        path.mkdir()
    else:  # a directory no one may write, root included
        path.symlink_to("/proc")
    with pytest.raises(cli.UsageError, match=re.escape(message)):
        cli.prepare_model_dir(str(tmp_path))


@pytest.mark.parametrize(
    "line, message",
    [
        ("import os", "line 1: 'import os': a run's config is read without running its imports"),
        ("import os", "(gin files are code): pass --trusted_imports=os if you trust that module"),
        ("from os import path", "imports (gin files are code): pass --trusted_imports=os.path"),
        ("include 'other.gin'", "line 1: \"include 'other.gin'\": a run's config is read"),
        ("include 'other.gin'", "without reading its includes (gin files are code): copy the"),
        ("Trainer.model_fn = @mine.model", "No configurable matching reference '@mine.model'"),
    ],
)
def test_a_run_config_is_read_with_the_projects_names_only(line, message):
    gin.clear_config()
    try:
        with pytest.raises(cli.UsageError, match=re.escape(message)):
            cli.parse_run_config(f"{line}\nTrainer.train_steps = 4\n", "run/config.gin")
    finally:
        gin.clear_config()


def test_a_trusted_import_that_does_not_import_is_one_line():
    gin.clear_config()
    with pytest.raises(cli.UsageError, match=r"No module named 'not_mine' \(--trusted_imports\)"):
        cli.parse_run_config("import not_mine\n", "run/config.gin", ["not_mine"])


def test_gin_shorthand_becomes_bindings():
    rewritten = cli.rewrite_gin_shorthand(["prog", "--gin.A.b=3", "--mode=train"])
    assert rewritten == ["prog", "--gin_bindings=A.b = 3", "--mode=train"]


def test_binding_names_are_checked_against_the_signature():
    assert cli.binding_name(settings.TrainerSettings, "remat_policy") == "Trainer.remat_policy"
    assert cli.binding_name(text.TextCorpus, "vocab_path", "data") == "data.TextCorpus.vocab_path"
    with pytest.raises(TypeError, match="Trainer has no parameter 'remat'"):
        cli.binding_name(settings.TrainerSettings, "remat")


def console_command(name: str) -> tuple[str]:
    """The installed console command's script (pip puts it beside the interpreter)."""
    script = os.path.join(os.path.dirname(sys.executable), name)
    assert os.path.exists(script), f"{name} is not installed: pip install -e ."
    return (script,)


def listed_flags(help_text: str) -> set[str]:
    return set(re.findall(r"^  (?:-\w,)?(--[a-z_]+):", help_text, re.M))


HELP_CASES = {
    "framework.train": ["--gin_file", "--gin_bindings", "--model_dir", "--check_determinism"],
    "framework.planner": ["--gin_file", "--memory_budget", "--batch_sizes", "--target"],
    "framework.sample": ["--model_dir", "--prompt", "--max_tokens", "--verbosity"],
    "framework.export": ["--model_dir", "--export_dir", "--checkpoint"],
}


@pytest.mark.slow
def test_help_lists_the_flags_of_each_binary_and_only_those():
    """`python -m`, the installed console command and the planner's old name `framework.plan`
    print the same flags: the binary's own and those it shares, nothing else."""
    launchers = {
        (module, how): launcher
        for module in HELP_CASES
        for how, launcher in [
            ("-m", ("-m", module)),
            ("console", console_command(module.replace(".planner", ".plan").replace(".", "-"))),
        ]
    }
    launchers["framework.planner", "alias"] = ("-m", "framework.plan")
    # All at once: each is a Python start-up and absl, no TensorFlow.
    with concurrent.futures.ThreadPoolExecutor(len(launchers)) as pool:
        results = dict(
            zip(launchers, pool.map(lambda a: run_binary("--help", launcher=a), launchers.values()))
        )
    for (module, how), result in results.items():
        assert result.returncode == 0, (module, how, result.stderr[-2000:])
        listed = listed_flags(result.stdout)
        assert set(HELP_CASES[module]) <= listed, (module, how, result.stdout)
        assert ("--policies" in listed) == (module in ("framework.train", "framework.planner"))
        assert listed == listed_flags(results[module, "-m"].stdout), (module, how)
        usage = results[module, "-m"].stdout.split("flags:")[0].split("\n", 2)[-1]
        assert usage.strip() and usage in result.stdout, (module, how)  # the binary's docstring
        assert "oneDNN" not in result.stdout + result.stderr  # no TensorFlow was loaded
    assert "framework.plan is the planner" in results["framework.planner", "alias"].stderr


@pytest.mark.slow
def test_print_config_prints_the_operative_config_and_trains_nothing(tmp_path):
    result = run_binary(*TINY_RUN, "--print_config", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Trainer.train_steps = 4" in result.stdout
    assert "Runtime.strategy = 'one_device'" in result.stdout  # defaults too: the operative config
    assert not list(tmp_path.iterdir())


def test_parse_gin_finds_files_on_the_search_path():
    gin.clear_config()
    try:
        cli.parse_gin(["vit_b16.gin"], [], [str(cli.CONFIGS_DIR)])
        assert gin.query_parameter("Trainer.global_batch_size") == 8
    finally:
        gin.clear_config()


def test_the_last_line_through_the_stderr_filter_is_out_when_the_process_exits(tmp_path):
    """The binaries pass stderr through a filter process; a caller that reads stderr from a file
    once the binary has exited (a shell's `2> file`, a job scheduler) found it empty when the
    error came right after start-up (4 runs in 10 of `framework.export` with no run)."""
    script = (
        "import sys\n"
        "from framework.cli import tensorflow_noise\n"
        "tensorflow_noise.filter_stderr(['noise'])\n"
        "print('noise', file=sys.stderr)\n"
        "print('error: the last line', file=sys.stderr)\n"
        "sys.exit(2)\n"
    )
    log = tmp_path / "stderr.txt"
    for _ in range(3):
        with open(log, "w") as stderr:
            # The filter process gets a copy of the file: run() returns when this one exits.
            status = subprocess.run(
                [sys.executable, "-c", script], cwd=REPO_DIR, env=child_env(), stderr=stderr
            ).returncode
        assert status == 2 and log.read_text() == "error: the last line\n", log.read_text()


@pytest.mark.slow
def test_a_text_run_learns_its_vocabulary_in_its_model_dir_and_a_warm_start_keeps_it(
    tmp_path, monkeypatch, caplog, capsys
):
    """lm_quickstart.gin names no vocab_path: the run learns it into MODEL_DIR/vocab.txt and
    writes nothing where it was started (it wrote runs/lm_quickstart/ there, which a run on
    another corpus then reused); a run warm-started from it tokenizes with its vocabulary; a
    run with checkpoints but no vocab.txt asks for its file; --print_config writes nothing."""
    from framework import sample
    from framework.data.text import vocab
    from tests.binaries.in_process import train_binary
    from tests.data.text.test_sources import TINY_LM_RUN

    run = [
        *TINY_LM_RUN,
        *(f"--gin.data.TextCorpus.{n}" for n in ("vocab_size=200", "sequence_length=16")),
    ]
    started_in = tmp_path / "cwd"
    started_in.mkdir()
    monkeypatch.chdir(started_in)
    train_binary(run, tmp_path / "a", caplog)
    learned = vocab.load_vocab(str(tmp_path / "a" / "vocab.txt"))
    assert f"'{tmp_path}/a/vocab.txt'" in (tmp_path / "a" / "config.gin").read_text()
    warm = [*run, f"--gin.Trainer.init_checkpoint='{tmp_path}/a/checkpoints'"]
    train_binary(warm, tmp_path / "b", caplog)
    assert not (tmp_path / "b" / "vocab.txt").exists()
    assert sample.load_run(str(tmp_path / "b"))[1] == learned
    # A run from before this default (its vocabulary under runs/) is not given another one.
    shutil.copytree(tmp_path / "a", tmp_path / "c")
    (tmp_path / "c" / "vocab.txt").unlink()
    with pytest.raises(cli.UsageError, match="set TextCorpus.vocab_path to the vocabulary file"):
        train_binary(run, tmp_path / "c", caplog)
    assert not (tmp_path / "c" / "vocab.txt").exists()
    gin.clear_config()
    try:
        train.FLAGS(cli.rewrite_gin_shorthand(["train", *run, "--print_config"]))
        assert train.main(["train"]) == 0
    finally:
        train.FLAGS.unparse_flags()
        gin.clear_config()
    assert "TextCorpus.vocab_size = 200" in capsys.readouterr().out
    assert not list(started_in.iterdir())
