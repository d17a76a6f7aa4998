"""A simulator for draft-length policies (the policy is pure: it sees only step events).

A machine is a cost curve: seconds of one verification pass by tokens fed, and seconds
per draft token. A text is a sequence of per-position outcomes: whether the draft
guesses the target's token at that position (drawn with a seeded RNG, i.i.d. with an
acceptance alpha that may change along the text). A step at text position t that drafts
k tokens accepts the run of right guesses from t on, at most k, and then adds the
target's own token (the resampled or bonus one): tokens = accepted + 1, and the next step
starts after them. Simulated time is the sum of the step costs. Every policy runs over the
same text, so they are compared on the same outcomes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Sequence

from speccli.autok.policy import AdaptiveDraftLength, DraftLengthPolicy, FixedDraftLength
from speccli.events import StepEvent


@dataclass(frozen=True)
class Curve:
    name: str
    points: dict[int, float]  # tokens fed -> seconds of one verification pass
    draft: float  # seconds per draft token

    def verify(self, fed: int) -> float:
        """Linear between the given points, and past the last along the last segment."""
        sizes = sorted(self.points)
        if fed in self.points:
            return self.points[fed]
        below = [n for n in sizes if n < fed]
        above = [n for n in sizes if n > fed]
        if below and above:
            lo, hi = below[-1], above[0]
        else:
            lo, hi = (sizes[-2], sizes[-1]) if len(sizes) > 1 else (sizes[0], sizes[0])
        if lo == hi:
            return self.points[lo]
        slope = (self.points[hi] - self.points[lo]) / (hi - lo)
        return self.points[lo] + slope * (fed - lo)

    def profile(self, max_fed: int) -> dict[int, float]:
        """What a calibration up to max_fed tokens would measure."""
        return {fed: self.verify(fed) for fed in range(1, max_fed + 1)}

    def step_seconds(self, k: int) -> float:
        return self.verify(k + 1) + k * self.draft


def text(alphas: Sequence[tuple[int, float]], seed: int) -> list[bool]:
    """Per-position outcomes: (length, alpha) segments, i.i.d. within each."""
    rng = random.Random(seed)
    return [rng.random() < alpha for length, alpha in alphas for _ in range(length)]


@dataclass
class Run:
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    drafted: int = 0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def simulate(policy: DraftLengthPolicy, curve: Curve, outcomes: Sequence[bool], noise: float = 0.0) -> Run:
    """Run a policy over a text. `noise`: each step's seconds vary by this relative
    standard deviation (seeded), as measured passes do."""
    run = Run()
    position = 0
    rng = random.Random(1234)
    while position < len(outcomes):
        k = policy.next_k()
        accepted = 0
        while accepted < k and position + accepted < len(outcomes) and outcomes[position + accepted]:
            accepted += 1
        jitter = max(0.5, 1 + rng.gauss(0, noise)) if noise else 1.0
        draft_seconds = k * curve.draft * jitter
        verify_seconds = curve.verify(k + 1) * jitter
        run.steps += 1
        run.drafted += k
        run.tokens += accepted + 1
        run.seconds += draft_seconds + verify_seconds
        position += accepted + 1
        policy.observe(StepEvent(run.steps, k, accepted, draft_seconds, verify_seconds))
    return run


def best_fixed(curve: Curve, outcomes: Sequence[bool], max_k: int) -> tuple[int, Run]:
    """The fixed k (0, plain decoding, included) that was fastest over this text."""
    runs = {k: simulate(FixedDraftLength(k), curve, outcomes) for k in range(max_k + 1)}
    k = max(runs, key=lambda k: runs[k].rate)
    return k, runs[k]


def calibrated_policy(curve: Curve, max_k: int, **kwargs) -> AdaptiveDraftLength:
    """The adaptive policy as the decoder builds it: seeded with the calibrated curve."""
    policy = AdaptiveDraftLength(max_k=max_k, **kwargs)
    policy.costs.seed(curve.profile(max_k + 1), curve.draft)
    return policy


MS = 1e-3
CURVES = {
    # bfloat16 with matrix units: a pass costs the same for 1 to 17 tokens.
    "flat": Curve("flat", {1: 170 * MS, 17: 170 * MS}, 25 * MS),
    # float32 with stock kernels: a step at 4 fed, then growing.
    "linear": Curve("linear", {1: 211 * MS, 2: 219 * MS, 3: 221 * MS, 4: 409 * MS, 6: 427 * MS, 8: 570 * MS}, 42 * MS),
    # issue 15: 404 ms for 1 token, 1003 for 2, then flat.
    "jump": Curve(
        "jump",
        {
            1: 404 * MS,
            2: 1003 * MS,
            3: 1120 * MS,
            4: 1170 * MS,
            5: 1180 * MS,
            6: 990 * MS,
            7: 1020 * MS,
            8: 970 * MS,
            9: 1020 * MS,
            17: 1020 * MS,
        },
        79 * MS,
    ),
    # a GPU with CUDA graphs: 7.6 ms for 1 token, 8.8 for 16.
    "gpu": Curve("gpu", {1: 7.6 * MS, 16: 8.8 * MS}, 3.0 * MS),
}

HALF = 1000
ACCEPTANCE = {
    "high": [(2 * HALF, 0.85)],
    "low": [(2 * HALF, 0.15)],
    "very low": [(2 * HALF, 0.1)],
    "high then low": [(HALF, 0.85), (HALF, 0.15)],
    "low then high": [(HALF, 0.15), (HALF, 0.85)],
}


def compare(curve: Curve, alphas, seed: int = 0, max_k: int = 16, make: Callable | None = None, noise: float = 0.0):
    """The adaptive policy against the best fixed k in hindsight on one text."""
    outcomes = text(alphas, seed)
    k, fixed = best_fixed(curve, outcomes, max_k)
    policy = (make or calibrated_policy)(curve, max_k)
    adaptive = simulate(policy, curve, outcomes, noise)
    return adaptive, k, fixed
