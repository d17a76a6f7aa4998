"""Errors a user can cause, and how the CLI reports them: one line, a hint, an exit code."""

from __future__ import annotations

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
