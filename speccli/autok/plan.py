"""What the policy decides before each step, and what it decides it from: the decoder asks
the drafter for its signal, the policy turns it into a plan, the decoder carries the plan out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from speccli.autok.costs import CostCurve


@dataclass(frozen=True)
class ShadowGuess:
    """What a cheap drafter (prompt lookup) would have drafted for the last step, which another
    drafted, against the tokens that step settled: its acceptance learned without drafting."""

    match: int  # the length of the n-gram it continued
    compared: int  # its guessed tokens compared: as many as the step settled, at most all it guessed
    kept: int  # the leading ones that came true (kept < compared: the next one did not)

    def __post_init__(self) -> None:
        if not 0 <= self.kept <= self.compared:
            raise ValueError(f"need 0 <= kept <= compared, got {self.kept}, {self.compared}")

    @classmethod
    def against(cls, match: int, guess: Sequence[int], settled: Sequence[int]) -> ShadowGuess | None:
        """The guess made after a `match`-token match, compared with the tokens the step
        settled after it (None where either is empty)."""
        if not guess or not settled:
            return None
        compared = min(len(guess), len(settled))
        kept = next((i for i in range(compared) if guess[i] != settled[i]), compared)
        return cls(match, compared, kept)


@dataclass(frozen=True)
class DraftSignal:
    """What a drafter can say about the coming step before drafting it."""

    match: int = 0  # the length of the n-gram prompt lookup's draft would continue (0: none)
    pooled: int = 0  # lookahead's pooled n-grams that start with the pending token
    shadow: ShadowGuess | None = None  # prompt lookup's guess for the last step, against what it settled
    # Each candidate's own signal, by name, for drafters that take turns (speccli.drafters.candidates).
    parts: tuple[tuple[str, DraftSignal], ...] = ()

    def part(self, name: str) -> DraftSignal:
        """Candidate `name`'s signal (this one where the drafter is not several)."""
        return dict(self.parts).get(name, self)


@dataclass(frozen=True)
class LookaheadPlan:
    """The parts of a lookahead step (speccli.drafters.lookahead) beside its tree."""

    guess_length: int | None = None  # prompt lookup's guess in the tree (None: the drafter's own rule)
    pool: bool = True  # the tree offers the pool's n-grams
    window: bool = True  # the Jacobi window rides along the pass


@dataclass(frozen=True)
class Graft:
    """A cheap candidate's guess (prompt lookup, suffix drafting) grafted into another's tree:
    one pass verifies both (speccli.tree.graft)."""

    source: str
    k: int
    # The chance that each of the guess's tokens is accepted (all before it too), by position.
    survival: tuple[float, ...] = ()
    # What the step is expected to give without the graft, tokens per second (0: not known):
    # a new node pays where its survival per second it adds to the pass is at least this.
    rate: float = 0.0

    def worth(self, position: int, added_seconds: float | None) -> bool:
        """Whether the guess's token at `position` is worth a new node that adds `added_seconds`
        to the pass (None: not measured, taken as paying)."""
        if added_seconds is None or self.rate <= 0 or added_seconds <= 0:
            return True
        chance = self.survival[position] if position < len(self.survival) else 0.0
        return chance >= self.rate * added_seconds


@dataclass(frozen=True)
class StepPlan:
    """One step: draft k tokens as a chain or as a tree k deep (0: a plain step), a tree
    sized by `costs`, and with `lookahead` the window and the pool in the pass."""

    k: int = 0
    tree: bool = False
    costs: CostCurve | None = None  # the live step costs that size a tree (None: the calibration's)
    lookahead: LookaheadPlan | None = None
    source: str | None = None  # which candidate drafts, where drafters take turns
    graft: Graft | None = None  # in a tree step, another candidate's guess in the same tree

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ValueError(f"k must be >= 0, got {self.k}")

    @property
    def method(self) -> str:
        """How the step drafts: plain, chain, tree or lookahead."""
        if self.k == 0:
            return "plain"
        if self.lookahead is not None:
            return "lookahead"
        return "tree" if self.tree else "chain"

    def way(self, drafter: str) -> str:
        """The way of drafting a step of this plan, as --stats counts it and the measured rates
        (speccli.autok.measured) keep it: plain, lookahead, or the drafter (`source`, else
        `drafter`) and its form ("model chain", "ngram tree")."""
        if self.k == 0:
            return "plain"
        if self.lookahead is not None:
            return "lookahead"
        return f"{self.source or drafter} {self.method}"
