"""Trains a model from gin configs: `python -m framework.train [--gin_file=...] [--gin.NAME=VALUE]`.

With no `--gin_file` it runs the embedded default `quickstart.gin` (a small ViT on generated shapes,
on the CPU) into `runs/quickstart`. The resolved config and the command line are written to the
model directory (by the chief only, in a cluster), once the run is built: a config that fails to
build leaves an earlier run's `config.gin` as it was. Problems the user can fix end in one line on
stderr and exit status 2: bad flags or config, a full disk, a step that does not fit in device
memory. A preempted run (SIGTERM) saves a checkpoint and exits with status 42; Ctrl-C saves one
(when there is a finite state to save) and exits with status 130, as a shell's interrupted
command does (in a run of several workers, Ctrl-C stops it as SIGTERM does: status 42).
`--print_config` builds the run without a model directory and prints the operative gin config
(what `config.gin` would hold), without training. `--check_determinism=N` trains two copies of
the run N steps, without a model directory, and says whether and where they differ
(`framework.trainer.determinism`).

`Trainer.remat_policy = "auto"` with `--memory_budget` runs the planner (`framework.planner`) first,
over `--policies` (and `--shard_states`) at the config's batch size, and trains with its pick. The
binary resolves "auto": the Trainer and the remat library only ever see a real policy.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import logging
import os
import re
import shlex
import signal
import sys
import tempfile
from collections.abc import Iterator, Sequence

import gin
from absl import flags

from framework import cli
from framework.core.errors import BAD_DATA, Interrupted, UsageError, UserError

AUTO_POLICY = "auto"
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
# How TensorFlow's file system errors spell those errnos: "<path>; No space left on device".
DISK_FULL = re.compile(r"([^\s;]*);? (No space left on device|File too large|Disk quota exceeded)")
UNWRITABLE_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS)
UNWRITABLE = re.compile(r"([^\s;]*);? (Read-only file system|Permission denied)")

cli.define_config_flags()
cli.define_budget_flags("Needed with Trainer.remat_policy='auto': the planner picks against it.")
flags.DEFINE_enum("mode", "train_and_eval", ["train", "eval", "train_and_eval"], "What to run.")
flags.DEFINE_bool(
    "print_config",
    False,
    "Build the run without a model directory, print the operative gin config and exit.",
)
flags.DEFINE_integer(
    "check_determinism",
    None,
    "Instead of training: build the run twice without a model directory, train both copies N "
    "steps in lockstep and report the first step and variable where they differ (exit 1), or "
    "that they are bit-identical (exit 0).",
    lower_bound=1,
)
flags.adopt_module_key_flags(cli)
flags.declare_key_flag("verbosity")
FLAGS = flags.FLAGS


def write_run_record(model_dir: str, config: str, command: str) -> None:
    """Writes config.gin and command (through tf.io.gfile, so a gs:// model_dir works); an
    earlier, different config.gin is kept, dated."""
    import tensorflow as tf

    from framework.core import files

    config_path = files.join(model_dir, "config.gin")
    # Bytes: an earlier config.gin is kept as it is, whatever its encoding.
    earlier = files.read_bytes(config_path) if tf.io.gfile.exists(config_path) else None
    if earlier is not None and earlier != config.encode():
        stamp = datetime.datetime.fromtimestamp(files.modified_time(config_path))
        # Copied, not moved: config.gin stays the run's until the new one is written whole.
        files.write_bytes(files.join(model_dir, f"config-{stamp:%Y%m%d-%H%M%S}.gin"), earlier)
    files.write_bytes(config_path, config)
    files.write_bytes(files.join(model_dir, "command"), command + "\n")
    logging.info("wrote %s (the operative config) and the command", config_path)
    logging.debug("operative gin config:\n%s", config)


def check_required_bindings(settings_class: type) -> None:
    """A config with no model or no data set (an empty gin file) is bad input: gin would stop
    with a RuntimeError and its traceback when the Trainer is called."""
    required = [cli.binding_name(settings_class, name) for name in ("model_fn", "dataset_fn")]
    missing = [name for name in required if cli.bound_value(name) is None]
    if missing:
        raise UsageError(
            f"the config does not set {' or '.join(missing)}: is a gin file empty? "
            "configs/quickstart.gin shows a complete one"
        )


def bad_data(error: Exception) -> str | None:
    """The line of a check on the data that failed inside tf.data (`errors.BAD_DATA` begins
    it), without TensorFlow's brackets and graph nodes; None for any other error."""
    import tensorflow as tf

    text = str(error)
    if not isinstance(error, tf.errors.InvalidArgumentError) or BAD_DATA not in text:
        return None
    line = text[text.index(BAD_DATA) :].splitlines()[0].rsplit("]", 1)[0]
    # tf.debugging.Assert prints its strings C-escaped: \' for ', octal bytes for non-ASCII.
    escapes = {b"n": b"\n", b"t": b"\t", b"r": b"\r"}

    def unescape(match):
        code = match.group(1)
        return bytes([int(code, 8)]) if len(code) == 3 else escapes.get(code, code)

    return re.sub(rb"\\([0-7]{3}|.)", unescape, line.encode()).decode("utf-8", "replace")


def unreadable_data(error: Exception) -> str | None:
    """What tf.data could not read or decode (a file that is no TFRecord, an image that does not
    decode), without TensorFlow's function and node names; None for any other error."""
    import tensorflow as tf

    text = str(error)
    readable = (tf.errors.DataLossError, tf.errors.InvalidArgumentError)
    if not isinstance(error, readable) or "IteratorGetNext" not in text:
        return None
    lines = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", text).splitlines()
    # A graph's error names the failed node on the line after the reason: "\t [[{{node ...}}]]".
    nodes = [i for i, line in enumerate(lines) if line.lstrip().startswith("[[")]
    reason = lines[nodes[0] - 1] if nodes and nodes[0] > 0 else lines[0]
    reason = reason.split(" [Op:")[0].strip().rstrip(".")
    return f"the data cannot be read ({reason}): check the files the config's data set reads"


def _failed_write(error: Exception, errnos: tuple[int, ...], pattern: re.Pattern):
    """(where, reason) of a write that failed with one of `errnos` (an OSError, or TensorFlow's
    error whose message `pattern` matches: path, then reason); None for any other error."""
    import tensorflow as tf

    found = pattern.search(str(error))
    if isinstance(error, OSError) and error.errno in errnos:
        return error.filename, error.strerror
    if isinstance(error, tf.errors.OpError) and found:
        return found.group(1), found.group(2)
    return None


def out_of_resources(error: Exception, model_dir: str) -> str | None:
    """One line for a full disk or a step too large for the device's memory, the two resource
    errors fixed by changing the run rather than the code; None for any other error.

    TensorFlow raises ResourceExhaustedError for both (a full disk is errno ENOSPC, which it maps
    there too), and OutOfRangeError for a file over its size limit (EFBIG), so they are told
    apart by the message.
    """
    import tensorflow as tf

    failed = _failed_write(error, DISK_FULL_ERRNOS, DISK_FULL)
    if failed is not None:
        where, reason = failed
        return (
            f"cannot write {where or f'to {model_dir}'}: {reason}. Free disk space (or raise the "
            "file size limit, or use another --model_dir) and run the same command again: it "
            "resumes from the newest checkpoint"
        )
    if isinstance(error, tf.errors.ResourceExhaustedError):
        return (
            f"out of device memory: {cli.first_line(error)[:200]}. Try a remat policy "
            "(--gin.Trainer.remat_policy=\"'nothing_saveable'\") or a smaller "
            "Trainer.global_batch_size; python -m framework.planner --memory_budget=... finds the "
            "fastest setting that fits"
        )
    return None


def unwritable(error: Exception, model_dir: str) -> str | None:
    """One line for a write refused mid-run (model_dir or its checkpoints/ made read-only or
    lost its permissions after the start-up check); None for any other error."""
    failed = _failed_write(error, UNWRITABLE_ERRNOS, UNWRITABLE)
    if failed is None:
        return None
    where, reason = failed
    return (
        f"cannot write {where or f'to {model_dir}'}: {reason}. Make it writable again (or use "
        "another --model_dir) and run the same command: it resumes from the newest checkpoint"
    )


# The flags of the plan that `remat_policy = 'auto'` makes (`cli.define_budget_flags`).
PLANNER_FLAGS = (
    "memory_budget",
    "safety_margin",
    "policies",
    "measure",
    "search_budget",
    "shard_states",
    "compile_processes",
)


def resolve_auto_policy(
    settings_class: type, files: Sequence[str], bindings: Sequence[str], model_dir: str
):
    """Replaces `Trainer.remat_policy = "auto"` by the planner's pick for --memory_budget (and
    `Trainer.shard_state` by its level, among --shard_states) and returns the action that puts
    the run's measured peak beside the budget (None without auto).
    With `Runtime.accelerator_type` bound, the plan is the TPU compiler's for that chip; on a
    host with a GPU, that GPU's compiler's (`planner.plan_target`); the budget defaults to the
    device's memory.

    The plan (`plan.json`, `plan.png`) is written to model_dir beside the run, and the pick is
    bound in gin so that the `config.gin` of the run names the policy it trained with. On a CPU
    the BFC allocator is chosen, so that the run's peak can be measured.
    """
    name = cli.binding_name(settings_class, "remat_policy")
    budget = cli.memory_budget_flag()
    policy = cli.bound_value(name)
    if not (isinstance(policy, str) and policy.strip().lower() == AUTO_POLICY):
        given = [f"--{flag}" for flag in PLANNER_FLAGS if FLAGS[flag].present]
        if given:
            verb = "is" if len(given) == 1 else "are"
            raise UsageError(
                f"{', '.join(given)} {verb} only used with {name} = 'auto'; drop "
                f"{'it' if len(given) == 1 else 'them'} or set --gin.{name}=\"'auto'\""
            )
        return None
    from framework import memory, planner
    from framework.memory import targets
    from framework.trainer import actions

    accelerator = cli.bound_value("Runtime.accelerator_type")
    try:
        target = planner.plan_target(accelerator, FLAGS.measure)
    except ValueError as error:
        raise UsageError(f"{name} = 'auto' on Runtime.accelerator_type: {error}") from None
    if budget is None and target is None:
        raise UsageError(
            f"{name} = 'auto' needs --memory_budget, e.g. 16GiB (or Runtime.accelerator_type: "
            "its HBM)"
        )
    budget = budget or (target and targets.target_device(target).memory_bytes)
    memory.enable_cpu_bfc_allocator()

    config = planner.RunConfig(files, bindings, FLAGS.gin_search_paths)
    try:
        plan = planner.make_plan(
            config,
            budget,
            cli.policies_flag(),
            safety_margin=FLAGS.safety_margin,
            measure=FLAGS.measure,
            search_budget=FLAGS.search_budget,
            compile_processes=FLAGS.compile_processes,
            target=target,
            shard_states=cli.shard_states_flag(),
        )
    except planner.ConfigError as error:
        raise UsageError(str(error)) from None
    planner.write_plan(plan, model_dir)
    logging.info("remat policy auto: plan\n%s", planner.table(plan))
    if plan.pick is None:
        raise UsageError(f"remat policy auto: {planner.verdict(plan)}")
    logging.info("remat policy auto: %s", planner.verdict(plan))
    with gin.unlock_config():
        gin.bind_parameter(name, plan.pick.policy)
        gin.bind_parameter(cli.binding_name(settings_class, "shard_state"), plan.pick.shard_state)
    planned = f"{plan.pick.label}, {plan.pick.fit_kind} {plan.pick.fit_bytes / 2**20:.0f} MiB"
    return actions.WatchMemoryBudget(budget, planned)


def _save_interrupted(run_trainer) -> str:
    """Saves the interrupted run (see `RunState.save_interrupted`); the line that reports it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the save short
    saved = run_trainer.run_state.save_interrupted()
    if saved is None:
        return (
            f"interrupted at step {run_trainer.step}; not saved (nothing trained yet, or a "
            "non-finite state)"
        )
    return f"interrupted at step {run_trainer.step}; saved {saved}: the same command resumes"


def _ctrl_c_preempts() -> None:
    """In a run of several workers, Ctrl-C stops it as SIGTERM does: saving is collective, so
    one worker alone cannot save after a KeyboardInterrupt, while TensorFlow's SIGTERM handler
    makes every worker save at a step they agree on (the run then exits with status 42)."""

    def preempt(signum, frame):
        logging.warning("Ctrl-C: stopping as if preempted; the workers save at a step they agree")
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGINT, preempt)


def _check_determinism(trainer_class: type, num_steps: int) -> int:
    """`--check_determinism`: exit status 0 when two copies of the run stay bit-identical."""
    from framework.trainer import determinism

    found = determinism.first_difference(lambda: _build(trainer_class, None), num_steps)
    if found is None:
        logging.info(
            "determinism check: %d steps of two copies of the run: bit-identical", num_steps
        )
        return 0
    logging.warning("determinism check: two copies of the run first differ after %s", found)
    return 1


def _build(trainer_class: type, model_dir: str | None, extra_actions=()):
    try:
        return trainer_class(model_dir, extra_actions=extra_actions)
    except (ValueError, TypeError) as error:
        raise UsageError(f"cannot build the run: {cli.first_line(error)}") from None


def _stop_on_a_dropped_ctrl_c(loop, metrics) -> None:
    """An action: a Ctrl-C that Python dropped during a loop (`cli.raise_if_interrupted`)
    stops the run after it, as one it delivered would have (the run saves and exits 130)."""
    cli.raise_if_interrupted()


def _build_and_run(trainer_class: type, model_dir: str, watch=None) -> dict[str, float]:
    """Builds the Trainer from the parsed config, records the run, then runs --mode (with the
    `watch` action after the trainer's own, when given)."""
    extra = (_stop_on_a_dropped_ctrl_c,) + (() if watch is None else (watch,))
    run_trainer = _build(trainer_class, model_dir, extra)
    cli.raise_if_interrupted()  # (a Ctrl-C that Python dropped while the run was built)
    if run_trainer.run_state is not None and run_trainer.run_state.workers > 1:
        _ctrl_c_preempts()
    # Only now, with the config built: a bad one never replaces an earlier run's record.
    if run_trainer.is_chief:  # one record per cluster
        config = gin.operative_config_str()
        write_run_record(model_dir, config, shlex.join(sys.argv))
        run_trainer.summaries.text(run_trainer.step, "operative_config", config)
    try:
        if FLAGS.mode == "train":
            return run_trainer.train()
        if FLAGS.mode == "eval":
            return run_trainer.evaluate()
        return run_trainer.train_and_evaluate()
    except KeyboardInterrupt:
        raise Interrupted(_save_interrupted(run_trainer)) from None


def main(argv: Sequence[str]) -> int:
    """Configures and runs the trainer for the parsed flags; returns the exit status."""
    files, bindings = cli.gin_inputs(argv)
    in_memory = FLAGS.print_config or FLAGS.check_determinism
    model_dir = None if in_memory else cli.model_dir_flag()

    import tensorflow as tf

    from framework.core.errors import PreemptedError
    from framework.trainer import Trainer  # registers every gin name (see configurables)
    from framework.trainer.settings import TrainerSettings

    cli.parse_gin(files, bindings, FLAGS.gin_search_paths)
    check_required_bindings(TrainerSettings)
    if in_memory:  # what the run learns from its data goes to a directory removed afterwards
        with tempfile.TemporaryDirectory(prefix="framework-") as scratch:
            cli.bind_run_files(scratch)
            if FLAGS.print_config:
                _build(Trainer, None)
                print(gin.operative_config_str())
                return 0
            return _check_determinism(Trainer, FLAGS.check_determinism)
    bindings = [*bindings, *cli.bind_run_files(model_dir)]
    if FLAGS.mode == "eval":
        _check_there_is_a_model_to_evaluate(model_dir, TrainerSettings)
    try:
        created = not tf.io.gfile.exists(model_dir)
    except tf.errors.OpError:  # storage out of reach: the writability check says so
        created = False
    cli.prepare_model_dir(model_dir)
    with _removed_if_refused(model_dir, created):
        try:
            watch = resolve_auto_policy(TrainerSettings, files, bindings, model_dir)
            _build_and_run(Trainer, model_dir, watch)
        except PreemptedError as preempted:
            logging.info("%s", preempted)
            return preempted.exit_status
        except (OSError, tf.errors.OpError) as error:
            message = (
                out_of_resources(error, model_dir)
                or unwritable(error, model_dir)
                or bad_data(error)
                or unreadable_data(error)
            )
            if message is None:
                raise
            raise UsageError(message) from None
    logging.info(
        "done: the run is in %s (checkpoints in %s, summaries: tensorboard --logdir %s)",
        model_dir,
        os.path.join(model_dir, "checkpoints"),
        model_dir,
    )
    return 0


def _check_there_is_a_model_to_evaluate(model_dir: str, settings_class: type) -> None:
    """--mode=eval evaluates a run's checkpoint, or the weights of `Trainer.init_checkpoint`:
    without either it would score fresh random weights (a mistyped --model_dir, say) and exit 0."""
    from framework.rundir import checkpoints

    if cli.bound_value(cli.binding_name(settings_class, "init_checkpoint")):
        return
    if checkpoints.committed_of_run(model_dir) == []:  # (None: out of reach, the run says so)
        raise UsageError(
            f"--mode=eval: no checkpoint in {model_dir}/checkpoints to evaluate: train first, "
            "check --model_dir, or give Trainer.init_checkpoint"
        )


@contextlib.contextmanager
def _removed_if_refused(model_dir: str, created: bool) -> Iterator[None]:
    """Removes the model directory this run created when the run is refused before writing
    anything to it (a bad setting found while building): no empty directory is left behind.
    One that holds anything but the run's lock file stays."""
    from framework.core import files
    from framework.rundir.lock import LOCK_FILE

    try:
        yield
    except UserError:
        if created and files.remove_if_unused(model_dir, [LOCK_FILE]):
            logging.info("removed %s, which this refused run had created", model_dir)
        raise


def console_main() -> None:
    """Entry point: `python -m framework.train`, `framework-train`."""
    cli.run(main)


if __name__ == "__main__":
    console_main()
