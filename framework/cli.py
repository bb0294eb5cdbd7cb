"""What the binaries share: one runner, their flags, gin parsing, the model directory.

Each binary (`framework.train`, `framework.planner`, `framework.sample`, `framework.export`)
defines the flags it uses with the `define_*` functions here and hands its `main(argv) -> exit
status` to `run`, which:

- rewrites t5x-style `--gin.NAME=VALUE` into `--gin_bindings` inside absl's flag parsing;
- reports bad input - a bad or unknown flag, a gin file or binding, a `UserError` raised by
  `main` - as one `error:` line on stderr and exit status 2 (absl would print its usage);
- turns Ctrl-C before `main` handled it into status 130, as a shell's interrupted command;
- keeps TensorFlow's start-up banners, its CUDA probes on machines without GPUs, its C++ INFO
  lines and known-harmless Python warnings out of the console: `--verbosity=1` (or `-v 1`)
  brings them back.

`--help` lists every flag the binary takes and imports no TensorFlow.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

import gin
from absl import app, flags
from gin import config_parser

from framework.core.errors import UsageError, UserError

CONFIGS_DIR = Path(__file__).resolve().parent / "configs"
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
USAGE_EXIT_CODE = 2
INTERRUPTED_EXIT_CODE = 130  # a shell's status for a command ended by SIGINT (128 + 2)
# The statements of a gin file that run code or read files: refused in a run's config.gin.
RUN_CODE = (config_parser.ImportStatement, config_parser.IncludeStatement)
# Python warnings TensorFlow raises on every run that say nothing about the user's program.
HARMLESS_WARNINGS = (
    "To make it possible to preserve tf.data options across serialization boundaries",
)
# Lines TensorFlow's C++ runtime writes on every start (before its log level is read, so
# TF_CPP_MIN_LOG_LEVEL cannot hide them) or at every finite data set's end, which say nothing
# about the user's run: kept off the console by `quiet_tensorflow`.
TENSORFLOW_NOISE = (
    "All log messages before absl::InitializeLog() is called are written to STDERR",
    "oneDNN custom operations are on",
    "Could not find cuda drivers on your machine",
    "failed call to cuInit",
    "Unable to register cu",  # cuDNN, cuFFT, cuBLAS factories on GPU builds
    "computation placer already registered",
    "This TensorFlow binary is optimized to use available CPU instructions",
    "To enable the following instructions",
    "TF-TRT Warning",
    "Local rendezvous is aborting with status: OUT_OF_RANGE: End of sequence",
    "does not implement the AsGraphDefInternal() method needed to apply optimizations",
)
# Reads this process' stderr from a pipe and passes on every line but the noise. A separate
# process, so that nothing is lost if this one crashes (it reads to the end of the pipe), and one
# that outlives Ctrl-C and SIGTERM, so that the run's last lines still reach the console.
_STDERR_FILTER = """
import re, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
noise = re.compile(sys.argv[1].encode())
for line in sys.stdin.buffer:
    if not noise.search(line):
        sys.stdout.buffer.write(line)
        sys.stdout.buffer.flush()
"""
FLAGS = flags.FLAGS


def define_config_flags() -> None:
    """The flags that name a run's config: gin files, bindings, search paths, model_dir.

    The `define_*` functions define each flag once per process (tests import several binaries);
    a binary then adopts them as its own (`flags.adopt_module_key_flags(cli)`) so that `--help`
    lists them."""
    if "gin_file" in FLAGS:
        return
    flags.DEFINE_multi_string(
        "gin_file",
        None,
        f"Gin config files, found on --gin_search_paths (default {DEFAULT_GIN_FILE}).",
    )
    flags.DEFINE_multi_string(
        "gin_bindings",
        None,
        "Gin bindings, e.g. 'Trainer.train_steps = 100'; --gin.Trainer.train_steps=100 is the "
        "same.",
    )
    flags.DEFINE_alias("gin_param", "gin_bindings")
    flags.DEFINE_list(
        "gin_search_paths",
        [".", str(CONFIGS_DIR)],
        "Directories searched for --gin_file (the package's configs/ last).",
    )
    define_model_dir_flag(
        f"Output directory (default {DEFAULT_MODEL_DIR} with no --gin_file; required otherwise)."
    )


def define_model_dir_flag(help_text: str) -> None:
    if "model_dir" not in FLAGS:
        flags.DEFINE_string("model_dir", None, help_text)


def define_budget_flags(memory_budget_help: str) -> None:
    """--memory_budget, --safety_margin and --policies: what the planner picks against."""
    if "memory_budget" in FLAGS:
        return
    flags.DEFINE_string(
        "memory_budget",
        None,
        "Memory per device the step must fit in, e.g. 16GiB (powers of 1024) or 16GB (of 1000). "
        + memory_budget_help,
    )
    flags.DEFINE_float(
        "safety_margin",
        0.1,
        "Fraction of --memory_budget kept free: a pick's peak must stay below budget * (1 - "
        "margin).",
        lower_bound=0.0,
        upper_bound=0.9,
    )
    flags.DEFINE_list(
        "policies",
        list(DEFAULT_POLICIES),
        "Remat policies to try, from the least recomputation to the most: equally fast ones are "
        "decided in this order.",
    )
    flags.DEFINE_enum(
        "measure",
        "auto",
        ["auto", "run", "compile"],
        "How each setting is measured: compile (XLA's plan of the step, nothing runs; time "
        "estimated from its FLOPs), run (the step runs: allocator peak and median time), or auto "
        "(run when XLA's plan fits this host's memory, else compile).",
    )
    flags.DEFINE_boolean(
        "search_budget",
        True,
        "Also search the largest memory-budget policy fraction that fits (budget:F, in steps "
        "of 0.02) on XLA's plan, one probe per compile worker at a time.",
    )
    flags.DEFINE_list(
        "shard_states",
        None,
        "Levels of Trainer.shard_state to plan every setting at (none, optimizer, gradients, "
        "weights), the lowest first: equally fast ones are decided in this order. Default: the "
        "config's own.",
    )
    flags.DEFINE_integer(
        "compile_processes",
        0,
        "Worker processes that read XLA's plans at once, each holding the weights and the "
        "optimizer state in host memory. 0 (the default): up to one per CPU core, each next one "
        "started once the others are ready and the host has twice a worker's peak memory "
        "available (1.25 times, once one has compiled).",
        lower_bound=0,
    )


def first_line(error: BaseException | str) -> str:
    """The first line of an error's message: gin appends "In call to configurable ..." lines to
    an exception raised inside a configurable, TensorFlow appends the graph nodes involved."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def exit_with_error(error: BaseException | str, status: int = USAGE_EXIT_CODE) -> NoReturn:
    """Ends the process with one `error:` line on stderr and `status`."""
    print(f"error: {first_line(error)}", file=sys.stderr)
    sys.exit(status)


def rewrite_gin_shorthand(argv: Sequence[str]) -> list[str]:
    """`--gin.NAME=VALUE` as `--gin_bindings=NAME = VALUE` (t5x's shorthand)."""
    rewritten = []
    for arg in argv:
        if arg.startswith(GIN_SHORTHAND):
            name, sep, value = arg[len(GIN_SHORTHAND) :].partition("=")
            if not sep or not name:
                raise UsageError(f"{arg!r} should look like --gin.NAME=VALUE")
            arg = f"--gin_bindings={name} = {value}"
        rewritten.append(arg)
    return rewritten


def _parse_flags(argv: Sequence[str]) -> list[str]:
    try:
        return FLAGS(rewrite_gin_shorthand(argv))
    except (flags.Error, UsageError) as error:
        exit_with_error(error)
    except SystemExit:  # absl ends --help with status 1; asking for help is not an error
        if any(arg.lstrip("-") in ("help", "h", "helpshort", "helpfull") for arg in argv[1:]):
            sys.exit(0)
        raise


def filter_stderr(noise: Sequence[str]) -> None:
    """From now on, lines of this process' stderr (Python's and C++'s alike) that contain one of
    `noise` are dropped; the others pass unchanged."""
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    console = os.dup(2)
    subprocess.Popen(
        [sys.executable, "-c", _STDERR_FILTER, "|".join(map(re.escape, noise))],
        stdin=read_end,
        stdout=console,
        close_fds=True,
    )
    os.dup2(write_end, 2)
    for fd in (read_end, write_end, console):
        os.close(fd)


def quiet_tensorflow() -> None:
    """Keeps TensorFlow's noise (see `TENSORFLOW_NOISE`), its C++ INFO lines, its per-save
    Python INFO lines and known-harmless warnings off the console unless --verbosity is 1 or
    more. Called before TensorFlow loads."""
    if "verbosity" in FLAGS and FLAGS["verbosity"].value >= 1:
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    for name in ("tensorflow", "absl"):  # our own lines use the root logger
        logger = logging.getLogger(name)
        logger.setLevel(logging.WARNING)
        # And a filter: saving a SavedModel sets absl's verbosity to FATAL and back (TensorFlow's
        # AutoTrackable), which leaves absl's logger at the root's level (INFO) for the rest.
        logger.addFilter(lambda record: record.levelno >= logging.WARNING)
    for message in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    filter_stderr(TENSORFLOW_NOISE)


def run(main: Callable[[list[str]], int | None]) -> NoReturn:
    """Runs a binary's `main(argv)` under absl with the behaviour in the module docstring."""

    def wrapped(argv: list[str]) -> None:
        quiet_tensorflow()
        logging.getLogger().setLevel(logging.INFO)
        try:
            status = main(argv)
        except UserError as error:
            exit_with_error(error, error.exit_status)
        except KeyboardInterrupt:
            exit_with_error("interrupted", INTERRUPTED_EXIT_CODE)
        sys.exit(status or 0)

    # absl's --help lists the key flags of the module sys.argv[0] names, under the docstring of
    # __main__: the binary's own under `python -m`, but the wrapper script of a console command
    # (`framework-train`) or of an alias. Give that script the binary's flags and docstring.
    if main.__module__ != "__main__":
        for flag in FLAGS.get_key_flags_for_module(main.__module__):
            FLAGS.register_key_flag_for_module(sys.argv[0], flag)
        sys.modules["__main__"].__doc__ = sys.modules[main.__module__].__doc__
    try:
        app.run(wrapped, flags_parser=_parse_flags)
    except KeyboardInterrupt:  # during flag parsing or absl's set-up
        exit_with_error("interrupted", INTERRUPTED_EXIT_CODE)


def binding_name(configurable: Callable, parameter: str, module: str | None = None) -> str:
    """The gin name of `parameter` of `configurable`, e.g. "Trainer.remat_policy": checked
    against its signature, so a renamed argument fails here, not as a binding gin ignores.
    A class registered under another name says so in its `gin_name`."""
    target = configurable.__init__ if inspect.isclass(configurable) else configurable
    name = getattr(configurable, "gin_name", configurable.__name__)
    if parameter not in inspect.signature(target).parameters:
        raise TypeError(f"{name} has no parameter {parameter!r}")
    return ".".join(filter(None, (module, name, parameter)))


def bound_value(name: str) -> object:
    """The value gin binds to `name`, or None when nothing binds it."""
    try:
        return gin.query_parameter(name)
    except ValueError:
        return None


def _not_gin_lookup(record: logging.LogRecord) -> bool:
    return record.module != "resource_reader"


def parse_gin(files: Sequence[str], bindings: Sequence[str], search_paths: Sequence[str]) -> None:
    """Parses gin files and bindings; a missing file or a bad binding becomes a UsageError.

    Files are resolved here and given to gin by their full path: gin's own lookup logs an error
    line for every search path that does not hold the file, even when another does.
    """
    paths = [_gin_file_path(name, search_paths) for name in files]
    for path in search_paths:  # for `include` lines inside the files
        gin.add_config_file_search_path(path)
    # An `include` still goes through gin's lookup, which logs `Path not found` at ERROR level for
    # each place that does not hold the file before the search path that does.
    logging.getLogger().addFilter(_not_gin_lookup)
    try:
        gin.parse_config_files_and_bindings(paths, bindings, finalize_config=True)
    except (ValueError, SyntaxError, KeyError, TypeError, OSError) as error:
        message = _gin_error_message(error, bindings)
        raise UsageError(f"bad gin configuration: {message}") from None


def _gin_file_path(name: str, search_paths: Sequence[str]) -> str:
    """The path of gin file `name`: as given, or under the first search path that holds it."""
    found = [Path(root, name) for root in ("", *search_paths) if Path(root, name).is_file()]
    if not found:
        raise UsageError(f"gin file {name!r} not found (searched: {', '.join(search_paths)})")
    return str(found[0])


# How gin reports a value it cannot read: Python's `literal_eval` error (which names an AST
# node by its address) followed by gin's own line.
_UNREADABLE_VALUE = re.compile(
    r"malformed node or string(?: on line \d+)?: <ast\.\w+ object at 0x[0-9a-f]+>\s*"
    r"Failed to parse token '(?P<token>[^']*)'(?P<where>.*)"
)


def _gin_error_message(error: BaseException, bindings: Sequence[str]) -> str:
    """Gin's error in one line, a value it cannot read said plainly, in the binding it is in
    (gin numbers the bindings' lines, one binding a line)."""
    message = " ".join(str(error).split())
    match = _UNREADABLE_VALUE.search(message)
    if match is None:
        return message
    where = match["where"].strip()
    line = re.fullmatch(r"\(line (\d+)\)", where)
    if line and 1 <= int(line[1]) <= len(bindings):
        where = f"in the binding {bindings[int(line[1]) - 1].strip()!r}"
    return (
        f"cannot read the value {match['token']!r} {where}: a value is a Python literal (10, "
        "0.1, 'text' in quotes, True, [1, 2]) or a @reference"
    )


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

    from framework.core import files

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


def gin_inputs(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """The gin files and bindings the flags name, and checks there are no stray arguments and
    that each file exists (before any other flag: a missing file is the first thing to fix)."""
    if len(argv) > 1:
        raise UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    files = FLAGS.gin_file or [DEFAULT_GIN_FILE]
    for name in files:
        _gin_file_path(name, FLAGS.gin_search_paths)
    return files, list(FLAGS.gin_bindings or [])


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
