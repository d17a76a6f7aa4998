"""k auto's measured rates (speccli.autok.measured): chains or trees as each has measured faster
(`--tree auto`), and the floor that stops a way of drafting that has not paid against plain
decoding, until it is tried again."""

from __future__ import annotations

import collections

import pytest

from conftest import wrap
from speccli.autok.costs import CostCurve
from speccli.autok.measured import (
    JUDGED_AFTER,
    MAX_BACKOFF,
    PRIOR_STEPS,
    RECHECK_EVERY,
    RETRY_AFTER,
    MeasuredChoice,
    MethodRates,
    WayRate,
)
from speccli.autok.plan import DraftSignal, StepPlan
from speccli.autok.policy import DraftLengthPolicy, StepCosts
from speccli.config import SamplingConfig, SpecConfig
from speccli.drafters.candidates import CandidateDrafter
from speccli.drafters.model import ModelDrafter
from speccli.drafters.ngram import PromptLookupDrafter
from speccli.events import StepEvent
from speccli.loop import SpeculativeDecoder
from test_decoder_greedy import EOS, MAX_NEW, PROMPTS, emitted, encode, target_greedy

pytestmark = pytest.mark.floor  # the floor on, as outside the tests

PLAIN = 0.1  # seconds of a plain step in these tests


class AlwaysDrafts(DraftLengthPolicy):
    """An inner policy that drafts k every step (as k auto's model would, wrongly or not)."""

    def __init__(self, k: int = 3, source: str | None = None) -> None:
        self.k, self.source = k, source
        self.costs = StepCosts()
        self.costs.seed({1: PLAIN, 4: PLAIN}, 0.0)
        self.observed: list[StepEvent] = []

    def plan(self, signal: DraftSignal, room: int, trees: bool) -> StepPlan:
        return StepPlan(self.k, tree=trees, source=self.source)

    def next_k(self) -> int:
        return self.k

    def observe(self, step: StepEvent) -> None:
        self.observed.append(step)


def step(plan: StepPlan, tokens: int, seconds: float, number: int = 1) -> StepEvent:
    """The event of `plan` carried out: `tokens` emitted in `seconds` (a plain step: one, PLAIN)."""
    if plan.k == 0:
        return StepEvent(number, 0, 0, 0.0, PLAIN, method="plain")
    return StepEvent(number, plan.k, tokens - 1, seconds / 2, seconds / 2, tree=plan.tree)


def run(choice: MeasuredChoice, steps: int, outcome) -> list[StepPlan]:
    """`steps` steps, each plan's outcome (tokens, seconds) given by `outcome(plan)`."""
    plans = []
    for number in range(steps):
        plan = choice.plan(DraftSignal(), 16, False)
        plans.append(plan)
        choice.observe(step(plan, *outcome(plan), number=number))
    return plans


def test_a_way_that_pays_runs_every_step():
    choice = MeasuredChoice(AlwaysDrafts(), MethodRates(), "model", trees=False, asked=False)
    plans = run(choice, 40, lambda plan: (3, 2 * PLAIN))  # 1.5x plain's tokens per second
    assert all(p.k == 3 and not p.tree for p in plans)
    assert choice.rates.ways["model chain"].gain == pytest.approx(1.5)


def test_a_way_that_does_not_pay_stops_after_its_judged_steps_and_is_tried_again_backing_off():
    choice = MeasuredChoice(AlwaysDrafts(), MethodRates(), "model", trees=False, asked=False)
    plans = run(choice, 200, lambda plan: (2, 3 * PLAIN))  # 0.67x plain
    drafting = [i for i, p in enumerate(plans) if p.k > 0]
    judged = next(n for n in range(1, 20) if sum(0.9**i for i in range(n)) >= JUDGED_AFTER)
    assert drafting[:judged] == list(range(judged))  # judged after JUDGED_AFTER (forgotten) steps
    gaps = [b - a - 1 for a, b in zip(drafting[judged - 1 :], drafting[judged:])]
    assert gaps[:4] == [RETRY_AFTER, 2 * RETRY_AFTER, 4 * RETRY_AFTER, 4 * RETRY_AFTER]  # at most MAX_BACKOFF
    assert MAX_BACKOFF == 2
    # Every step the floor made plain still reached the inner policy (its costs learn from plain passes).
    assert len(choice.inner.observed) == 200


def test_a_try_that_pays_goes_on_and_lifts_the_stop():
    choice = MeasuredChoice(AlwaysDrafts(), MethodRates(), "model", trees=False, asked=False)
    run(choice, 10, lambda plan: (1, 3 * PLAIN))  # 0.33x: stopped
    assert not choice.rates.paying("model chain")
    plans = run(choice, 60, lambda plan: (4, 1.5 * PLAIN))  # the text changed: 2.7x
    first_try = next(i for i, p in enumerate(plans) if p.k > 0)
    assert 0 < first_try <= RETRY_AFTER
    assert all(p.k == 3 for p in plans[first_try:])  # each try paid: it went on
    assert choice.rates.paying("model chain")


def test_a_new_generation_tries_a_stopped_way_at_once():
    choice = MeasuredChoice(AlwaysDrafts(), MethodRates(), "model", trees=False, asked=False)
    run(choice, 10, lambda plan: (1, 3 * PLAIN))
    assert choice.plan(DraftSignal(), 16, False).k == 0
    choice.observe(step(StepPlan(), 1, PLAIN))
    choice.begin()
    assert choice.plan(DraftSignal(), 16, False).k == 3


def test_tree_auto_explores_both_forms_then_keeps_the_faster_and_rechecks_the_other():
    choice = MeasuredChoice(AlwaysDrafts(), MethodRates(), "model", trees=True, asked=None)
    plans = run(choice, 120, lambda plan: (4 if plan.tree else 3, 2 * PLAIN))  # trees 2.0x, chains 1.5x
    forms = ["tree" if p.tree else "chain" for p in plans]
    assert forms[:6] == ["tree", "chain"] * 3  # explored in turn
    later = collections.Counter(forms[6:])
    assert later["chain"] == pytest.approx(len(forms[6:]) / (RECHECK_EVERY + 1), abs=1.5)  # rechecked, rarely
    assert choice.rates.ways["model tree"].gain == pytest.approx(2.0)


@pytest.mark.parametrize("asked", [True, False])
def test_a_form_given_by_hand_is_kept(asked):
    choice = MeasuredChoice(AlwaysDrafts(), MethodRates(), "model", trees=True, asked=asked)
    plans = [choice.plan(DraftSignal(), 16, asked) for _ in range(3)]
    assert all(p.tree is asked for p in plans)


def test_where_one_form_stopped_the_other_runs_instead_of_plain():
    choice = MeasuredChoice(AlwaysDrafts(), MethodRates(), "model", trees=True, asked=None)
    plans = run(choice, 240, lambda plan: (1, 3 * PLAIN) if plan.tree else (3, 1.5 * PLAIN))
    assert all(p.k > 0 for p in plans)
    assert not choice.rates.paying("model tree") and choice.rates.paying("model chain")


def test_rates_are_learned_and_seed_the_next_session_worth_a_few_steps():
    rates = MethodRates()
    for _ in range(30):
        rates.rate("model tree").add(3, 2.0)
    learned = rates.learned()
    assert learned == (("model tree", 1.5, round(sum(0.9**i for i in range(30)), 2)),)
    seeded = MethodRates.seeded(learned + (("ngram chain", 0.0, 4.0),))  # a gain of 0 is not a rate
    assert set(seeded.ways) == {"model tree"}
    assert seeded.ways["model tree"] == WayRate(tokens=1.5 * PRIOR_STEPS, plain_steps=PRIOR_STEPS, steps=PRIOR_STEPS)


def virtual_clock(decoder: SpeculativeDecoder, target_pass: float, draft_pass: float) -> None:
    """Each target pass advances the decoder's clock by `target_pass`, each of the draft's by `draft_pass`."""
    now = [0.0]

    def timed(model, name, seconds):
        real = getattr(model, name)

        def call(*args, **kwargs):
            now[0] += seconds
            return real(*args, **kwargs)

        setattr(model, name, call)

    for name in ("forward", "forward_tree"):
        timed(decoder.target, name, target_pass)
        timed(decoder.drafter.draft_model, name, draft_pass)
    decoder._clock = lambda: now[0]


def test_where_the_draft_is_dearer_than_its_calibration_the_floor_stops_it_sooner_and_keeps_the_output(
    pairs, tokenizer, monkeypatch
):
    # The calibration says a draft token costs nothing; each of the draft's passes takes as long
    # as the target's. k auto's costs learn that only step by step; the floor sees it at once.
    def drafting_steps(floor: float) -> int:
        monkeypatch.setattr("speccli.autok.measured.PAYS_AT_LEAST", floor)
        pair = pairs[0]
        drafter = CandidateDrafter([ModelDrafter(wrap(pair.draft), len(tokenizer)), PromptLookupDrafter()])
        decoder = SpeculativeDecoder(wrap(pair.target), tokenizer, [EOS], drafter)
        decoder.costs = CostCurve({fed: PLAIN for fed in range(1, 18)}, 0.0)
        virtual_clock(decoder, PLAIN, PLAIN)
        drafted = 0
        for prompt in PROMPTS:
            ids = encode(tokenizer, prompt)
            events = list(decoder.generate(ids, SamplingConfig(), SpecConfig(k="auto", max_new_tokens=MAX_NEW)))
            assert emitted(events) == target_greedy(pair.target, ids), prompt
            drafted += sum(1 for e in events if isinstance(e, StepEvent) and e.method.startswith("model"))
        return drafted

    assert drafting_steps(0.97) < drafting_steps(0.0)
