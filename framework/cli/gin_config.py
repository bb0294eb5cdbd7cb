"""Gin for the binaries: config files and bindings parsed with errors a user can act on, a run's
recorded config.gin read without running code, and gin names checked against the code.

Gin's own errors name Python internals and its file lookup logs errors for files it then finds;
a `config.gin` from a model directory may come from anywhere. Every failure here is one
`UsageError` line.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

import gin
from gin import config_parser

from framework.cli.runner import first_line
from framework.core.errors import UsageError


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


VOCAB_FILE = "vocab.txt"


def bind_run_files(model_dir: str) -> list[str]:
    """Binds what a run learns from its data and must read again to its model directory: the
    WordPiece vocabulary of a text source (`data.TextCorpus`, `data.TfdsText`) whose config
    leaves `vocab_path` unbound becomes `model_dir/vocab.txt`, so that a run never writes
    outside its directory and a run on another corpus never reuses a vocabulary learned from
    this one. A run warm-started from another run (`Trainer.init_checkpoint`, its directory or
    one of its checkpoints) that has a `vocab.txt` takes that one instead: its embeddings were
    trained with it. A run that has checkpoints but no `vocab.txt` learned its vocabulary
    elsewhere: nothing is bound, and a text source asks for the file rather than learn another.
    Returns the bindings made, for the processes the binary starts."""
    from framework.core import files
    from framework.rundir import checkpoints
    from framework.trainer.settings import TrainerSettings

    init_checkpoint = bound_value(binding_name(TrainerSettings, "init_checkpoint"))
    vocab = files.join(model_dir, VOCAB_FILE)
    if not _exists(vocab):
        earlier = init_checkpoint and files.join(_run_directory(init_checkpoint), VOCAB_FILE)
        if earlier and _exists(earlier):
            vocab = earlier
        elif checkpoints.committed_of_run(model_dir):
            return []
    made = [f"{name} = {vocab!r}" for name in vocab_path_names() if bound_value(name) is None]
    with gin.unlock_config():
        for binding in made:
            gin.parse_config(binding)
    return made


def vocab_path_names() -> list[str]:
    """The gin names of the vocabulary files of the text sources that learn one."""
    from framework.data import text
    from framework.data.text import tfds_text

    return [
        binding_name(source, "vocab_path", module="data")
        for source in (text.TextCorpus, tfds_text.TfdsText)
    ]


def _exists(path: str) -> bool:
    """Whether `path` exists; False when its storage is out of reach (the run says so later)."""
    import tensorflow as tf

    try:
        return tf.io.gfile.exists(path)
    except tf.errors.OpError:
        return False


def _run_directory(checkpoint: str) -> str:
    """The model directory of a run named by its directory, its `checkpoints/` or a checkpoint
    prefix in it (`.../checkpoints/ckpt-N`), as `Trainer.init_checkpoint` takes them."""
    path = checkpoint.rstrip("/")
    if os.path.basename(os.path.dirname(path)) == "checkpoints":
        path = os.path.dirname(path)
    return os.path.dirname(path) if os.path.basename(path) == "checkpoints" else path


def _not_gin_lookup(record: logging.LogRecord) -> bool:
    return record.module != "resource_reader"


def parse_gin(files: Sequence[str], bindings: Sequence[str], search_paths: Sequence[str]) -> None:
    """Parses gin files and bindings; a missing file or a bad binding becomes a UsageError.

    Files are resolved here and given to gin by their full path: gin's own lookup logs an error
    line for every search path that does not hold the file, even when another does.
    """
    paths = [gin_file_path(name, search_paths) for name in files]
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


def gin_file_path(name: str, search_paths: Sequence[str]) -> str:
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


def parse_run_config(text: str, source: str, trusted_imports: Collection[str] = ()) -> None:
    """Binds the `config.gin` a run recorded, with this project's registrations only.

    A gin file is code: an `import` line imports (runs) any module on the path and `include`
    reads another file. A model directory may come from anywhere, so reading a run's config must
    not run either: both are refused before gin sees the text, and a name the project does not
    register is an error instead of an import. The user may name modules they trust
    (`trusted_imports`, `--trusted_imports`): the config's imports of exactly those run.
    """
    try:
        # This pass reads the statements only: the names are checked by gin.parse_config, once
        # the trusted imports have registered theirs.
        delegate = gin.config.ParserDelegate(skip_unknown=True)
        for statement in config_parser.ConfigParser(text, delegate):
            if isinstance(statement, config_parser.IncludeStatement):
                raise UsageError(
                    f"{_where(source, statement)}: a run's config is read without reading its "
                    f"includes (gin files are code): copy the bindings it needs into {source}"
                )
            if (
                isinstance(statement, config_parser.ImportStatement)
                and statement.module not in trusted_imports
            ):
                raise UsageError(
                    f"{_where(source, statement)}: a run's config is read without running its "
                    f"imports (gin files are code): pass --trusted_imports={statement.module} if "
                    "you trust that module"
                )
        gin.parse_config(text)
    except ImportError as error:
        raise UsageError(f"cannot read {source}: {first_line(error)} (--trusted_imports)") from None
    except (ValueError, SyntaxError, KeyError, TypeError) as error:
        raise UsageError(
            f"cannot read {source}: {first_line(error)} (a run's config may only use the names "
            "this project registers and the modules of --trusted_imports)"
        ) from None


def _where(source: str, statement) -> str:
    """`source, line N: 'the line'` for a statement gin parsed."""
    where = statement.location
    return f"{source}, line {where.line_num}: {where.line_content.strip()!r}"
