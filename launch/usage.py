"""The launchers' flag parser: a usage error is one `error:` line, as in the framework's
binaries, instead of argparse's usage block followed by `prog: error: ...`."""

from __future__ import annotations

import argparse
from typing import NoReturn


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose errors are `error: MESSAGE (see --help)` and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see --help)\n")
