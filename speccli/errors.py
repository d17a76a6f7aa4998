"""Errors a user can cause, and how the CLI reports them: one line, a hint, an exit code."""

from __future__ import annotations

import io
import os
import sys

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a tool whose reader went away

DEBUG_ENV = "SPECGEN_DEBUG"


class UsageError(Exception):
    """Bad input or options: reported with exit code 2."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint


class RuntimeFailure(Exception):
    """A failure that is no fault of the input (a server that cannot be reached, or that
    failed): reported as one line with a hint, exit code 1."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint


def debugging() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def report(message: str, hint: str = "") -> None:
    print(f"error: {message}", file=sys.stderr)
    if hint:
        print(f"hint: {hint}", file=sys.stderr)


class StdoutClosed(RuntimeFailure):
    def __init__(self) -> None:
        super().__init__(
            "standard output is closed: there is nowhere to write the output",
            "redirect it instead: > FILE, or > /dev/null to drop it",
        )


class ClosedStdout(io.TextIOBase):
    """What stands for standard output when the process started with it closed (`>&-`):
    Python leaves sys.stdout None there, and the first write would be an AttributeError.
    Writing raises StdoutClosed; a command that writes nothing (serve) runs as usual."""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        raise StdoutClosed()

    def isatty(self) -> bool:
        return False
