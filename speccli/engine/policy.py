"""How many tokens to draft next."""

from __future__ import annotations

from typing import Protocol


class DraftLengthPolicy(Protocol):
    def next_k(self) -> int:
        """The number of tokens to draft in the coming step."""
        ...

    def observe(self, drafted: int, accepted: int) -> None:
        """Learn from the step just verified."""
        ...


class FixedDraftLength:
    def __init__(self, k: int) -> None:
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        self.k = k

    def next_k(self) -> int:
        return self.k

    def observe(self, drafted: int, accepted: int) -> None:
        pass
