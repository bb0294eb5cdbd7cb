"""Runs a binary's `main(argv)` so that every binary ends the same way.

Bad input of any kind - a bad or unknown flag, a gin file or binding, a `UserError` raised by
`main` - is one `error:` line on stderr and exit status 2, where absl would print its usage; a
Ctrl-C that `main` did not handle is status 130, as a shell's interrupted command.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from absl import app, flags

from framework.cli.flags import rewrite_gin_shorthand
from framework.cli.tensorflow_noise import quiet_tensorflow
from framework.core.errors import UsageError, UserError

USAGE_EXIT_CODE = 2
INTERRUPTED_EXIT_CODE = 130  # a shell's status for a command ended by SIGINT (128 + 2)
FLAGS = flags.FLAGS


_interrupts: list[int] = []  # the Ctrl-Cs this process received (`raise_if_interrupted`)


def _interrupt(signum: int, frame) -> None:
    """Python's own Ctrl-C handler that also remembers the signal: a KeyboardInterrupt raised
    while a garbage-collection callback runs (jax registers one, and TensorFlow's import imports
    jax) is printed as "Exception ignored" and dropped, and the run would go on."""
    _interrupts.append(signum)
    raise KeyboardInterrupt


def raise_if_interrupted() -> None:
    """Raises KeyboardInterrupt if Ctrl-C was pressed: again, where one was dropped (see
    `_interrupt`), so that the caller stops as it would have."""
    if _interrupts:
        raise KeyboardInterrupt


def first_line(error: BaseException | str) -> str:
    """The first line of an error's message: gin appends "In call to configurable ..." lines to
    an exception raised inside a configurable, TensorFlow appends the graph nodes involved."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def exit_with_error(error: BaseException | str, status: int = USAGE_EXIT_CODE) -> NoReturn:
    """Ends the process with one `error:` line on stderr and `status`: the last line, so what
    logs as the process is torn down (TensorFlow, for the values of a checkpoint it refused to
    restore into another model) is not printed after it."""
    print(f"error: {first_line(error)}", file=sys.stderr)
    logging.disable(logging.CRITICAL)
    sys.exit(status)


def _parse_flags(argv: Sequence[str]) -> list[str]:
    try:
        return FLAGS(rewrite_gin_shorthand(argv))
    except (flags.Error, UsageError) as error:
        exit_with_error(error)
    except SystemExit:  # absl ends --help with status 1; asking for help is not an error
        if any(arg.lstrip("-") in ("help", "h", "helpshort", "helpfull") for arg in argv[1:]):
            sys.exit(0)
        raise


def run(main: Callable[[list[str]], int | None]) -> NoReturn:
    """Runs a binary's `main(argv)` under absl with the behaviour in the module docstring, its
    flags parsed with `--gin.NAME=VALUE` rewritten and TensorFlow's noise kept off the console."""

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
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # (not when ignored)
        signal.signal(signal.SIGINT, _interrupt)
    try:
        app.run(wrapped, flags_parser=_parse_flags)
    except KeyboardInterrupt:  # during flag parsing or absl's set-up
        exit_with_error("interrupted", INTERRUPTED_EXIT_CODE)
