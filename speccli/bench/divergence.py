"""Where two greedy outputs part, and whether rounding explains it.

Greedy speculative decoding emits the target's own argmax at every position, so in exact
arithmetic its output equals plain decoding's. In bfloat16 or float16 it need not: a pass
over k + 1 tokens and a pass over one round differently, so where the target's two best
logits are within rounding of each other either may win. Such a divergence is a *near-tie*;
one at a wider gap is a *mismatch*, a real fault.

The tolerance is derived from the compute dtype, not tuned. A dtype with machine epsilon eps
holds a value x to one unit in the last place, ulp(x) = eps * 2**floor(log2|x|). Each of the
two runs rounds each of the two logits to within half an ulp of the exact value, so the two
logits can swap order between the runs only when they lie within 4 * 1/2 = 2 ulps of each other
(at the larger magnitude). Float32 is the reference: there any divergence is a mismatch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

# Two runs, two logits, half an ulp each (see the module's docstring).
NEAR_TIE_ULPS = 2.0

NEAR_TIE = "near-tie"
MISMATCH = "mismatch"


def ulp(value: float, dtype: torch.dtype) -> float:
    """One unit in the last place of `dtype` at the magnitude of `value`."""
    magnitude = abs(value)
    if magnitude == 0 or not math.isfinite(magnitude):
        return torch.finfo(dtype).tiny
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(magnitude))


def near_tie_tolerance(a: float, b: float, dtype: torch.dtype) -> float:
    """The widest gap between logits a and b that rounding in `dtype` can reverse (0 in float32
    and float64: the reference precisions, where a divergence is always a fault)."""
    if torch.finfo(dtype).bits >= 32:
        return 0.0
    return NEAR_TIE_ULPS * ulp(max(abs(a), abs(b)), dtype)


@dataclass(frozen=True)
class Divergence:
    """The first new token where a greedy speculative run left plain decoding.

    `plain_token` / `spec_token` are the ids each run emitted there (None: that run had ended;
    the end-of-sequence id it chose stands in when it ended by one, see `choice_logits`).
    `gap` is the difference of the target's logits for the two choices, re-scored over the
    common prefix (None when it could not be scored); `tolerance` the widest gap rounding in
    `dtype` explains.
    """

    position: int
    plain_token: int | None
    spec_token: int | None
    gap: float | None
    tolerance: float
    dtype: str

    @property
    def near_tie(self) -> bool:
        # A zero tolerance (float32) makes every divergence a mismatch, a zero gap included.
        return self.gap is not None and self.tolerance > 0 and self.gap <= self.tolerance

    @property
    def kind(self) -> str:
        return NEAR_TIE if self.near_tie else MISMATCH

    def describe(self) -> str:
        """`near-tie at token 14 (gap 0.000, bfloat16)` or `MISMATCH at token 14 (gap 1.300)`."""
        if self.gap is None:
            return f"MISMATCH at token {self.position} ({self._tokens()}, not scored)"
        if self.near_tie:
            return f"near-tie at token {self.position} (gap {self.gap:.3f}, {self.dtype})"
        return f"MISMATCH at token {self.position} (gap {self.gap:.3f}; {self._tokens()})"

    def _tokens(self) -> str:
        def shown(token: int | None) -> str:
            return "ended" if token is None else f"id {token}"

        return f"plain {shown(self.plain_token)}, speculative {shown(self.spec_token)}"

    def as_dict(self) -> dict:
        return {
            "kind": self.kind,
            "position": self.position,
            "plain_token": self.plain_token,
            "speculative_token": self.spec_token,
            "gap": None if self.gap is None else round(self.gap, 6),
            "tolerance": round(self.tolerance, 6),
            "dtype": self.dtype,
        }


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two token lists differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def choice_logit(logits: torch.Tensor, token: int | None, ended_by: Sequence[int]) -> float | None:
    """The target's logit for what a run did at a position: the token it emitted, or, where it
    ended there by end-of-sequence, the best of the end-of-sequence ids. None: neither."""
    if token is not None:
        return float(logits[token])
    if ended_by:
        return float(logits[list(ended_by)].max())
    return None


def classify(
    position: int,
    plain: Sequence[int],
    spec: Sequence[int],
    logits: torch.Tensor | None,
    dtype: torch.dtype,
    plain_ended_by: Sequence[int] = (),
    spec_ended_by: Sequence[int] = (),
) -> Divergence:
    """Classify the divergence at `position` from the target's logits there ([V], scored over
    the prompt and the common prefix; None when they could not be had). `*_ended_by` are the
    end-of-sequence ids, for a run that ended at `position` by one (else empty)."""
    plain_token = plain[position] if position < len(plain) else None
    spec_token = spec[position] if position < len(spec) else None
    gap = None
    tolerance = 0.0
    if logits is not None:
        a = choice_logit(logits, plain_token, plain_ended_by)
        b = choice_logit(logits, spec_token, spec_ended_by)
        if a is not None and b is not None:
            gap = abs(a - b)
            tolerance = near_tie_tolerance(a, b, dtype)
    return Divergence(position, plain_token, spec_token, gap, tolerance, str(dtype).removeprefix("torch."))
