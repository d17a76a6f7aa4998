"""How many tokens to draft next."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Protocol, Sequence

from speccli.autok.costs import CostCurve
from speccli.autok.plan import DraftSignal, ShadowGuess, StepPlan
from speccli.events import StepEvent


class DraftLengthPolicy:
    """How to draft each step: `plan` before the step, `observe` after it.

    A policy chooses the length in `next_k`, reading the drafter's signal for the coming
    step in the hooks `expect` and `offer` where it uses them (their defaults ignore it);
    `plan` turns that into the step's plan."""

    costs: StepCosts | None = None  # measured step costs (k auto's), which size token trees

    def begin(self) -> None:
        """A generation begins; its first step drafts the answer's first token."""

    def plan(self, signal: DraftSignal, room: int, trees: bool) -> StepPlan:
        """The coming step, drafting at most `room` tokens, as a tree where `trees` allows."""
        k = self.draft_length(signal, room)
        return StepPlan(k, tree=trees and k > 0, costs=self.costs.curve if self.costs is not None else None)

    def plain_seconds(self) -> float | None:
        """What a plain step costs now, by the measured costs (None: not measured)."""
        return self.costs.step_seconds(0) if self.costs is not None else None

    def draft_length(self, signal: DraftSignal, room: int) -> int:
        """The coming step's k from the drafter's signal (the hooks below), at most `room`."""
        self.expect(signal.match)
        self.offer(signal.pooled)
        return max(0, min(self.next_k(), room))

    def expect(self, match: int) -> None:
        """The length of prompt lookup's match for the coming step (0: none)."""

    def offer(self, candidates: int) -> None:
        """How many of lookahead's pooled n-grams the coming step could offer."""

    def next_k(self) -> int:
        """The number of tokens to draft in the coming step."""
        raise NotImplementedError

    def observe(self, step: StepEvent) -> None:
        """Learn from the step just verified."""
        raise NotImplementedError


class FixedDraftLength(DraftLengthPolicy):
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
    """Seconds per verification pass by number of tokens fed, and per drafted token, from
    what the decoder measured on this machine.

    Seeded with a calibration, a size the session has not fed yet costs its calibrated
    seconds times `level`, how fast the machine runs now against when it calibrated (every
    step refines it: longer contexts, another load on a shared machine); a size it has fed
    follows its own measurements, from there (docs/k-auto.md, "Why it is built this way").
    Without a calibration, or for sizes it did not measure, each size follows its own
    measurements alone."""

    smoothing: float = 0.3
    max_jump: float = 3.0
    verify: dict[int, float] = field(default_factory=dict)
    draft_per_token: float | None = None
    level: float = 1.0  # this machine now against the calibration: measured / calibrated seconds
    _calibrated: dict[int, float] = field(default_factory=dict, repr=False)
    _weight: int = field(default=3, repr=False)
    _counts: dict[object, int] = field(default_factory=dict, repr=False)

    def seed(self, verify: dict[int, float], draft_per_token: float | None, weight: int = 3) -> None:
        """Start from measured costs (a calibration), worth `weight` online measurements each."""
        self._calibrated = dict(verify)
        for size in verify:  # a size with a count follows its own measurements
            self._counts.pop(size, None)
        self._weight = weight
        self.level = 1.0
        self._counts["level"] = weight
        self.verify = dict(verify)
        if draft_per_token is not None:
            self.draft_per_token = draft_per_token
            self._counts["draft"] = weight

    def observe(self, step: StepEvent) -> None:
        self.observe_pass(step)
        if step.drafted:
            self.draft_per_token = self._blend(
                "draft", self.draft_per_token, (step.draft_seconds - step.catch_up_seconds) / step.drafted
            )

    def observe_pass(self, step: StepEvent) -> None:
        """The step's verification pass alone (a step another drafter drafted)."""
        fed = step.fed
        if fed in self._calibrated:
            if fed not in self._counts:  # from here on its own: from what it was taken to cost
                self._counts[fed] = self._weight
            self.level = self._blend("level", self.level, step.verify_seconds / self._calibrated[fed])
            for size, seconds in self._calibrated.items():
                if size not in self._counts:
                    self.verify[size] = seconds * self.level
        self.verify[fed] = self._blend(fed, self.verify.get(fed), step.verify_seconds)

    def _blend(self, key: object, old: float | None, new: float) -> float:
        # A plain mean of the first few measurements, then an exponential moving average:
        # one odd first measurement must not linger. A measurement is taken as at most
        # `max_jump` times the estimate either way: a one-off (a kernel loaded on first use,
        # a pause of a shared machine) must not make drafting look worthless for the rest
        # of the session, while a lasting change still moves the estimate within a few steps.
        count = self._counts.get(key, 0) + 1
        self._counts[key] = count
        weight = max(self.smoothing, 1.0 / count)
        if old is None:
            return new
        new = min(max(new, old / self.max_jump), old * self.max_jump)
        return (1 - weight) * old + weight * new

    @property
    def curve(self) -> CostCurve:
        """The costs as they stand now (a view: it follows later steps)."""
        return CostCurve(self.verify, self.draft_per_token)

    def verify_seconds(self, fed: int) -> float | None:
        """A pass over `fed` tokens, untried sizes guessed optimistically (CostCurve.optimistic)."""
        return self.curve.optimistic(fed)

    def step_seconds(self, k: int) -> float | None:
        return self.curve.step_seconds(k)


@dataclass(frozen=True)
class AcceptancePrior:
    """What k auto learned about a draft: acceptance by draft position (each given that the
    positions before it survived), and the drafting steps that stands for."""

    acceptance: tuple[float, ...]
    steps: float
    # Prompt lookup's, by the length of the n-gram matched (DraftLengthByMatch): (length, prior).
    by_match: tuple[tuple[int, "AcceptancePrior"], ...] = ()
    # A draft model's opening guesses (AdaptiveDraftLength.begin): the chance the first
    # drafted token of an answer is accepted, and the opening steps that stands for.
    opening: "AcceptancePrior | None" = None
    # How each way of drafting paid against plain decoding (speccli.autok.measured): (way, gain, steps).
    methods: tuple[tuple[str, float, float], ...] = ()

    def for_match(self, match: int) -> "AcceptancePrior | None":
        return dict(self.by_match).get(match)


@dataclass(frozen=True)
class AdaptiveSettings:
    """What AdaptiveDraftLength starts from and how it learns (see the class for each)."""

    max_k: int = 16
    first_k: int = 4
    prior_acceptance: float | Sequence[float] = 0.7
    prior_weight: float = 2.0
    forgetting: float = 0.97
    probe_every: int = 16
    probe_budget: float = 0.05
    max_backoff: int = 2
    prior_steps: float = 0.0
    probe_hope: float = 0.9
    probe_min_gain: float = 1.1
    opening_prior: float | None = None
    opening_prior_steps: float = 0.0

    def __post_init__(self) -> None:
        if self.max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {self.max_k}")


class AdaptiveDraftLength(DraftLengthPolicy):
    """Each step, the k in 0..max_k that maximises expected tokens per second.

    Acceptance is tracked per draft position (the chance that position i survives given
    that every earlier one did), with exponential forgetting so that it follows the text.
    Each position's counts are shrunk towards the rate over all positions, itself shrunk
    towards the prior: one rejection at position 3 says little about position 3 in
    particular, and a position no draft has reached yet takes the overall rate, so that
    once short drafts prove good, long ones are tried.

    Costs are the whole measured curve (a calibration, see speccli.autok.costs:
    seconds of a pass by tokens fed, and of a draft token), brought to the machine's
    present speed by the steps themselves (StepCosts). Where verifying k+1 tokens costs
    what one does, long drafts pay; where it grows fast or the draft is slow, k shrinks,
    down to 0 (plain decoding). Drafts longer than the k that a draft that is always right
    would make best are never considered: past it, more never pays.

    While k is 0 nothing is learned about acceptance, so now and then it probes: it drafts
    the k that the cost curve favours for a good draft (acceptance `probe_hope`, or the
    prior or the estimate where higher). On a curve with a jump after one token that is a
    long draft: a one-token probe would pay the jump for at most two tokens. Probes are
    spaced so that what one is expected to cost over plain decoding stays under
    `probe_budget` of plain decoding's time (and at least `probe_every` plain steps
    apart); each probe in a row whose first drafted token is rejected doubles the spacing
    (up to `max_backoff` doublings), and any other drafting step resets it. A probe must
    promise, under that hopeful acceptance, at least `probe_min_gain` times plain decoding's
    tokens per second.

    The prior is the acceptance by position to start from: a number, or one per position
    (the last standing for the positions after it), such as what an earlier session with
    the same model pair learned (`learned_prior`), with `prior_steps` the drafting steps
    it stands for.

    The first step of a generation (`begin`) drafts the answer's first token, which the
    draft gets wrong far more often than any later one. Its first position is learned
    apart (the opening acceptance, shrunk towards the first position's), and does not count
    against the rest. An earlier session's opening rate (`opening_prior`, worth
    `opening_prior_steps` openings) is where the opening estimate starts, and what it
    learned is left to the next one. Why each rule: docs/k-auto.md.
    """

    costs: StepCosts

    def __init__(self, settings: AdaptiveSettings | None = None, **overrides) -> None:
        s = replace(settings or AdaptiveSettings(), **overrides)
        self.settings = s
        self.max_k = s.max_k
        self.first_k = min(s.first_k, s.max_k)
        self.prior = _per_position(s.prior_acceptance, s.max_k)
        self.prior_weight = s.prior_weight
        self.forgetting = s.forgetting
        self.probe_every = s.probe_every
        self.probe_budget = s.probe_budget
        self.max_backoff = s.max_backoff
        self.prior_steps = s.prior_steps
        self.probe_hope = s.probe_hope
        self.probe_min_gain = s.probe_min_gain
        self.costs = StepCosts()
        self._kept = [0.0] * s.max_k
        self._tried = [0.0] * s.max_k
        # The whole session's counts, unforgotten: what it leaves for the next one.
        self._session_kept = [0] * s.max_k
        self._session_tried = [0] * s.max_k
        self._steps_without_drafting = 0
        self._failed_probes = 0
        self._probing = False
        self._opening = False
        self._opening_kept = 0
        self._opening_tried = 0
        self.opening_prior = s.opening_prior
        self.opening_prior_steps = s.opening_prior_steps if s.opening_prior is not None else 0.0

    def begin(self) -> None:
        """A generation starts: the coming step is its opening (see the class)."""
        self._opening = True

    def opening_acceptance(self, acceptance: list[float] | None = None) -> float:
        """The chance that an opening step's first drafted token is accepted: the openings'
        own counts with an earlier session's, shrunk towards the first position's acceptance."""
        first = (self.acceptance() if acceptance is None else acceptance)[0]
        w = self.prior_weight
        earlier = (self.opening_prior or 0.0) * self.opening_prior_steps
        return (self._opening_kept + earlier + first * w) / (self._opening_tried + self.opening_prior_steps + w)

    @property
    def prior_acceptance(self) -> float:
        return self.prior[0]

    def acceptance(self) -> list[float]:
        # Each position's own counts, shrunk towards the rate over all positions (itself
        # shrunk towards the prior): one rejection at position 3 says little about
        # position 3 in particular, and a position no draft reached takes the overall rate.
        w = self.prior_weight
        pooled = (sum(self._kept) + self.prior[0] * w) / (sum(self._tried) + w)
        return [(kept + pooled * w) / (tried + w) for kept, tried in zip(self._kept, self._tried)]

    def next_k(self) -> int:
        self._probing = False
        if self.costs.step_seconds(0) is None:
            return self.first_k  # no costs at all (no calibration): a guess, then explore
        if 1 not in self.costs.verify:
            return 0  # measure a plain step too: untried sizes between are then guessed at its cost
        acceptance = self.acceptance()
        if self._opening:
            acceptance = [self.opening_acceptance(acceptance)] + acceptance[1:]
        best = self._best_k(acceptance)
        if best > 0 or self._steps_without_drafting < self.probe_interval(acceptance):
            return best
        probe = self._probe(acceptance)
        self._probing = probe > 0
        return probe

    def probe_k(self) -> int:
        """The draft length a probe would have now (0: none would be worth it)."""
        return self._probe(self.acceptance())

    def _probe(self, acceptance: list[float]) -> int:
        """The best draft length under the hopeful acceptance, when it promises at least
        `probe_min_gain` times plain decoding's rate; else 0."""
        hope = self._hope(acceptance)
        probe = self._best_k(hope)
        plain, seconds = self.costs.step_seconds(0), self.costs.step_seconds(probe)
        if probe == 0 or not plain or not seconds:
            return probe
        gain = expected_tokens(hope, probe) / seconds * plain
        return probe if gain >= self.probe_min_gain else 0

    def probe_interval(self, acceptance: list[float] | None = None) -> float:
        """Plain steps between probes: as many as keep the expected extra cost of a probe
        (its seconds less those of plain steps giving the tokens it is expected to give)
        under `probe_budget` of the plain steps' time, at least `probe_every`, doubled for
        each probe in a row after which drafting still did not pay."""
        acceptance = self.acceptance() if acceptance is None else acceptance
        plain = self.costs.step_seconds(0)
        probe = self._probe(acceptance)
        interval = float(self.probe_every)
        probe_seconds = self.costs.step_seconds(probe) if probe else None
        if plain and probe_seconds is not None:
            extra = probe_seconds - expected_tokens(acceptance, probe) * plain
            interval = max(interval, extra / (self.probe_budget * plain))
        return interval * 2 ** min(self._failed_probes, self.max_backoff)

    def _hope(self, acceptance: list[float]) -> list[float]:
        return [max(a, p, self.probe_hope) for a, p in zip(acceptance, self.prior)]

    def _limit(self) -> int:
        """The longest draft worth considering: beyond the k that even a draft that is
        always right makes best, more never pays (the cost curve grows faster than the
        tokens)."""
        best_k, best_rate = 0, 0.0
        for k in range(self.max_k + 1):
            seconds = self.costs.step_seconds(k)
            if seconds and seconds > 0 and (k + 1) / seconds > best_rate:
                best_k, best_rate = k, (k + 1) / seconds
        return best_k

    def _best_k(self, acceptance: list[float]) -> int:
        best_k, best_rate = 0, 0.0
        for k in range(self._limit() + 1):
            seconds = self.costs.step_seconds(k)
            if not seconds or seconds <= 0:
                continue
            rate = expected_tokens(acceptance, k) / seconds
            if rate > best_rate * 1.0001:  # ties go to the shorter draft
                best_k, best_rate = k, rate
        return best_k

    def expected(self, k: int) -> float:
        """Tokens a step that drafts k is expected to give now."""
        acceptance = self.acceptance()
        if self._opening:
            acceptance = [self.opening_acceptance(acceptance)] + acceptance[1:]
        return expected_tokens(acceptance, k)

    def observe(self, step: StepEvent) -> None:
        self.costs.observe(step)
        self.learn(step)

    def learn(self, step: StepEvent) -> None:
        """What the step says about the draft's acceptance (`observe` less the costs)."""
        probing, self._probing = self._probing, False
        opening, self._opening = self._opening, False
        if step.drafted == 0:
            if probing:
                # The probe drafted nothing (a tree the costs kept empty, after the draft's
                # pass; no earlier n-gram): a failed probe, or every step would probe again.
                self._steps_without_drafting = 0
                self._failed_probes += 1
            else:
                self._steps_without_drafting += 1
            return
        self._steps_without_drafting = 0
        if opening:
            self._opening_kept += step.accepted > 0
            self._opening_tried += 1
        self.count(step.drafted, step.accepted, first=1 if opening else 0)
        if probing and step.accepted == 0:
            self._failed_probes += 1  # not even the first drafted token was right
        else:
            self._failed_probes = 0

    def count(self, drafted: int, accepted: int, first: int = 0) -> None:
        """A draft of `drafted` tokens whose first `accepted` came true, as evidence of the
        acceptance by position from `first` on (a step's, or a guess the text settled: `shadow`)."""
        # Every position forgets, reached or not: evidence about a position that shorter
        # drafts no longer reach fades, and its estimate leans on the position before again.
        self._kept = [kept * self.forgetting for kept in self._kept]
        self._tried = [tried * self.forgetting for tried in self._tried]
        for position in range(first, min(drafted, accepted + 1, self.max_k)):
            # Reached: every earlier token was accepted.
            kept = position < accepted
            self._kept[position] += kept
            self._tried[position] += 1
            self._session_kept[position] += kept
            self._session_tried[position] += 1

    def shadow(self, guess: ShadowGuess) -> None:
        """A guess this drafter would have drafted for a step another drafted, against the
        tokens that step settled: its leading tokens that came true, up to those settled."""
        self.count(guess.compared, guess.kept)

    def learned(self) -> AcceptancePrior | None:
        """learned_prior() and learned_opening() for the next session, None when this one
        never drafted."""
        if not self._session_tried[0] and not self._opening_tried:
            return None
        acceptance, steps = self.learned_prior()
        return AcceptancePrior(tuple(acceptance), steps, opening=self.learned_opening())

    def learned_opening(self, max_steps: float = 50.0) -> AcceptancePrior | None:
        """The opening acceptance to start the next session with, and the openings it
        stands for (this session's, pooled with the prior it started from, as
        learned_prior); None when neither drafted an opening. Worth fewer steps than
        learned_prior: an opening that decodes plain teaches nothing, so the estimate
        must stay within reach of what the next sessions' drafted openings show."""
        old = min(self.opening_prior_steps, max_steps)
        if not self._opening_tried and not old:
            return None
        kept = self._opening_kept + (self.opening_prior or 0.0) * old
        return AcceptancePrior((kept / (self._opening_tried + old),), old + self._opening_tried)

    def learned_prior(self, max_steps: float = 200.0) -> tuple[list[float], float]:
        """The acceptance by position to start the next session with, and the drafting
        steps it stands for: this session's counts (unforgotten), pooled with the prior it
        started from, worth at most `max_steps` steps so that what was learned now counts."""
        old = min(self.prior_steps, max_steps)
        w = self.prior_weight
        kept, tried = self._session_kept, self._session_tried
        pooled = (sum(kept) + self.prior[0] * (old + w)) / (sum(tried) + old + w)
        learned = [(kept[i] + self.prior[i] * old + pooled * w) / (tried[i] + old + w) for i in range(self.max_k)]
        return learned, old + tried[0]


class DraftLengthByMatch(DraftLengthPolicy):
    """k auto for prompt lookup, with acceptance kept apart by the length of the n-gram
    matched: a draft after a 3-token match comes true far more often than one after a
    1-token match (see speccli.drafters.ngram.LOOKUP_ACCEPTANCE). One acceptance for all
    of them drafts after the short matches of chat text on the strength of the long ones
    of code, where each such step costs more than the plain step it replaces.

    Before each step the decoder tells it the length of the drafter's match (`expect`):
    the AdaptiveDraftLength for that length chooses k and learns from the step, all of them
    over the same measured costs. Without a match there is nothing to draft: k is 0, and
    only the step's cost is learned.
    """

    costs: StepCosts

    def __init__(self, make: Callable[[int], AdaptiveDraftLength]) -> None:
        self._make = make  # the policy for a match length, before it has seen a step
        self.costs = StepCosts()
        self._by_match: dict[int, AdaptiveDraftLength] = {}
        self._match = 1
        self._asked: AdaptiveDraftLength | None = None

    def expect(self, match: int) -> None:
        """The length of the n-gram the drafter matched for the coming step (0: none)."""
        self._match = match

    def policy(self, match: int) -> AdaptiveDraftLength:
        """The policy for drafts after a match of this length."""
        if match not in self._by_match:
            policy = self._make(match)
            policy.costs = self.costs
            self._by_match[match] = policy
        return self._by_match[match]

    def next_k(self) -> int:
        self._asked = self.policy(self._match) if self._match > 0 else None
        return self._asked.next_k() if self._asked is not None else 0

    def expected(self, k: int) -> float:
        """Tokens a step that drafts k after the coming step's match is expected to give."""
        return self.policy(self._match).expected(k) if self._match > 0 else 1.0

    def observe(self, step: StepEvent) -> None:
        self.costs.observe(step)
        self.learn(step)

    def shadow(self, guess: ShadowGuess) -> None:
        """A guess after a match of `guess.match` tokens, against what another drafter's step settled."""
        if guess.match > 0:
            self.policy(guess.match).shadow(guess)

    def learn(self, step: StepEvent) -> None:
        """What the step says about the acceptance after its match (`observe` less the costs)."""
        asked, self._asked = self._asked, None
        if asked is not None:
            asked.learn(step)

    def learned(self) -> AcceptancePrior | None:
        """For the next session: each match length's learned prior, and all of them pooled."""
        by_match = tuple(
            (match, learned) for match, policy in sorted(self._by_match.items()) if (learned := policy.learned())
        )
        if not by_match:
            return None
        steps = sum(learned.steps for _, learned in by_match)
        pooled = tuple(
            sum(learned.acceptance[i] * learned.steps for _, learned in by_match) / steps
            for i in range(len(by_match[0][1].acceptance))
        )
        return AcceptancePrior(pooled, steps, by_match)


def _per_position(prior: float | Sequence[float], length: int) -> list[float]:
    values = [float(prior)] if isinstance(prior, (int, float)) else [float(p) for p in prior]
    if not values or any(not 0.0 <= p <= 1.0 for p in values):
        raise ValueError(f"prior acceptance must be in [0, 1], got {prior!r}")
    return (values + [values[-1]] * length)[:length]


# k auto's policy for a drafter, built from the acceptance its drafts start from by the length
# of the n-gram they continue (None: drafts not keyed so).
KAutoPolicy = AdaptiveDraftLength | DraftLengthByMatch


class KAutoFactory(Protocol):
    """Builds (or returns the kept) k auto policy of a drafter; `key` names a candidate whose
    policy is kept apart from the drafter's own (None: the drafter's own)."""

    def __call__(
        self, match_acceptance: Mapping[int, Sequence[float]] | None, key: str | None = None
    ) -> KAutoPolicy: ...


class KAuto:
    """k auto's policy across generations. Built from the measured costs (a calibration)
    and the acceptance an earlier session left, and kept while those hold: what it learned
    about this machine's costs and the draft's acceptance carries over from one prompt (or
    chat turn) to the next. Built again when the costs or the prior change (a calibration
    arrived)."""

    def __init__(self) -> None:
        self.kept: AdaptiveDraftLength | DraftLengthByMatch | None = None
        self._built_from: tuple[int, CostCurve | None, AcceptancePrior | None] | None = None

    def policy(
        self,
        max_k: int,
        costs: CostCurve | None,
        prior: AcceptancePrior | None,
        match_acceptance: Mapping[int, Sequence[float]] | None = None,
    ) -> AdaptiveDraftLength | DraftLengthByMatch:
        """The policy for drafts of at most `max_k` tokens (and at most what the costs
        measured passes for). `match_acceptance`: for drafts keyed by the length of the
        n-gram they continue (prompt lookup), the acceptance such drafts start from."""
        if self.kept is not None and self._built_from is not None:
            kept_max_k, kept_costs, kept_prior = self._built_from
            if kept_max_k == max_k and kept_costs is costs and kept_prior is prior:
                return self.kept
        self._built_from = (max_k, costs, prior)
        if costs is not None:
            max_k = max(1, min(max_k, costs.largest - 1))
        if match_acceptance is not None:
            self.kept = DraftLengthByMatch(lambda match: _for_match(max_k, match, prior, match_acceptance))
        else:
            settings = AdaptiveSettings(max_k=max_k)
            if prior is not None and prior.acceptance:
                settings = replace(settings, prior_acceptance=prior.acceptance, prior_steps=prior.steps)
                if prior.opening is not None:
                    opening = prior.opening
                    settings = replace(settings, opening_prior=opening.acceptance[0], opening_prior_steps=opening.steps)
            self.kept = AdaptiveDraftLength(settings)
        if costs is not None:
            self.kept.costs.seed(costs.verify_seconds, costs.draft_seconds)
        return self.kept

    def learned(self) -> AcceptancePrior | None:
        """What it has learned about the draft's acceptance so far (with the prior it
        started from), for the next session; None before it drafted."""
        return self.kept.learned() if self.kept is not None else None


def _for_match(
    max_k: int, match: int, prior: AcceptancePrior | None, match_acceptance: Mapping[int, Sequence[float]]
) -> AdaptiveDraftLength:
    """k auto for prompt lookup's drafts after a match of this length: from what an
    earlier session learned of them, else from what such drafts measured."""
    learned = prior.for_match(match) if prior is not None else None
    if learned is not None:
        return AdaptiveDraftLength(max_k=max_k, prior_acceptance=learned.acceptance, prior_steps=learned.steps)
    start = match_acceptance.get(match, match_acceptance[max(match_acceptance)])
    return AdaptiveDraftLength(max_k=max_k, prior_acceptance=start)
