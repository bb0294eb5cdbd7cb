"""The launcher's one error: a line for the user and the exit status it ends with."""

from __future__ import annotations


class LaunchError(Exception):
    """A step cannot go on: one line for the user and the launcher's exit status."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status
