"""What the binaries share: the gin flags, their parsing, the model directory, one-line errors.

`python -m framework.train` and `python -m framework.plan` take the same config flags, so a plan
is made for exactly the run that will be trained. The memory-budget flags live here too: the
trainer uses them for `Trainer.remat_policy = "auto"`, the planner for its pick.

Bad input ends in one `error:` line on stderr and exit status 2, from a flag, a gin file or a
binding alike: absl's flag errors are reported that way too (`parse_flags`), not with its usage.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import gin
from absl import flags
from gin import config_parser

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # TensorFlow's C++ INFO lines drown the progress

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_GIN_FILE = "quickstart.gin"
DEFAULT_MODEL_DIR = "runs/quickstart"
GIN_SHORTHAND = "--gin."
DEFAULT_POLICIES = (
    "none",
    "dots_saveable+random_masks_saveable",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "random_masks_saveable",
    "nothing_saveable",
)

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
flags.DEFINE_string(
    "memory_budget",
    None,
    "Memory per device the step must fit in, e.g. 16GiB (powers of 1024) or 16GB (of 1000). "
    "framework.plan picks against it; framework.train needs it with Trainer.remat_policy='auto'.",
)
flags.DEFINE_float(
    "safety_margin",
    0.1,
    "Fraction of --memory_budget kept free: a pick's peak must stay below budget * (1 - margin).",
    lower_bound=0.0,
    upper_bound=0.9,
)
flags.DEFINE_list(
    "policies",
    list(DEFAULT_POLICIES),
    "Remat policies to try, from the least recomputation to the most: equally fast ones are "
    "decided in this order.",
)
FLAGS = flags.FLAGS
USAGE_EXIT_CODE = 2
# The statements of a gin file that run code or read files: refused in a run's config.gin.
RUN_CODE = (config_parser.ImportStatement, config_parser.IncludeStatement)


class UsageError(Exception):
    """Bad input on the command line or in a config: reported in one line, exit status 2."""


def first_line(error: BaseException | str) -> str:
    """The first line of an error's message: gin appends "In call to configurable ..." lines to
    an exception raised inside a configurable, TensorFlow appends the graph nodes involved."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def exit_with_error(error: BaseException | str, status: int = USAGE_EXIT_CODE) -> NoReturn:
    """Ends the process with one `error:` line on stderr and `status`."""
    print(f"error: {first_line(error)}", file=sys.stderr)
    sys.exit(status)


def parse_flags(argv: Sequence[str]) -> list[str]:
    """absl's flag parsing for `app.run(..., flags_parser=parse_flags)`: a bad or unknown flag is
    one `error:` line and status 2, like any other bad input (absl prints its usage, status 1)."""
    try:
        return FLAGS(list(argv))
    except flags.Error as error:
        exit_with_error(error)


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


def parse_run_config(text: str, source: str) -> None:
    """Binds the `config.gin` a run recorded, with this project's registrations only.

    A gin file is code: an `import` line imports (runs) any module on the path and `include`
    reads another file. A model directory may come from anywhere, so reading a run's config must
    not run either: both are refused before gin sees the text, and a name the project does not
    register is an error instead of an import.
    """
    try:
        delegate = gin.config.ParserDelegate(skip_unknown=False)
        for statement in config_parser.ConfigParser(text, delegate):
            if isinstance(statement, RUN_CODE):
                where = statement.location
                raise UsageError(
                    f"{source}, line {where.line_num}: {where.line_content.strip()!r}: a run's "
                    "config is read without running its imports or includes (gin files are "
                    "code); register what it needs in framework/configurables.py instead"
                )
        gin.parse_config(text)
    except (ValueError, SyntaxError, KeyError, TypeError) as error:
        raise UsageError(
            f"cannot read {source}: {first_line(error)} (a run's config may only use the names "
            "this project registers)"
        ) from None


def prepare_model_dir(model_dir: str) -> None:
    """Creates model_dir and writes and removes a real file in it (each worker of a cluster a
    file of its own) before anything expensive starts. A bucket out of reach or without the
    credentials to write is one line that says what to check."""
    import tensorflow as tf

    from framework import files

    try:
        files.check_writable(model_dir)
    except (OSError, tf.errors.OpError) as error:
        reason = error.strerror if isinstance(error, OSError) else first_line(error.message)
        hint = (
            ""
            if files.is_local(model_dir)
            else "; check the network, the bucket's name and that these credentials may write "
            "to it (`gcloud auth application-default login`, or the VM's service account)"
        )
        raise UsageError(f"model_dir {model_dir!r} is not writable: {reason}{hint}") from None


def gin_inputs(argv: Sequence[str], gin_shorthand: Sequence[str]) -> tuple[list[str], list[str]]:
    """The gin files and bindings the flags name, and checks there are no stray arguments."""
    if len(argv) > 1:
        raise UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    files = FLAGS.gin_file or [DEFAULT_GIN_FILE]
    bindings = [*(FLAGS.gin_param or []), *(FLAGS.gin_bindings or []), *gin_shorthand]
    return files, bindings


def model_dir_flag() -> str:
    """--model_dir, which defaults to runs/quickstart only for the default config."""
    model_dir = FLAGS.model_dir or (DEFAULT_MODEL_DIR if not FLAGS.gin_file else None)
    if model_dir is None:
        raise UsageError("--model_dir is required with --gin_file")
    return model_dir


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
