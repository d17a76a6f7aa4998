"""What k auto's model of a step cannot see, measured: how many tokens per second each way of
drafting (a drafter and its form: "model chain", "model tree", "ngram chain", "lookahead")
has really given against plain decoding, over its recent steps. It chooses between a chain and
a tree (`--tree auto`), and stops a way of drafting that has not paid (docs/k-auto.md)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from speccli.autok.plan import DraftSignal, StepPlan
from speccli.autok.policy import DraftLengthPolicy
from speccli.events import StepEvent

# Each earlier step of a way of drafting counts this much less at every later one of it:
# about the last ten steps decide.
FORGETTING = 0.9
# A way of drafting is judged after this many steps of it (forgotten steps counted as such).
JUDGED_AFTER = 5.0
# It has not paid when it gave less than this share of plain decoding's tokens per second.
PAYS_AT_LEAST = 0.97
# After it stopped, it is tried again after this many steps of other ways (doubled for each
# try in a row that did not pay, up to MAX_BACKOFF doublings); a try that pays goes on.
RETRY_AFTER = 12
MAX_BACKOFF = 2
# Where both forms are open, each is tried until it has this many steps (forgotten steps
# counted as such; an earlier session's count too) before the measured better one is kept,
# and the other is tried again once every RECHECK_EVERY steps of the drafter.
EXPLORED = 2.5
RECHECK_EVERY = 24
# What an earlier session's figures count for here, at most, in steps: enough to skip the
# exploring, little enough that this session's own steps soon decide.
PRIOR_STEPS = 6.0


@dataclass
class WayRate:
    """A way of drafting's recent steps: tokens given, and seconds spent in units of a plain
    step's seconds at the time (so that the figure holds when the machine speeds up or slows
    down as a whole), each step forgotten as later ones come."""

    tokens: float = 0.0
    plain_steps: float = 0.0  # the seconds, in plain steps
    steps: float = 0.0
    tried: int = 0  # steps of it this session, unforgotten

    @property
    def gain(self) -> float | None:
        """Tokens per second against plain decoding's (1.0: as fast); None before any step."""
        return self.tokens / self.plain_steps if self.plain_steps > 0 else None

    def add(self, tokens: int, plain_steps: float) -> None:
        self.tokens = self.tokens * FORGETTING + tokens
        self.plain_steps = self.plain_steps * FORGETTING + plain_steps
        self.steps = self.steps * FORGETTING + 1.0
        self.tried += 1


@dataclass
class MethodRates:
    """Every way of drafting's WayRate, kept across the generations of a session (and saved
    with the acceptance prior for the next: `learned`, `seeded`)."""

    ways: dict[str, WayRate] = field(default_factory=dict)

    def rate(self, way: str) -> WayRate:
        return self.ways.setdefault(way, WayRate())

    def paying(self, way: str) -> bool:
        """Whether `way` has paid, or has too few steps to say."""
        rate = self.ways.get(way)
        gain = None if rate is None else rate.gain
        return rate is None or rate.steps < JUDGED_AFTER or gain is None or gain >= PAYS_AT_LEAST

    def learned(self) -> tuple[tuple[str, float, float], ...]:
        """(way, gain, steps) of each way measured, for the next session."""
        return tuple(
            (way, round(rate.gain, 4), round(rate.steps, 2))
            for way, rate in sorted(self.ways.items())
            if rate.gain is not None
        )

    @classmethod
    def seeded(cls, learned: tuple[tuple[str, float, float], ...]) -> MethodRates:
        """Rates that start from an earlier session's, worth at most PRIOR_STEPS steps each."""
        rates = cls()
        for way, gain, steps in learned:
            if gain > 0 and steps > 0:
                weight = min(steps, PRIOR_STEPS)
                rates.ways[way] = WayRate(tokens=gain * weight, plain_steps=weight, steps=weight)
        return rates


class MeasuredChoice(DraftLengthPolicy):
    """k auto's policy (`inner`) with the measured rates over it.

    `inner` plans each step as before. Where trees are left to it (`--tree auto`) and the
    drafter can draft them, the step takes the form, chain or tree, that has given the more
    tokens per second (each tried about three times first, the other again every
    RECHECK_EVERY steps). A way of drafting whose recent steps gave less than PAYS_AT_LEAST of
    plain decoding's rate is not taken: its steps are plain until it is tried again
    (RETRY_AFTER steps later, backing off), and a try that pays lifts the stop. That is the
    floor under k auto's own model, for what the model does not price (a draft catching up
    after another drafter's steps, a tree grown pass by pass, time outside both passes)."""

    def __init__(
        self, inner: DraftLengthPolicy, rates: MethodRates, drafter: str, trees: bool, asked: bool | None
    ) -> None:
        self.inner = inner
        self.rates = rates
        self.drafter = drafter  # the way's name where the plan names no source
        self.asked = asked  # --tree as given: True, False, or None (auto: chosen here where the drafter can)
        self.choose_trees = asked is None and trees
        self.costs = inner.costs
        self._way: str | None = None
        self._held: str | None = None  # the way planned before the floor made the step plain
        self._retry: dict[str, int] = {}  # a stopped way: steps since it last ran
        self._failed: dict[str, int] = {}  # a stopped way: tries in a row that did not pay
        self._since_other: dict[str, int] = {}  # a drafter: steps since its other form ran

    def begin(self) -> None:
        """A new generation: its text may suit a stopped way, so each is tried at its first chance."""
        self.inner.begin()
        for way in self._retry:
            self._retry[way] = RETRY_AFTER * 2**MAX_BACKOFF

    def plain_seconds(self) -> float | None:
        return self.inner.plain_seconds()

    def plan(self, signal: DraftSignal, room: int, trees: bool) -> StepPlan:
        plan = self.inner.plan(signal, room, trees or self.choose_trees)
        self._held = None
        if plan.k == 0:
            self._way = None
            return plan
        source = plan.source or self.drafter
        if self.choose_trees and plan.lookahead is None:
            plan = replace(plan, tree=self._tree(source))
        way = plan.way(self.drafter)
        if not self._open(way):
            if self.choose_trees and plan.lookahead is None:
                other = replace(plan, tree=not plan.tree)
                if self._open(other.way(self.drafter)):
                    self._way = other.way(self.drafter)
                    return other
            self._way, self._held = None, way
            return StepPlan(costs=plan.costs)
        self._way = way
        return plan

    def _open(self, way: str) -> bool:
        """Whether `way` may run this step: it pays, or it is due to be tried again."""
        if self.rates.paying(way):
            return True
        due = RETRY_AFTER * 2 ** min(self._failed.get(way, 0), MAX_BACKOFF)
        return self._retry.get(way, 0) >= due

    def _tree(self, source: str) -> bool:
        """Chain or tree for `source`'s step: the one measured better, once each is known."""
        chain, tree = self.rates.ways.get(f"{source} chain"), self.rates.ways.get(f"{source} tree")
        chain_steps, tree_steps = (chain.steps if chain else 0.0), (tree.steps if tree else 0.0)
        if min(chain_steps, tree_steps) < EXPLORED:
            return tree_steps <= chain_steps
        better = (tree.gain if tree and tree.gain else 0.0) > (chain.gain if chain and chain.gain else 0.0)
        return not better if self._since_other.get(source, 0) >= RECHECK_EVERY else better

    def observe(self, step: StepEvent) -> None:
        self.inner.observe(step)
        way, self._way = self._way, None
        held, self._held = self._held, None
        if held is not None:
            self._retry.setdefault(held, 0)
        for stopped in self._retry:
            if stopped != way:
                self._retry[stopped] += 1
        plain = self.plain_seconds()
        if way is None or not plain:
            return  # a plain step (lookahead's window-only steps count: the pool they fill pays later)
        spent = (step.draft_seconds + step.verify_seconds) / plain
        self._count_form(way)
        was_open = self.rates.paying(way)
        self.rates.rate(way).add(step.tokens, spent)
        if was_open:
            return
        # A try of a stopped way: one that paid goes on until the rate says it pays again.
        if step.tokens >= spent:
            self._retry[way] = RETRY_AFTER * 2**MAX_BACKOFF
            self._failed[way] = 0
            if self.rates.paying(way):
                del self._retry[way]
        else:
            self._retry[way] = 0
            self._failed[way] = self._failed.get(way, 0) + 1

    def _count_form(self, way: str) -> None:
        source, _, form = way.rpartition(" ")
        if form not in ("chain", "tree"):
            return
        kept = self.rates.ways.get(f"{source} {'tree' if form == 'chain' else 'chain'}")
        mine = self.rates.ways.get(way)
        better_now = mine is None or kept is None or (mine.gain or 0.0) >= (kept.gain or 0.0)
        self._since_other[source] = self._since_other.get(source, 0) + 1 if better_now else 0

    def next_k(self) -> int:
        return self.inner.next_k()
