"""k auto for lookahead decoding (speccli.drafters.lookahead): its shape, and the steps its
window and pool ride in.

W, N and G (n-grams verified) are chosen from the measured pass costs: the shape whose steps
promise the most tokens per second beside prompt lookup's guess. Where none beats a one-token
pass the steps are prompt lookup's with its own k auto (`--draft ngram`): chains where the text
repeats itself, plain steps where it does not. With k auto the steps start as those too, and
`LookaheadGate` adds the window to a step where what it brought riding every step pays for its
tokens, and the pool's n-grams where what they have been adding pays for theirs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from speccli.autok.costs import CostCurve
from speccli.autok.plan import DraftSignal, LookaheadPlan, StepPlan
from speccli.autok.policy import AdaptiveDraftLength, DraftLengthByMatch, DraftLengthPolicy, FixedDraftLength
from speccli.events import StepEvent


@dataclass(frozen=True)
class LookaheadShape:
    window: int  # W: columns of the Jacobi window
    ngram: int  # N: tokens per n-gram (the window holds N - 1 levels)
    guesses: int  # G: pool n-grams verified per step

    @property
    def fed(self) -> int:
        """Tokens in one pass at most: the pending token, the window, the guesses."""
        return 1 + (self.window + self.guesses) * (self.ngram - 1)


# Largest first. The paper's GPU settings are larger (W 15, N 5, G 15); these fit the
# passes a CPU calibration measures (up to 17 tokens) and a GPU's flat region alike.
SHAPES = (
    LookaheadShape(10, 4, 6),  # 49 tokens
    LookaheadShape(7, 4, 4),  # 34
    LookaheadShape(5, 4, 3),  # 25
    LookaheadShape(5, 3, 3),  # 17
    LookaheadShape(4, 3, 2),  # 13
    LookaheadShape(3, 3, 2),  # 11
    LookaheadShape(2, 3, 1),  # 7
    LookaheadShape(2, 2, 1),  # 4
    LookaheadShape(1, 2, 1),  # 3: a window of one token, a pool of the target's 2-grams
)
DEFAULT_SHAPE = LookaheadShape(5, 3, 3)
# What the window's and the pool's n-grams add to a step beyond prompt lookup's guess in the
# same tree, in extra tokens accepted, by the tokens in its pass: a prior (what comes true
# depends on the text), which LookaheadGate replaces with what it measures. Set from
# lookahead's steps over the default prompts, where the gain grew by about the same amount
# with each doubling of the tokens in a pass (the paper's much larger GPU shape gains more
# still): from 7 tokens up, a line in log2(tokens). Tokens per step of lookahead against
# prompt lookup: BENCHMARKS.md, sections "2-core AMD EPYC, AVX512-BF16, no AMX" and "2-core
# Intel Xeon with AMX".
WINDOW_GAIN_AT_7_TOKENS = 0.14
GAIN_PER_DOUBLING = 0.20
# Below 7 tokens the line says nothing is gained, yet the smallest shapes, forced on every
# step beside prompt lookup's guess, made this many more tokens a step than prompt lookup's
# own steps (median over the default prompts in bfloat16), by tokens in a pass: 3 (W 1, N 2,
# G 1) and 4 (W 2, N 2, G 1). Their passes are mostly 2-3 tokens (the pool is often empty),
# which where bfloat16 is native cost about what one token does (measured: BENCHMARKS.md,
# section "2-core AMD EPYC, AVX512-BF16, no AMX").
SMALL_WINDOW_GAIN = {3: 0.08, 4: 0.11}


def choose_shape(costs: CostCurve | None) -> LookaheadShape | None:
    """The shape whose steps promise the most tokens per second beside prompt lookup's: at
    a step where prompt lookup guesses nothing (the commonest, on most text), (1 +
    window_gain) / its pass's cost, from measured costs: small shapes where a pass grows
    with its tokens, large ones where passes are nearly flat. None (prompt lookup's steps
    alone) when no shape promises more than a one-token pass; the default without
    measurements. LookaheadGate then takes the chosen shape's steps where they pay.

    A one-token pass is priced as LookaheadGate prices it (no dearer than any larger pass),
    so a chosen shape's window rides where prompt lookup guesses nothing (docs/k-auto.md,
    "Why it is built this way")."""
    if costs is None or costs.measured(1) is None:
        return DEFAULT_SHAPE
    one_token = costs.cautious(1)
    assert one_token is not None  # a one-token pass was measured
    best, best_rate = None, 1 / one_token
    for shape in SHAPES:
        cost = costs.cautious(shape.fed)
        if cost is None:
            continue  # larger than anything measured: unknown, not assumed cheap
        rate = (1 + window_gain(shape.fed)) / cost
        if rate > best_rate:
            best, best_rate = shape, rate
    return best


def window_gain(fed: int) -> float:
    """Extra tokens a lookahead step over `fed` tokens is expected to accept beyond prompt
    lookup's guess in it (the prior above)."""
    if fed in SMALL_WINDOW_GAIN:
        return SMALL_WINDOW_GAIN[fed]
    return max(0.0, WINDOW_GAIN_AT_7_TOKENS + GAIN_PER_DOUBLING * math.log2(fed / 7))


class LookaheadGate(DraftLengthPolicy):
    """k auto for lookahead decoding: prompt lookup's k auto, with the lookahead branch and
    the pool's n-grams beside its guess in the steps where they pay.

    Each step starts as `--draft ngram`'s: the `meanwhile` policy (prompt lookup's k auto)
    chooses how long a guess of the text's own continuation to draft, and expects `e`
    tokens from it. Beside that guess the step may carry the window (`window_step`: its
    W x (N - 1) tokens ride along) and offer the pool's n-grams that start with the pending
    token (`pool_step`: N - 1 tokens each, as many as `offer` said there are, up to G), each
    where it pays on the measured cost curve:

    - The window brings nothing in the step that carries it: its n-grams pay in later
      steps, from the pool. So it is judged by what the window and the pool were measured
      to bring when the window rode every step, `window_value` (the prior, `window_gain`):
      (e + window_value) / cost(fed + window) > e / cost(fed).
    - The pool's n-grams pay in the step that offers them: what they added beyond the
      guess, `gain` tokens per step that offered some (each step says how many of its
      accepted tokens the guess alone had), pays for their tokens:
      (e + gain) / cost(fed + window + pool) > e / cost(fed + window).

    So lookahead's steps are prompt lookup's where the window and the pool cost more than
    they bring (a CPU whose passes grow with the tokens fed), and carry more where tokens
    are nearly free (a GPU with graphs, a CPU with bfloat16 matrix units). Why these two
    comparisons and not others: docs/k-auto.md, "Why it is built this way".

    While the pool is not offered its gain is not measured: after `probe_every` steps that
    could have offered some (doubled after each probe after which it still did not pay, up
    to `max_backoff` doublings) a run of `probe_steps` steps offers it again. The gain is a
    mean over the steps that offered it that forgets (`forgetting` a step), starting from
    `prior_gain` worth `prior_steps` steps.

    Both sides are priced by one curve, `curve` (the calibration's, read cautiously; its
    level does not change which side pays). No pass cost known: every step carries the window and the pool.
    """

    def __init__(
        self,
        shape: LookaheadShape,
        meanwhile: AdaptiveDraftLength | DraftLengthByMatch,
        curve: CostCurve | None = None,
        prior_gain: float | None = None,
        prior_steps: float = 4.0,
        forgetting: float = 0.95,
        probe_every: int = 16,
        probe_steps: int | None = None,
        max_backoff: int = 3,
        window_value: float | None = None,
    ) -> None:
        if (
            prior_gain is not None
            and prior_gain < 0
            or window_value is not None
            and window_value < 0
            or prior_steps <= 0
            or probe_every < 1
        ):
            raise ValueError(
                "need prior_gain >= 0, window_value >= 0, prior_steps > 0 and probe_every >= 1, "
                f"got {prior_gain}, {window_value}, {prior_steps}, {probe_every}"
            )
        self.shape = shape
        self.meanwhile = meanwhile
        self.curve = curve
        self.extra = (shape.window + shape.guesses) * (shape.ngram - 1)
        self.window_tokens = shape.window * (shape.ngram - 1)
        self.window_value = window_gain(shape.fed) if window_value is None else window_value
        self.prior_gain = window_gain(shape.fed) if prior_gain is None else prior_gain
        self.prior_steps = prior_steps
        self.forgetting = forgetting
        self.probe_every = probe_every
        self.probe_steps = probe_steps if probe_steps is not None else 2 * (shape.ngram - 1)
        self.max_backoff = max_backoff
        self.guess_length = 0  # prompt lookup's guess in the coming step
        self.window_step = True  # whether the window rides along the coming step
        self.pool_step = True  # whether it offers the pool's n-grams
        self._candidates = shape.guesses  # the pool's n-grams that start with the pending token
        self._gain_sum = 0.0
        self._gain_steps = 0.0
        self._steps_off = 0  # steps that could have offered the pool since the last that did
        self._probe_left = 0  # steps left in a probe run
        self._judging_probe = False  # the next decision says whether the probe paid
        self._failed_probes = 0

    @property
    def lookahead_step(self) -> bool:
        """Whether the coming step is lookahead's (a tree step with the window, the pool or
        both), not prompt lookup's own."""
        return self.window_step or self.pool_step

    @property
    def gain(self) -> float:
        """Extra tokens a step that offers the pool's n-grams brings beyond prompt lookup's guess in it."""
        return (self._gain_sum + self.prior_gain * self.prior_steps) / (self._gain_steps + self.prior_steps)

    def cut(self, guess_length: int, extra: int | None = None) -> int:
        """How much of a guess fits beside `extra` more tokens (by default the window and the
        whole pool) in the largest pass measured (no pass goes past the calibration)."""
        if self.curve is None or not self.curve.verify_seconds:
            return guess_length
        extra = self.extra if extra is None else extra
        return max(0, min(guess_length, self.curve.largest - 1 - extra))

    def _rate(self, guess_length: int, extra: int, more: float = 0.0) -> float:
        """Tokens per second of a step carrying as much of a guess as fits beside `extra`
        tokens and bringing `more` tokens beyond it."""
        assert self.curve is not None, "priced only with measured costs (window_pays, pool_pays)"
        carried = self.cut(guess_length, extra)
        cost = self.curve.cautious(carried + 1 + extra)
        assert cost is not None, "a pass no larger than the largest measured (the shape is choose_shape's)"
        return (self.meanwhile.expected(carried) + more) / cost

    def window_pays(self, guess_length: int) -> bool:
        """Whether the window, worth `window_value` tokens a step, pays for its tokens beside
        the guess (True without measured costs)."""
        if self.curve is None or not self.curve.verify_seconds:
            return True
        return self._rate(guess_length, self.window_tokens, self.window_value) > self._rate(guess_length, 0)

    def pool_pays(self, guess_length: int, window: bool, candidates: int | None = None) -> bool:
        """Whether `candidates` of the pool's n-grams (by default G), worth `gain` tokens,
        pay for their tokens beside the guess (and the window, where it rides)."""
        candidates = self.shape.guesses if candidates is None else candidates
        if candidates <= 0:
            return False
        if self.curve is None or not self.curve.verify_seconds:
            return True
        base = self.window_tokens if window else 0
        offered = self._rate(guess_length, base + candidates * (self.shape.ngram - 1), self.gain)
        return offered > self._rate(guess_length, base)

    def offer(self, candidates: int) -> None:
        """How many of the pool's n-grams start with the pending token, for the coming step."""
        self._candidates = candidates

    def next_k(self) -> int:
        wanted = self.meanwhile.next_k()
        window = self.window_pays(wanted)
        candidates = min(self._candidates, self.shape.guesses)
        if candidates == 0:
            pool = False  # nothing to offer, judge or probe
        elif self._probe_left > 0:
            self._probe_left -= 1
            pool = True
        else:
            pool = self.pool_pays(wanted, window, candidates)
            if self._judging_probe:
                self._judging_probe = False
                self._failed_probes = 0 if pool else self._failed_probes + 1
            interval = self.probe_every * 2 ** min(self._failed_probes, self.max_backoff)
            if not pool and self._steps_off >= interval:
                pool = True
                self._probe_left = self.probe_steps - 1
                self._judging_probe = True
        if candidates > 0:
            self._steps_off = 0 if pool else self._steps_off + 1
        self.window_step, self.pool_step = window, pool
        extra = (self.window_tokens if window else 0) + (candidates * (self.shape.ngram - 1) if pool else 0)
        self.guess_length = self.cut(wanted, extra)
        if not self.lookahead_step:
            return self.guess_length
        # A lookahead step is a tree step: its tree holds the pool's n-grams, N - 1 deep,
        # beside the guess; one the window alone rides holds the guess, or nothing.
        return max(self.guess_length, self.shape.ngram - 1 if pool else 1)

    def expect(self, match: int) -> None:
        """The length of prompt lookup's match for the coming step, for the `meanwhile` policy."""
        self.meanwhile.expect(match)

    def plain_seconds(self) -> float | None:
        return self.meanwhile.plain_seconds()

    def plan(self, signal: DraftSignal, room: int, trees: bool) -> StepPlan:
        """A lookahead step is a tree step carrying the window, the pool or both; the others
        are prompt lookup's, sized by its own k auto."""
        k = self.draft_length(signal, room)
        if not self.lookahead_step:
            return StepPlan(k, tree=trees and k > 0, costs=self.meanwhile.costs.curve)
        return StepPlan(k, tree=k > 0, lookahead=LookaheadPlan(self.guess_length, self.pool_step, self.window_step))

    def observe(self, step: StepEvent) -> None:
        if not self.lookahead_step or not step.tree:
            self.meanwhile.observe(step)
            return
        # The pass's cost is what it is whatever it verifies; the guess in its tree is
        # prompt lookup's draft, verified as a chain would have been (its kept prefix).
        self.meanwhile.costs.observe(step)
        guess = replace(step, drafted=step.guessed, accepted=step.guessed_kept, fed=step.guessed + 1, tree=False)
        self.meanwhile.learn(guess)
        if self.pool_step:
            self._gain_sum = self._gain_sum * self.forgetting + (step.accepted - step.guessed_kept)
            self._gain_steps = self._gain_steps * self.forgetting + 1


class FixedLookahead(FixedDraftLength):
    """A fixed k for lookahead (`--k N`: n-grams of N + 1 tokens): every drafting step is a
    lookahead step, with the whole window and pool."""

    def plan(self, signal: DraftSignal, room: int, trees: bool) -> StepPlan:
        k = self.draft_length(signal, room)
        return StepPlan(k, tree=k > 0, lookahead=LookaheadPlan() if k > 0 else None)
