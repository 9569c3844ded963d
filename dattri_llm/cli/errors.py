"""`CLIError`: a failure the command line reports as one line and an exit code."""

from __future__ import annotations

__all__ = ["CLIError"]


class CLIError(Exception):
    """A user-facing failure: ``main`` prints ``message`` on one line and exits ``code``."""

    def __init__(self, message: str, *, code: int = 1) -> None:
        super().__init__(message)
        self.code = code
