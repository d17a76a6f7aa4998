"""Folding decoder events into the figures people ask for: acceptance, tokens per step,
per-position acceptance, tokens/s, and what the i.i.d. formula predicts."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable

from speccli.events import Event, FinishEvent, PrefillEvent, Provenance, StepEvent, TokenEvent


def expected_tokens_per_step(alpha: float, k: float) -> float:
    """(1 - alpha^(k+1)) / (1 - alpha): tokens per verification pass when each drafted
    token is accepted independently with probability alpha."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1.0)) / (1.0 - alpha)


def speedup(speculative_tokens_per_second: float | None, plain_tokens_per_second: float | None) -> float | None:
    """Speculative tokens/s over plain tokens/s: the speed-up every surface reports."""
    if not plain_tokens_per_second or speculative_tokens_per_second is None:
        return None
    return speculative_tokens_per_second / plain_tokens_per_second


@dataclass
class GenerationStats:
    """Figures for one or more generations. Feed it every event with `observe`."""

    prompt_tokens: int = 0
    reused_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    fed: int = 0  # tokens fed to the target's verification passes
    tree_steps: int = 0
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    first_token_seconds: float | None = None
    provenance: dict[str, int] = field(default_factory=lambda: {p.value: 0 for p in Provenance})
    # drafted_at[i]: steps that drafted a token at position i; accepted_at[i]: and kept it.
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    passes: Counter[int] = field(default_factory=Counter)  # verification passes by tokens fed
    methods: Counter[str] = field(default_factory=Counter)  # steps by how they drafted (StepEvent.method)
    finish_reason: str | None = None
    _started: float | None = field(default=None, repr=False)

    def add(self, other: "GenerationStats") -> None:
        """Fold another generation's counts and times into these (for pooled rates).
        Per-generation figures (time to first token, finish reason) are not pooled."""
        self.prompt_tokens += other.prompt_tokens
        self.reused_tokens += other.reused_tokens
        self.new_tokens += other.new_tokens
        self.steps += other.steps
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.fed += other.fed
        self.tree_steps += other.tree_steps
        self.prefill_seconds += other.prefill_seconds
        self.draft_seconds += other.draft_seconds
        self.verify_seconds += other.verify_seconds
        self.total_seconds += other.total_seconds
        for name, count in other.provenance.items():
            self.provenance[name] = self.provenance.get(name, 0) + count
        while len(self.drafted_at) < len(other.drafted_at):
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for position, (drafted, accepted) in enumerate(zip(other.drafted_at, other.accepted_at)):
            self.drafted_at[position] += drafted
            self.accepted_at[position] += accepted
        self.passes.update(other.passes)
        self.methods.update(other.methods)

    @classmethod
    def pooled(cls, generations: Iterable["GenerationStats"]) -> "GenerationStats":
        """Several generations' figures summed into one."""
        total = cls()
        for stats in generations:
            total.add(stats)
        return total

    def start(self) -> None:
        """Mark the moment the request began (for time to first token)."""
        self._started = time.perf_counter()

    def observe(self, event: Event) -> None:
        if isinstance(event, PrefillEvent):
            self.prompt_tokens += event.prompt_tokens
            self.reused_tokens += event.reused_tokens
            self.prefill_seconds += event.seconds
        elif isinstance(event, TokenEvent):
            self.new_tokens += 1
            self.provenance[event.provenance.value] += 1
            if self.first_token_seconds is None and self._started is not None:
                self.first_token_seconds = time.perf_counter() - self._started
        elif isinstance(event, StepEvent):
            self.steps += 1
            self.drafted += event.drafted
            self.accepted += event.accepted
            self.fed += event.fed
            self.passes[event.fed] += 1
            self.methods[event.method] += 1
            self.tree_steps += event.tree
            self.draft_seconds += event.draft_seconds
            self.verify_seconds += event.verify_seconds
            while len(self.drafted_at) < event.drafted:
                self.drafted_at.append(0)
                self.accepted_at.append(0)
            for position in range(event.drafted):
                self.drafted_at[position] += 1
                self.accepted_at[position] += position < event.accepted
        elif isinstance(event, FinishEvent):
            self.total_seconds += event.seconds
            self.finish_reason = event.reason.value

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def tokens_per_step(self) -> float | None:
        return self.new_tokens / self.steps if self.steps else None

    @property
    def mean_pass_size(self) -> float | None:
        """Tokens per verification pass: drafted + 1 for chains, nodes + 1 for trees."""
        return self.fed / self.steps if self.steps else None

    @property
    def mean_draft_length(self) -> float | None:
        return self.drafted / self.steps if self.steps else None

    @property
    def predicted_tokens_per_step(self) -> float | None:
        if self.acceptance_rate is None or self.mean_draft_length is None:
            return None
        return expected_tokens_per_step(self.acceptance_rate, self.mean_draft_length)

    @property
    def decode_seconds(self) -> float:
        return self.draft_seconds + self.verify_seconds

    @property
    def tokens_per_second(self) -> float | None:
        """Generated tokens over the time spent decoding them (prefill excluded)."""
        return self.new_tokens / self.decode_seconds if self.decode_seconds > 0 else None

    def as_dict(self) -> dict:
        def rounded(value: float | None, digits: int = 4) -> float | None:
            return None if value is None else round(value, digits)

        return {
            "prompt_tokens": self.prompt_tokens,
            "reused_prompt_tokens": self.reused_tokens,
            "new_tokens": self.new_tokens,
            "steps": self.steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": rounded(self.acceptance_rate),
            "acceptance_by_position": [round(x, 4) for x in self.acceptance_by_position],
            "tokens_per_step": rounded(self.tokens_per_step),
            "predicted_tokens_per_step": rounded(self.predicted_tokens_per_step),
            "mean_draft_length": rounded(self.mean_draft_length),
            "mean_pass_size": rounded(self.mean_pass_size),
            "tree_steps": self.tree_steps,
            "steps_by_method": dict(self.methods.most_common()),
            "provenance": dict(self.provenance),
            "prefill_seconds": rounded(self.prefill_seconds),
            "draft_seconds": rounded(self.draft_seconds),
            "verify_seconds": rounded(self.verify_seconds),
            "total_seconds": rounded(self.total_seconds),
            "time_to_first_token_seconds": rounded(self.first_token_seconds),
            "tokens_per_second": rounded(self.tokens_per_second, 3),
            "finish_reason": self.finish_reason,
        }
