"""Errors a user can cause, and how the CLI reports them: one line, a hint, an exit code."""

from __future__ import annotations

import os
import sys

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a tool whose reader went away
# Rank 0 of a tensor-parallel run whose peer went away: it says nothing, and the launcher names
# the rank that died, with exit code 1 (speccli.backends.distributed).
EXIT_RANK_LOST = 86

DEBUG_ENV = "SPECGEN_DEBUG"


class UsageError(Exception):
    """Bad input or options: reported with exit code 2."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint


class RankLost(Exception):
    """Another rank of a tensor-parallel run went away during an operation they shared."""


def debugging() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def report(message: str, hint: str = "") -> None:
    print(f"error: {message}", file=sys.stderr)
    if hint:
        print(f"hint: {hint}", file=sys.stderr)
