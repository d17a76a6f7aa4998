"""A short upfront measurement of what one verification pass and one draft token cost.

The adaptive draft length weighs expected tokens against seconds. Learning the seconds
online means paying for every untried draft length once, in every new session; on a
machine where a pass over several tokens costs several times a pass over one (float32
on a CPU), that exploration alone loses to plain decoding. So the costs are measured
once per target and device (a minute or two on a CPU; a draft model's token once per draft
model and device), cached, and seed the policy, which then brings them to the machine's
present speed from the steps it runs.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from speccli.backends.base import CausalLM

CONTEXT_TOKENS = 64  # a typical prompt's worth of cache: attention cost is part of a pass
# A calibration whose passes cost this many times what a session's own passes of the same
# size took (their median) was measured on a busier machine than this one now is.
OVERSTATED_BY = 1.5
MIN_PASSES = 8  # passes of one size before their median is trusted against a calibration
# Rounds of the curve after the warm-up. With few rounds, calibrations run one after another
# disagree widely on what a pass over many tokens costs against one; more rounds narrow that
# spread. Lookahead's shape turns on such ratios: a calibration that put a window's pass too
# cheap chose a window that ran no faster than `--draft ngram`. The rounds are paid once per
# target and device (the calibration is cached).
ROUNDS = 8


@dataclass(frozen=True)
class CostCurve:
    """What specgen knows of this machine's costs: seconds of one target pass by number of
    tokens fed, and of one draft token (None when drafting costs no model pass).

    Measured by `measure_costs` (a calibration), stored by speccli.calibration, updated
    online by the policies' StepCosts, and read between the sizes measured in one of three
    ways, each for its reader:

    * `interpolated`: the best estimate, for modelling what a run's passes cost;
    * `optimistic`: an untried size guessed as cheap as the largest smaller one, so that a
      size that could pay gets tried and measured (k auto, token trees);
    * `cautious`: the cheapest measured pass over as many tokens or more, nothing past the
      largest (lookahead, whose shape must not rest on one noisy measurement).
    """

    verify_seconds: dict[int, float]
    draft_seconds: float | None

    def as_dict(self) -> dict:
        return {
            "verify_seconds": {str(fed): seconds for fed, seconds in sorted(self.verify_seconds.items())},
            "draft_seconds": self.draft_seconds,
        }

    @property
    def largest(self) -> int:
        """The largest pass measured (0 when none was)."""
        return max(self.verify_seconds, default=0)

    def measured(self, fed: int) -> float | None:
        return self.verify_seconds.get(fed)

    def interpolated(self, fed: int) -> float:
        """A pass over `fed` tokens: measured, else interpolated between the nearest sizes
        measured, or past the largest continued at the slope of the curve's upper half."""
        if fed in self.verify_seconds:
            return self.verify_seconds[fed]
        sizes = sorted(self.verify_seconds)
        below = [n for n in sizes if n < fed]
        above = [n for n in sizes if n > fed]
        if below and above:
            lo, hi = below[-1], above[0]
            share = (fed - lo) / (hi - lo)
            return self.verify_seconds[lo] + share * (self.verify_seconds[hi] - self.verify_seconds[lo])
        if above:
            return self.verify_seconds[above[0]] * fed / above[0]
        largest, middle = sizes[-1], sizes[len(sizes) // 2]
        slope = (
            0.0
            if middle == largest
            else (self.verify_seconds[largest] - self.verify_seconds[middle]) / (largest - middle)
        )
        return self.verify_seconds[largest] + max(0.0, slope) * (fed - largest)

    def optimistic(self, fed: int) -> float | None:
        """Measured, else an optimistic guess, so that an untried size that could pay is
        tried once and measured. Feeding more tokens never costs less, so the guess is
        the cost of the largest measured smaller size; below the smallest measured size,
        a cost proportional to the tokens fed. None when nothing was measured."""
        if not self.verify_seconds:
            return None
        if fed in self.verify_seconds:
            return self.verify_seconds[fed]
        below = [n for n in self.verify_seconds if n < fed]
        if below:
            return self.verify_seconds[max(below)]
        smallest = min(self.verify_seconds)
        return self.verify_seconds[smallest] * fed / smallest

    def cautious(self, fed: int) -> float | None:
        """The cheapest measured pass over as many tokens or more (a pass over more tokens is
        no cheaper; one measurement's noise is not trusted over a larger pass's); None when
        nothing that large was measured."""
        measured = [seconds for size, seconds in self.verify_seconds.items() if size >= fed]
        return min(measured) if measured else None

    def step_seconds(self, k: int) -> float | None:
        """A step that drafts k tokens and verifies them (optimistic pass cost)."""
        verify = self.optimistic(k + 1)
        if verify is None:
            return None
        return verify + k * (self.draft_seconds or 0.0)

    def filled(self, up_to: int) -> CostCurve:
        """This curve with every size 1..up_to priced (optimistically where unmeasured); a
        curve with nothing measured has nothing to price them by (none is priced)."""
        priced = {fed: self.optimistic(fed) for fed in range(1, up_to + 1)}
        return CostCurve({fed: seconds for fed, seconds in priced.items() if seconds is not None}, self.draft_seconds)

    def modelled_seconds(self, passes: dict[int, int]) -> float:
        """What passes of these sizes (tokens fed: count) cost by this curve: a timing free
        of the noise of the moment they ran in, for methods whose cost is their target passes."""
        return sum(count * self.interpolated(fed) for fed, count in passes.items())

    @classmethod
    def from_dict(cls, data: dict) -> CostCurve:
        verify = {int(fed): float(seconds) for fed, seconds in data["verify_seconds"].items()}
        if not verify or any(fed < 1 or seconds <= 0 for fed, seconds in verify.items()):
            raise ValueError("verify_seconds needs positive seconds for sizes >= 1")
        draft = data.get("draft_seconds")
        if draft is not None and float(draft) <= 0:
            raise ValueError("draft_seconds must be positive")
        return cls(verify, None if draft is None else float(draft))


@dataclass(frozen=True)
class Overstatement:
    """A calibration that says passes cost more than a session measured them: `fed` tokens
    per pass, the calibration's seconds and the median of the session's passes."""

    fed: int
    calibrated_seconds: float
    measured_seconds: float

    @property
    def ratio(self) -> float:
        return self.calibrated_seconds / self.measured_seconds


@dataclass
class PassTimes:
    """The seconds of the target passes a session ran, by tokens fed (the latest few of
    each size), to tell whether a cached calibration still describes the machine. Noise only
    ever adds time, so only one direction says something: passes that ran well below what
    the calibration says mean it was measured while something else used the machine (seen:
    a calibration taken while the test suite ran, three times the quiet costs, kept lookahead
    on 17-token passes where the quiet curve means plain decoding)."""

    keep: int = 64
    seconds: dict[int, deque] = field(default_factory=dict)

    def record(self, fed: int, seconds: float) -> None:
        self.seconds.setdefault(fed, deque(maxlen=self.keep)).append(seconds)

    def overstatement(self, costs: CostCurve, min_passes: int = MIN_PASSES) -> Overstatement | None:
        """The size whose calibrated cost most exceeds the median of this session's passes,
        when by more than OVERSTATED_BY; None when the calibration holds (or too few passes
        of any measured size ran to tell)."""
        worst: Overstatement | None = None
        for fed, times in self.seconds.items():
            if len(times) < min_passes or fed not in costs.verify_seconds:
                continue
            found = Overstatement(fed, costs.verify_seconds[fed], statistics.median(times))
            if found.measured_seconds > 0 and (worst is None or found.ratio > worst.ratio):
                worst = found
        return worst if worst is not None and worst.ratio > OVERSTATED_BY else None


def filler_ids(vocab_size: int, count: int) -> list[int]:
    # Which ids are fed does not change what a pass costs; spread them over the vocabulary.
    return [(7919 * i + 11) % vocab_size for i in range(count)]


def _wait_for(model: CausalLM) -> None:
    """CUDA runs a pass asynchronously: wait for it to finish before reading the clock (the
    decoder's own steps wait anyway, when they read the logits)."""
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def _seconds(model: CausalLM, settled: int, tokens: Sequence[int]) -> float:
    started = time.perf_counter()
    model.forward(tokens, all_logits=len(tokens) > 1)
    _wait_for(model)
    seconds = time.perf_counter() - started
    model.rollback(settled)
    return seconds


def measure_costs(
    target: CausalLM,
    draft: CausalLM | None,
    max_fed: int,
    repeats: int = ROUNDS,
    context_tokens: int = CONTEXT_TOKENS,
    sizes: Sequence[int] | None = None,
    on_round: Callable[[int, int], None] | None = None,
) -> CostCurve:
    """Time target passes over 1..max_fed new tokens (or over `sizes`, each at most max_fed)
    and a one-token draft pass, each on top of `context_tokens` cached tokens, in `repeats`
    rounds after a round that warms the kernels for each shape. Both caches are empty afterwards.

    Each size is timed right after a one-token pass, and what it costs is its median ratio
    to that pass over the rounds, times the fastest one-token pass: the curve's shape from
    pairs measured a moment apart, its level from the quietest moment. A pass's cost on a
    shared machine drifts within seconds, and more for one token than for many, so the
    fastest round of each size taken alone pairs moments that never met and misjudges the
    curve's shape, enough for lookahead to choose a window slower than plain decoding
    (measured: BENCHMARKS.md, section "Levers tried and not kept"). Each round times the sizes
    in the opposite order to the round before, so a spell spoils some sizes of one round,
    not every measurement of one.

    `on_round(done, repeats)` is called after each round: done 0 after the warm-up."""
    if max_fed < 1 or repeats < 1:
        raise ValueError(f"need max_fed >= 1 and repeats >= 1, got {max_fed}, {repeats}")
    sizes = range(1, max_fed + 1) if sizes is None else sorted(set(sizes))
    if not sizes or sizes[0] < 1 or sizes[-1] > max_fed:
        raise ValueError(f"sizes must lie in 1..{max_fed}, got {list(sizes)}")
    context = filler_ids(target.vocab_size, context_tokens + max_fed)
    prompt, fed_tokens = context[:context_tokens], context[context_tokens:]
    try:
        target.rollback(0)
        target.forward(prompt, all_logits=False)
        singles: list[float] = []
        ratios: dict[int, list[float]] = {fed: [] for fed in sizes}
        for round_index in range(repeats + 1):
            for fed in sizes if round_index % 2 == 0 else reversed(sizes):
                single = _seconds(target, len(prompt), fed_tokens[:1])
                seconds = single if fed == 1 else _seconds(target, len(prompt), fed_tokens[:fed])
                if round_index > 0:  # the first round only warms up
                    singles.append(single)
                    ratios[fed].append(seconds / single)
            if on_round is not None:
                on_round(round_index, repeats)
        fastest = min(singles)
        verify = {fed: fastest * statistics.median(ratios[fed]) for fed in sizes}
    finally:
        target.rollback(0)
    draft_seconds = None if draft is None else measure_draft_seconds(draft, repeats, context_tokens)
    return CostCurve(verify, draft_seconds)


def measure_draft_seconds(draft: CausalLM, repeats: int = ROUNDS, context_tokens: int = CONTEXT_TOKENS) -> float:
    """One draft token on top of `context_tokens` cached tokens: the fastest of `repeats`
    passes after one that warms the kernels. The draft's cache is empty afterwards."""
    # The draft's own ids: the target may know ids the draft's embedding has no row for.
    draft_context = filler_ids(draft.vocab_size, context_tokens + 1)
    try:
        draft.rollback(0)
        draft.forward(draft_context[:-1], all_logits=False)
        times = [_seconds(draft, context_tokens, draft_context[-1:]) for _ in range(repeats + 1)]
    finally:
        draft.rollback(0)
    return min(times[1:])
