"""What the binaries share: the gin flags, their parsing, the model directory, one-line errors.

`python -m framework.train` and `python -m framework.plan` take the same config flags, so a plan
is made for exactly the run that will be trained. The memory-budget flags live here too: the
trainer uses them for `Trainer.remat_policy = "auto"`, the planner for its pick.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import gin
from absl import flags

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
        # A probe of this process' own: the workers of a cluster check the same directory.
        descriptor, probe = tempfile.mkstemp(prefix=".write_test-", dir=model_dir)
        os.close(descriptor)
        os.unlink(probe)
    except OSError as error:
        raise UsageError(f"model_dir {model_dir!r} is not writable: {error.strerror}") from None


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
