"""How many tokens to draft next."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from speccli.engine.events import StepEvent


class DraftLengthPolicy(Protocol):
    def next_k(self) -> int:
        """The number of tokens to draft in the coming step."""
        ...

    def observe(self, step: StepEvent) -> None:
        """Learn from the step just verified."""
        ...


class FixedDraftLength:
    def __init__(self, k: int) -> None:
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        self.k = k

    def next_k(self) -> int:
        return self.k

    def observe(self, step: StepEvent) -> None:
        pass


def expected_tokens(acceptance: list[float], k: int) -> float:
    """Expected tokens from one step that drafts k: the resampled/bonus token plus each
    drafted token, counted when it and every token before it survive."""
    total, survive = 1.0, 1.0
    for position in range(k):
        survive *= acceptance[position]
        total += survive
    return total


@dataclass
class StepCosts:
    """Seconds per verification pass by number of tokens fed, and per drafted token, as
    exponential moving averages of what the decoder measured on this machine."""

    smoothing: float = 0.3
    verify: dict[int, float] = field(default_factory=dict)
    draft_per_token: float | None = None
    _counts: dict[object, int] = field(default_factory=dict, repr=False)

    def seed(self, verify: dict[int, float], draft_per_token: float | None, weight: int = 3) -> None:
        """Start from measured costs (a calibration), worth `weight` online measurements each."""
        for fed, seconds in verify.items():
            self.verify[fed] = seconds
            self._counts[fed] = weight
        if draft_per_token is not None:
            self.draft_per_token = draft_per_token
            self._counts["draft"] = weight

    def observe(self, step: StepEvent) -> None:
        fed = step.drafted + 1
        self.verify[fed] = self._blend(fed, self.verify.get(fed), step.verify_seconds)
        if step.drafted:
            self.draft_per_token = self._blend(
                "draft", self.draft_per_token, step.draft_seconds / step.drafted
            )

    def _blend(self, key: object, old: float | None, new: float) -> float:
        # A plain mean of the first few measurements, then an exponential moving average:
        # one odd first measurement must not linger.
        count = self._counts.get(key, 0) + 1
        self._counts[key] = count
        weight = max(self.smoothing, 1.0 / count)
        return new if old is None else (1 - weight) * old + weight * new

    def verify_seconds(self, fed: int) -> float | None:
        """Measured, else an optimistic guess, so that an untried size that could pay is
        tried once and measured. Feeding more tokens never costs less, so the guess is
        the cost of the largest measured smaller size; below the smallest measured size,
        a cost proportional to the tokens fed."""
        if not self.verify:
            return None
        if fed in self.verify:
            return self.verify[fed]
        below = [n for n in self.verify if n < fed]
        if below:
            return self.verify[max(below)]
        smallest = min(self.verify)
        return self.verify[smallest] * fed / smallest

    def step_seconds(self, k: int) -> float | None:
        verify = self.verify_seconds(k + 1)
        if verify is None:
            return None
        return verify + k * (self.draft_per_token or 0.0)


class AdaptiveDraftLength:
    """Each step, the k in 0..max_k that maximises expected tokens per second.

    Acceptance is tracked per draft position (the chance that position i survives given
    that every earlier one did), with a prior and exponential forgetting so that it
    follows the text. Costs are learned from the steps themselves, so the choice reflects
    this machine: where verifying k+1 tokens costs what one does, long drafts pay; where
    it grows fast or the draft is slow, k shrinks, down to 0 (plain decoding). While k is
    0 nothing is learned about acceptance, so every `probe_every` steps it drafts one.
    """

    def __init__(
        self,
        max_k: int = 8,
        first_k: int = 4,
        prior_acceptance: float = 0.7,
        prior_weight: float = 2.0,
        forgetting: float = 0.97,
        probe_every: int = 16,
    ) -> None:
        if max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {max_k}")
        self.max_k = max_k
        self.first_k = min(first_k, max_k)
        self.prior_acceptance = prior_acceptance
        self.prior_weight = prior_weight
        self.forgetting = forgetting
        self.probe_every = probe_every
        self.costs = StepCosts()
        self._kept = [0.0] * max_k
        self._tried = [0.0] * max_k
        self._steps_without_drafting = 0

    def acceptance(self) -> list[float]:
        prior = self.prior_acceptance * self.prior_weight
        return [(kept + prior) / (tried + self.prior_weight) for kept, tried in zip(self._kept, self._tried)]

    def next_k(self) -> int:
        if self.costs.step_seconds(0) is None:
            return self.first_k
        if self._steps_without_drafting >= self.probe_every:
            return 1
        acceptance = self.acceptance()
        best_k, best_rate = 0, 0.0
        for k in range(self.max_k + 1):
            seconds = self.costs.step_seconds(k)
            if not seconds or seconds <= 0:
                continue
            rate = expected_tokens(acceptance, k) / seconds
            if rate > best_rate * 1.0001:  # ties go to the shorter draft
                best_k, best_rate = k, rate
        return best_k

    def observe(self, step: StepEvent) -> None:
        self.costs.observe(step)
        if step.drafted == 0:
            self._steps_without_drafting += 1
            return
        self._steps_without_drafting = 0
        for position in range(min(step.drafted, self.max_k)):
            if position > step.accepted:
                break  # never reached: an earlier token was rejected
            self._kept[position] = self._kept[position] * self.forgetting + (position < step.accepted)
            self._tried[position] = self._tried[position] * self.forgetting + 1
