"""Errors a user can cause while naming or loading a model.

Each carries a one-line ``hint`` saying what to do about it; the CLI prints the
message and the hint and exits non-zero, without a traceback.
"""

from __future__ import annotations

from speccli.errors import UsageError

__all__ = ["HeadsMismatch", "ModelLoadError", "TokenizerMismatchError"]


class ModelLoadError(UsageError):
    """A model could not be found, resolved or loaded (bad input: exit code 2).

    ``str(error)`` is one line saying what was tried and what went wrong;
    ``hint`` is one line saying what to do (may be empty).
    """

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message, hint)
        self.message = message


class TokenizerMismatchError(ModelLoadError):
    """The draft's tokenizer does not map ids to the same tokens as the target's."""


class HeadsMismatch(UsageError):
    """Draft heads that cannot serve this target (trained or published for another), or a
    file or folder that holds no heads specgen can read."""
