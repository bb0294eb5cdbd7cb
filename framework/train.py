"""Trains a model from gin configs: `python -m framework.train [--gin_file=...] [--gin.NAME=VALUE]`.

With no `--gin_file` it runs the embedded default `quickstart.gin` (a small ViT on generated shapes,
on the CPU) into `runs/quickstart`. The resolved config and the command line are written to the
model directory. Problems the user can fix end in one line on stderr and exit status 2.
"""

from __future__ import annotations

import datetime
import logging
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import gin
from absl import app, flags

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # TensorFlow's C++ INFO lines drown the progress

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_GIN_FILE = "quickstart.gin"
DEFAULT_MODEL_DIR = "runs/quickstart"
GIN_SHORTHAND = "--gin."

flags.DEFINE_multi_string("gin_file", None, "Gin config files, found on --gin_search_paths.")
flags.DEFINE_multi_string("gin_param", None, "Gin bindings, e.g. 'Trainer.train_steps = 100'.")
flags.DEFINE_multi_string("gin_bindings", None, "Alias of --gin_param.")
flags.DEFINE_list(
    "gin_search_paths", [".", str(CONFIGS_DIR)], "Directories searched for --gin_file."
)
flags.DEFINE_string(
    "model_dir",
    None,
    f"Output directory (default {DEFAULT_MODEL_DIR} with no --gin_file; required otherwise).",
)
flags.DEFINE_enum("mode", "train_and_eval", ["train", "eval", "train_and_eval"], "What to run.")
FLAGS = flags.FLAGS


class UsageError(Exception):
    """Bad input on the command line or in a config: reported in one line, exit status 2."""


def split_gin_shorthand(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Separates t5x-style `--gin.NAME=VALUE` arguments from the rest, as gin bindings."""
    rest, bindings = [], []
    for arg in argv:
        if arg.startswith(GIN_SHORTHAND):
            name, sep, value = arg[len(GIN_SHORTHAND) :].partition("=")
            if not sep or not name:
                raise UsageError(f"{arg!r} should look like --gin.NAME=VALUE")
            bindings.append(f"{name} = {value}")
        else:
            rest.append(arg)
    return rest, bindings


def parse_gin(files: Sequence[str], bindings: Sequence[str], search_paths: Sequence[str]) -> None:
    """Parses gin files and bindings; a missing file or a bad binding becomes a UsageError."""
    for path in search_paths:
        gin.add_config_file_search_path(path)
    for name in files:
        if not any(Path(root, name).is_file() for root in ("", *search_paths)):
            raise UsageError(f"gin file {name!r} not found (searched: {', '.join(search_paths)})")
    try:
        gin.parse_config_files_and_bindings(files, bindings, finalize_config=True)
    except (ValueError, SyntaxError, KeyError, TypeError, OSError) as error:
        message = " ".join(str(error).split())
        raise UsageError(f"bad gin configuration: {message}") from None


def prepare_model_dir(model_dir: str) -> None:
    """Creates model_dir and checks it is writable before anything expensive starts."""
    try:
        os.makedirs(model_dir, exist_ok=True)
        probe = Path(model_dir, ".write_test")
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise UsageError(f"model_dir {model_dir!r} is not writable: {error.strerror}") from None


def write_run_record(model_dir: str, config: str, command: str) -> None:
    """Writes config.gin and command; an earlier, different config.gin is kept, dated."""
    config_path = Path(model_dir, "config.gin")
    if config_path.exists() and config_path.read_text() != config:
        stamp = datetime.datetime.fromtimestamp(config_path.stat().st_mtime).strftime(
            "%Y%m%d-%H%M%S"
        )
        config_path.rename(config_path.with_name(f"config-{stamp}.gin"))
    config_path.write_text(config)
    Path(model_dir, "command").write_text(command + "\n")
    logging.info("command: %s", command)
    logging.info("operative gin config:\n%s", config)


def run(argv: Sequence[str], gin_shorthand: Sequence[str]) -> dict[str, float]:
    """Configures and runs the trainer for the parsed flags; returns the final metrics."""
    if len(argv) > 1:
        raise UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    files = FLAGS.gin_file or [DEFAULT_GIN_FILE]
    model_dir = FLAGS.model_dir or (DEFAULT_MODEL_DIR if not FLAGS.gin_file else None)
    if model_dir is None:
        raise UsageError("--model_dir is required with --gin_file")
    bindings = [*(FLAGS.gin_param or []), *(FLAGS.gin_bindings or []), *gin_shorthand]

    import framework.configurables  # noqa: F401  (registers the gin names)
    from framework import trainer

    parse_gin(files, bindings, FLAGS.gin_search_paths)
    prepare_model_dir(model_dir)
    try:
        run_trainer = trainer.Trainer(model_dir)
    except (ValueError, TypeError) as error:
        raise UsageError(f"cannot build the run: {error}") from None
    write_run_record(model_dir, gin.operative_config_str(), shlex.join(sys.argv))
    if FLAGS.mode == "train":
        return run_trainer.train()
    if FLAGS.mode == "eval":
        return run_trainer.evaluate()
    return run_trainer.train_and_evaluate()


def main() -> None:
    """Entry point: `python -m framework.train`."""
    from framework.trainer import TrainerError

    try:
        argv, shorthand = split_gin_shorthand(sys.argv)
    except UsageError as error:
        sys.exit(f"error: {error}")

    def app_main(args: Sequence[str]) -> None:
        logging.getLogger().setLevel(logging.INFO)
        try:
            run(args, shorthand)
        except (UsageError, TrainerError) as error:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(2)

    app.run(app_main, argv=argv)


if __name__ == "__main__":
    main()
