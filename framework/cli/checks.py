"""What the parsed flags say, checked before a binary starts any work.

absl checks a flag's type; these check what it means - a gin file that exists, a model directory
the run can write to, a memory budget, shard levels and remat policies that exist - so that a
mistake is one `UsageError` line at once, not a failure minutes into a run.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from absl import flags

from framework.cli.flags import DEFAULT_GIN_FILE, DEFAULT_MODEL_DIR
from framework.cli.gin_config import bound_value, gin_file_path
from framework.cli.runner import first_line
from framework.core.errors import UsageError

FLAGS = flags.FLAGS


def gin_inputs(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """The gin files and bindings the flags name, and checks there are no stray arguments and
    that each file exists (before any other flag: a missing file is the first thing to fix)."""
    if len(argv) > 1:
        raise UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    files = FLAGS.gin_file or [DEFAULT_GIN_FILE]
    for name in files:
        gin_file_path(name, FLAGS.gin_search_paths)
    return files, list(FLAGS.gin_bindings or [])


def model_dir_flag() -> str:
    """--model_dir, which defaults to runs/quickstart only for the default config."""
    model_dir = FLAGS.model_dir or (DEFAULT_MODEL_DIR if not FLAGS.gin_file else None)
    if model_dir is None:
        raise UsageError("--model_dir is required with --gin_file")
    return model_dir


# What a run keeps in model_dir, by kind: found as the other kind, it is no run of ours.
_RUN_DIRECTORIES = ("checkpoints", "train", "eval")  # train/, eval/: the summaries
_RUN_FILES = ("LOCK", "config.gin", "command")


def prepare_model_dir(model_dir: str) -> None:
    """Creates model_dir and writes and removes a real file in it and in its checkpoints/ (each
    worker of a cluster a file of its own) before anything expensive starts. A bucket out of
    reach or without the credentials to write is one line that says what to check, and so is
    an entry of the run that is not what the run keeps there (a file named checkpoints)."""
    import tensorflow as tf

    from framework.core import files

    _check_writable(model_dir, f"model_dir {model_dir!r}", model_dir)  # (a bucket out of reach)
    for name in (*_RUN_DIRECTORIES, *_RUN_FILES):
        path = files.join(model_dir, name)
        if tf.io.gfile.exists(path) and tf.io.gfile.isdir(path) != (name in _RUN_DIRECTORIES):
            kind = "a file" if name in _RUN_DIRECTORIES else "a directory"
            raise UsageError(
                f"{path} is {kind}, which a run never writes there: move it away, or use "
                "another --model_dir"
            )
    checkpoints = files.join(model_dir, "checkpoints")
    if (
        files.is_local(checkpoints)
        and os.path.islink(checkpoints)
        and not tf.io.gfile.exists(checkpoints)
    ):  # a run would start afresh, then fail at its first save
        raise UsageError(
            f"{checkpoints} links to {os.readlink(checkpoints)!r}, which is not there (storage "
            "not mounted?): mount it, or remove the link to keep checkpoints in the model_dir"
        )
    if tf.io.gfile.isdir(checkpoints):  # (it may have lost its write permission, or been mounted)
        _check_writable(checkpoints, repr(checkpoints), model_dir)


def _check_writable(directory: str, what: str, model_dir: str) -> None:
    import tensorflow as tf

    from framework.core import files

    try:
        files.check_writable(directory)
    except (OSError, tf.errors.OpError) as error:
        reason = error.strerror if isinstance(error, OSError) else first_line(error.message)
        hint = (
            ""
            if files.is_local(model_dir)
            else "; check the network, the bucket's name and that these credentials may write "
            "to it (`gcloud auth application-default login`, or the VM's service account)"
        )
        raise UsageError(f"{what} is not writable: {reason}{hint}") from None


def memory_budget_flag() -> int | None:
    """--memory_budget in bytes, or None when it was not given."""
    if FLAGS.memory_budget is None:
        return None
    from framework.memory import units

    try:
        budget = units.parse_bytes(FLAGS.memory_budget)
    except ValueError as error:
        raise UsageError(f"--memory_budget: {error}") from None
    if budget == 0:
        raise UsageError("--memory_budget must be more than 0 bytes")
    return budget


def shard_states_flag() -> list[str]:
    """--shard_states, checked against the shard levels; the config's own `Trainer.shard_state`
    without it (call after the gin files are parsed)."""
    from framework.shard import LEVELS

    if not FLAGS.shard_states:
        return [bound_value("Trainer.shard_state") or "none"]
    names = [name.strip() for name in FLAGS.shard_states if name.strip()]
    unknown = [name for name in names if name not in LEVELS]
    if unknown or not names:
        raise UsageError(
            f"--shard_states: {', '.join(unknown) or 'empty'}; choose from {', '.join(LEVELS)}"
        )
    return names


def policies_flag() -> list[str]:
    """--policies, each checked against the remat library's names."""
    from framework.remat import policies

    names = [name.strip() for name in FLAGS.policies if name.strip()]
    if not names:
        raise UsageError("--policies is empty: name at least one remat policy")
    for name in names:
        try:
            policies.get_policy(name)
        except ValueError as error:
            raise UsageError(f"--policies: {error}") from None
    return names
