"""The draft-length policies: fixed, and adaptive by expected tokens per second."""

from __future__ import annotations

import pytest

from speccli.autok.policy import AcceptancePrior, AdaptiveDraftLength, FixedDraftLength, StepCosts, expected_tokens
from speccli.config import SpecConfig, parse_draft_length
from speccli.events import StepEvent


def step(drafted: int, accepted: int, draft_seconds: float, verify_seconds: float) -> StepEvent:
    return StepEvent(1, drafted, accepted, draft_seconds, verify_seconds)


def test_expected_tokens_counts_each_surviving_prefix():
    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5, 0.5], 3) == 1 + 0.5 + 0.25 + 0.125
    assert expected_tokens([1.0, 0.0, 1.0], 3) == 2.0
    # Equal acceptance a gives the closed form (1 - a^(k+1)) / (1 - a).
    assert expected_tokens([0.8] * 4, 4) == pytest.approx((1 - 0.8**5) / (1 - 0.8))


def test_step_costs_guess_optimistically_where_unmeasured():
    costs = StepCosts(smoothing=1.0)
    assert costs.verify_seconds(3) is None and costs.step_seconds(2) is None
    costs.observe(step(1, 1, 0.1, 0.3))  # fed 2 tokens
    assert costs.verify_seconds(1) == pytest.approx(0.15)  # below: proportional
    costs.observe(step(4, 1, 0.4, 0.6))  # fed 5 tokens, 0.1 s per draft token
    assert costs.verify_seconds(2) == 0.3
    assert costs.verify_seconds(3) == 0.3  # between: the smaller size's cost
    assert costs.verify_seconds(9) == 0.6  # beyond: the largest measured
    assert costs.draft_per_token == pytest.approx(0.1)
    assert costs.step_seconds(4) == pytest.approx(0.6 + 0.4)


def test_a_draft_models_catch_up_is_not_a_cost_per_drafted_token():
    costs = StepCosts(smoothing=1.0)
    # 2 tokens drafted in 0.9 s, 0.7 s of which the draft spent reading the prompt first.
    costs.observe(StepEvent(1, 2, 1, 0.9, 0.3, catch_up_seconds=0.7))
    assert costs.draft_per_token == pytest.approx(0.1)


def test_step_costs_smooth_new_measurements():
    costs = StepCosts(smoothing=0.5)
    costs.observe(step(0, 0, 0.0, 1.0))
    costs.observe(step(0, 0, 0.0, 3.0))
    assert costs.verify_seconds(1) == 2.0


def test_one_outlier_moves_the_estimate_by_a_bounded_step_and_a_lasting_change_is_followed():
    costs = StepCosts(smoothing=0.25)
    costs.seed({1: 0.01, 2: 0.012}, draft_per_token=0.002)
    # A first drafting step 100x slower than calibrated (a kernel loaded on first use):
    costs.observe(StepEvent(1, 1, 1, 0.2, 0.012, fed=2))
    assert costs.draft_per_token == pytest.approx(0.75 * 0.002 + 0.25 * 0.006)
    # Measurements that stay 10x higher are followed.
    for i in range(12):
        costs.observe(StepEvent(2 + i, 1, 1, 0.02, 0.012, fed=2))
    assert costs.draft_per_token == pytest.approx(0.02, rel=0.05)


def test_sizes_the_steps_have_not_fed_keep_the_calibrated_shape_at_the_steps_level():
    costs = StepCosts()
    costs.seed({1: 0.2, 2: 0.3, 4: 0.33}, None)
    for _ in range(30):  # the machine runs 1.4x slower than it calibrated; steps feed one token
        costs.observe(step(0, 0, 0.0, 0.28))
    assert costs.level == pytest.approx(1.4, rel=0.01)
    assert costs.verify_seconds(1) == pytest.approx(0.28, rel=0.01)
    assert costs.verify_seconds(4) / costs.verify_seconds(1) == pytest.approx(0.33 / 0.2)
    costs.observe(step(8, 0, 0.0, 0.5))  # 9 tokens: not calibrated, its own measurement
    assert costs.verify_seconds(9) == 0.5 and costs.level == pytest.approx(1.4, rel=0.01)


def test_a_size_the_steps_keep_feeding_follows_what_it_costs_and_the_others_the_level():
    # The calibration put 5 tokens at 1.5x one; this session's 5-token passes cost 2x its one-token ones.
    costs = StepCosts()
    costs.seed({1: 0.2, 3: 0.25, 5: 0.3}, None)
    for _ in range(20):
        costs.observe(step(0, 0, 0.0, 0.28))
        costs.observe(step(4, 0, 0.0, 0.56))
    assert costs.verify_seconds(5) / costs.verify_seconds(1) == pytest.approx(2.0, rel=0.01)
    assert 0.25 * 1.4 < costs.verify_seconds(3) < 0.25 * 1.87  # unfed: the calibration's, at the steps' level


def test_a_machine_slower_than_it_calibrated_does_not_make_drafts_look_cheap():
    # Drafts that come true 40% of the time do not pay where two tokens cost 1.5x one.
    # Refreshing the one-token size alone (0.28 s measured) made 2-4 tokens look nearly free.
    policy = AdaptiveDraftLength(max_k=3, prior_acceptance=0.4, probe_every=1000)
    policy.costs.seed({1: 0.2, 2: 0.3, 3: 0.32, 4: 0.33}, None)
    assert policy.next_k() == 0
    for _ in range(30):
        policy.observe(step(0, 0, 0.0, 0.28))
        assert policy.next_k() == 0


def train(policy: AdaptiveDraftLength, acceptance: float, verify, draft_per_token: float, steps: int = 60) -> list[int]:
    """Feed the policy steps whose drafted tokens survive with the given rate pattern."""
    chosen = []
    for i in range(steps):
        k = policy.next_k()
        chosen.append(k)
        accepted = int(k * acceptance)  # deterministic: the first k*a drafts survive
        policy.observe(step(k, accepted, draft_per_token * k, verify(k + 1)))
    return chosen


def test_cheap_verification_and_good_drafts_draft_long():
    policy = AdaptiveDraftLength(max_k=8)
    chosen = train(policy, acceptance=1.0, verify=lambda n: 0.2, draft_per_token=0.01)
    assert chosen[0] == 4
    assert chosen[-10:] == [8] * 10


def test_expensive_drafts_fall_back_to_plain_decoding_and_probe():
    policy = AdaptiveDraftLength(max_k=8, probe_every=16)
    chosen = train(policy, acceptance=0.0, verify=lambda n: 0.2 * n, draft_per_token=0.5, steps=80)
    assert chosen[-40:].count(0) >= 35
    # No probe: even a draft that is always right would not pay on this curve (probes that
    # pay where they can: test_probes_draft_what_the_curve_favours_and_back_off).
    assert chosen[-40:] == [0] * 40


def test_verify_cost_growth_limits_k():
    # Verifying costs 0.2 s up to 3 tokens and doubles past that (as float32 on a CPU);
    # drafts are free and always right: 2 drafted tokens (3 fed) are the sweet spot.
    policy = AdaptiveDraftLength(max_k=8)
    chosen = train(
        policy, acceptance=1.0, verify=lambda n: 0.2 if n <= 3 else 0.4 + 0.1 * n, draft_per_token=0.0, steps=80
    )
    assert chosen[-10:] == [2] * 10


def test_fixed_draft_length():
    policy = FixedDraftLength(3)
    policy.observe(step(3, 0, 0.1, 0.1))
    assert policy.next_k() == 3
    with pytest.raises(ValueError):
        FixedDraftLength(-1)


def test_parse_draft_length_and_spec_config():
    assert parse_draft_length("auto") == "auto" and parse_draft_length(" AUTO ") == "auto"
    assert parse_draft_length("3") == 3
    for bad in ("0", "-1", "2.5", "x", ""):
        with pytest.raises(ValueError, match="k must be a whole number >= 1 or auto"):
            parse_draft_length(bad)
    assert SpecConfig(k="auto").k == "auto"
    with pytest.raises(ValueError):
        SpecConfig(k="sometimes")
    with pytest.raises(ValueError):
        SpecConfig(k="auto", max_k=0)


JUMP = {1: 0.404, 2: 1.003, 3: 1.12, 4: 1.17, 5: 1.18, 6: 0.99, 7: 1.02, 8: 0.97, 9: 1.02}  # issue 15


def jump_policy(**kwargs) -> AdaptiveDraftLength:
    policy = AdaptiveDraftLength(max_k=16, **kwargs)
    policy.costs.seed({**JUMP, **{n: 1.02 for n in range(10, 18)}}, 0.079)
    return policy


def test_probes_draft_what_the_curve_favours_and_back_off():
    # A pass over 2 tokens costs 2.5 over 1, then the curve is flat: a 1-token probe pays
    # the jump for at most 2 tokens, so probes are long drafts, spaced by what they cost.
    policy = jump_policy()
    assert policy.next_k() == 0 and policy.probe_k() >= 8
    chosen = []
    for _ in range(1500):
        k = policy.next_k()
        chosen.append(k)
        seconds = JUMP.get(k + 1, 1.02)
        policy.observe(step(k, 0, 0.079 * k, seconds))  # every drafted token rejected
    probes = [i for i, k in enumerate(chosen) if k]
    assert all(chosen[i] >= 8 for i in probes)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert probes[0] >= 16 and len(probes) >= 4
    assert gaps[1] > 1.5 * gaps[0]  # spaced out further after each failed probe...
    assert abs(gaps[-1] - gaps[-2]) <= 5  # ...up to a limit
    # What probing cost stays within 5% of plain decoding's time.
    seconds = sum(JUMP.get(k + 1, 1.02) + 0.079 * k for k in chosen)
    assert seconds <= 1.05 * len(chosen) * JUMP[1]


# llama.cpp on a 2-core AVX512 CPU (ms by tokens fed): a pass grows with every token.
LINEAR = {
    1: 34,
    2: 58,
    3: 79,
    4: 96,
    5: 116,
    6: 137,
    7: 173,
    8: 242,
    9: 258,
    10: 261,
    11: 278,
    12: 288,
    13: 306,
    14: 355,
    15: 338,
    16: 292,
    17: 370,
}


@pytest.mark.parametrize("prior", [0.7, 0.97])
def test_no_probes_where_even_a_good_draft_would_gain_little(prior):
    # With a draft token at 20 ms, a draft the target always accepts would give at most
    # 1.0x: probes would only cost (and did: 0.71x of plain decoding on a code prompt).
    policy = AdaptiveDraftLength(max_k=16, prior_acceptance=prior)
    policy.costs.seed({n: ms / 1000 for n, ms in LINEAR.items()}, 0.020)
    chosen = []
    for _ in range(400):
        k = policy.next_k()
        chosen.append(k)
        policy.observe(step(k, k, 0.020 * k, LINEAR[k + 1] / 1000))
    assert policy.probe_k() == 0 and set(chosen) == {0}
    # Free guesses (prompt lookup) on the same curve could gain more than 1.1x: they are probed.
    free = AdaptiveDraftLength(max_k=16, prior_acceptance=prior)
    free.costs.seed({n: ms / 1000 for n, ms in LINEAR.items()}, None)
    assert free.probe_k() > 0


def test_a_probe_that_finds_good_drafts_resets_the_spacing_and_drafts_long():
    policy = jump_policy()
    for _ in range(200):
        k = policy.next_k()
        policy.observe(step(k, 0, 0.079 * k, JUMP.get(k + 1, 1.02)))
    assert policy._failed_probes > 0
    chosen = []
    for _ in range(600):  # the text turns easy: every drafted token is right
        k = policy.next_k()
        chosen.append(k)
        policy.observe(step(k, k, 0.079 * k, JUMP.get(k + 1, 1.02)))
    assert policy._failed_probes == 0
    assert min(chosen[-20:]) >= 8


def test_a_probe_that_drafts_nothing_counts_as_a_failed_probe():
    # A tree step can come out empty (the costs keep no node) after paying for the draft's
    # pass; an empty probe that did not count would leave every later step a probe.
    policy = jump_policy()
    chosen = []
    for _ in range(1500):
        k = policy.next_k()
        chosen.append(k)
        policy.observe(step(0, 0, 0.079 if k else 0.0, JUMP[1]))  # nothing drafted either way
    probes = [i for i, k in enumerate(chosen) if k]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(probes) >= 4 and min(gaps) >= 16
    assert gaps[1] > 1.5 * gaps[0]  # backing off as after any failed probe


def test_long_drafts_where_passes_are_flat_up_to_where_more_never_pays():
    flat = AdaptiveDraftLength(max_k=16)
    flat.costs.seed({n: 0.17 for n in range(1, 18)}, 0.01)
    assert train(flat, acceptance=1.0, verify=lambda n: 0.17, draft_per_token=0.01)[-10:] == [16] * 10
    # Past 9 fed tokens a pass costs twice as much: even a draft that is always right is
    # best at 8, so longer drafts are never tried.
    knee = AdaptiveDraftLength(max_k=16)

    def verify(n: int) -> float:
        return 0.17 if n <= 9 else 0.34 + 0.01 * n

    knee.costs.seed({n: verify(n) for n in range(1, 18)}, 0.01)
    assert max(train(knee, acceptance=1.0, verify=verify, draft_per_token=0.01)) == 8


def test_a_learned_prior_starts_the_next_session_where_the_last_one_ended():
    first = jump_policy()
    for _ in range(300):  # a session on text the draft gets right 9 times in 10
        k = first.next_k()
        accepted = k if k < 5 else 5  # the sixth drafted token is always wrong
        first.observe(step(k, min(k, accepted), 0.079 * k, JUMP.get(k + 1, 1.02)))
    prior, steps = first.learned_prior()
    assert len(prior) == 16 and steps > 50
    assert prior[0] > 0.9 and prior[5] < 0.5
    fresh, seeded = jump_policy(), jump_policy(prior_acceptance=prior, prior_steps=steps)
    assert fresh.next_k() == 0  # the default prior (0.7): drafting does not pay on this curve
    assert seeded.next_k() > 0  # the learned one: it drafts from the first step
    again, more = seeded.learned_prior()
    assert again == pytest.approx(prior, abs=0.02) and more == min(steps, 200)  # nothing new learned


def test_prior_acceptance_by_position_is_validated_and_extended():
    policy = AdaptiveDraftLength(max_k=4, prior_acceptance=[0.9, 0.8])
    assert policy.prior == [0.9, 0.8, 0.8, 0.8] and policy.prior_acceptance == 0.9
    for bad in ([], [1.5], -0.1):
        with pytest.raises(ValueError):
            AdaptiveDraftLength(prior_acceptance=bad)


# float32 on a 2-core Xeon with AMX: 2 tokens cost 1.15x one, 4 tokens 1.26x, 16 tokens 1.61x.
XEON_FLOAT32 = {1: 0.248, 2: 0.285, 3: 0.305, 4: 0.312, 8: 0.346, 12: 0.372, 16: 0.400, 17: 0.416}


def lookup_policy():
    from speccli.autok.policy import DraftLengthByMatch
    from speccli.drafters.ngram import LOOKUP_ACCEPTANCE

    policy = DraftLengthByMatch(lambda match: AdaptiveDraftLength(max_k=16, prior_acceptance=LOOKUP_ACCEPTANCE[match]))
    policy.costs.seed(XEON_FLOAT32, None)
    return policy


def copy_and_chat_steps(policy, steps: int = 60) -> dict[int, list[int]]:
    """Steps alternating between a 3-token match whose drafts all come true (copied text)
    and a 1-token match whose drafts never do (chat text): k chosen after each match."""
    chosen: dict[int, list[int]] = {1: [], 3: []}
    for i in range(steps):
        match = 3 if i % 2 else 1
        if hasattr(policy, "expect"):
            policy.expect(match)
        k = policy.next_k()
        chosen[match].append(k)
        policy.observe(step(k, k if match == 3 else 0, 0.0, policy.costs.verify_seconds(k + 1)))
    return chosen


def test_prompt_lookup_keeps_acceptance_apart_by_the_length_of_the_match():
    chosen = copy_and_chat_steps(lookup_policy())
    assert chosen[3][-10:] == [16] * 10  # copied text: the longest draft (17 tokens fed, the largest pass measured)
    # Chat text: plain steps, but for a probe now and then (at least 16 steps apart).
    assert sum(k > 0 for k in chosen[1][-20:]) <= 1 and chosen[1][-20:].count(0) >= 19

    # One acceptance for both (as before): it keeps drafting after the 1-token matches.
    pooled = AdaptiveDraftLength(max_k=16)
    pooled.costs.seed(XEON_FLOAT32, None)
    assert all(k > 0 for k in copy_and_chat_steps(pooled)[1][-20:])


def test_prompt_lookup_without_a_match_steps_plainly_and_learns_only_the_cost():
    policy = lookup_policy()
    policy.expect(0)
    assert policy.next_k() == 0
    policy.observe(step(0, 0, 0.0, 0.5))
    assert policy.costs.verify[1] == pytest.approx(0.7 * 0.248 + 0.3 * 0.5)  # one measurement, blended once
    assert policy.learned() is None  # nothing drafted, nothing to remember
    policy.expect(2)
    assert policy.next_k() > 0  # the prior: drafts after a 2-token match pay on this curve
    assert policy.policy(2).costs is policy.costs


def test_prompt_lookup_expects_tokens_by_the_match_and_learns_without_the_cost():
    policy = lookup_policy()
    policy.expect(0)
    assert policy.expected(3) == 1.0  # nothing to draft without a match
    policy.expect(1)
    after_one = policy.expected(2)
    policy.expect(3)
    assert policy.expected(2) == pytest.approx(expected_tokens(policy.policy(3).acceptance(), 2))
    assert after_one < policy.expected(2)  # a long match's drafts come true more often
    k = policy.next_k()
    policy.learn(step(k, 0, 0.0, 9.9))  # lookahead's gate: the guess's outcome, not the pass's cost
    assert policy.costs.verify == XEON_FLOAT32
    assert policy.policy(3)._tried[0] == 1 and policy.policy(3)._kept[0] == 0


def test_prompt_lookup_remembers_each_match_length_and_all_pooled():
    policy = lookup_policy()
    copy_and_chat_steps(policy, steps=40)
    learned = policy.learned()
    assert [match for match, _ in learned.by_match] == [1, 3]
    one, three = learned.for_match(1), learned.for_match(3)
    assert one.acceptance[0] < 0.1 < 0.9 < three.acceptance[0]
    assert learned.for_match(2) is None
    assert learned.steps == one.steps + three.steps
    assert learned.acceptance[0] == pytest.approx(
        (one.acceptance[0] * one.steps + three.acceptance[0] * three.steps) / learned.steps
    )


# Measured: float32 on a 2-core AMD EPYC with AVX2 only (2026-12-03): a pass over 2 tokens
# costs 1.4x one, then grows slowly; a draft token (int8 0.5B) 45 ms.
AVX2_F32 = {
    1: 0.261,
    2: 0.375,
    3: 0.39,
    4: 0.411,
    5: 0.422,
    6: 0.424,
    7: 0.454,
    8: 0.464,
    9: 0.475,
    10: 0.484,
    11: 0.503,
    12: 0.512,
    13: 0.568,
    14: 0.566,
    15: 0.578,
    16: 0.609,
    17: 0.62,
}


def avx2_policy(**kwargs) -> AdaptiveDraftLength:
    policy = AdaptiveDraftLength(max_k=16, **kwargs)
    policy.costs.seed(AVX2_F32, 0.045)
    return policy


def test_a_rejected_opening_guess_does_not_stop_drafting():
    # The answer's first token is the draft's hardest guess. Counted against every step, one
    # wrong opening guess stopped drafting on this curve (drafting pays only for a good draft).
    for opens in (True, False):
        policy = avx2_policy(prior_acceptance=0.85, prior_steps=200)
        if opens:
            policy.begin()
        k = policy.next_k()
        assert k >= 4
        policy.observe(step(k, 0, 0.045 * k, AVX2_F32[k + 1]))
        assert (policy.next_k() >= 4) if opens else (policy.next_k() == 0)


def test_openings_are_learned_apart_and_left_to_the_next_session_apart():
    policy = avx2_policy(prior_acceptance=0.85, prior_steps=200)
    middle = []
    for _ in range(12):  # generations whose opening guess is always wrong and the rest always right
        policy.begin()
        k = policy.next_k()
        policy.observe(step(k, 0, 0.045 * k, AVX2_F32[k + 1]))
        for _ in range(5):
            k = policy.next_k()
            middle.append(k)
            policy.observe(step(k, k, 0.045 * k, AVX2_F32[k + 1]))
    assert policy.opening_acceptance() < 0.3  # openings stop drafting once it is this low
    later = policy.expected(8)
    policy.begin()
    assert policy.expected(8) < 0.4 * later  # the opening step expects little from its draft
    assert policy.next_k() == 0  # so the opening is a plain step
    assert middle[-5:] == [16] * 5  # while the rest draft as long as the curve lets them
    prior, _ = policy.learned_prior()
    assert prior[0] > 0.87  # above the 0.85 it started from: the openings are left out
    learned = policy.learned()
    assert learned.opening == AcceptancePrior((0.0,), 6)  # the openings drafted (6, then plain), their own rate
    assert learned.acceptance == tuple(prior)

    # The next session opens plain at once, and drafts the rest as this one did.
    following = avx2_policy(
        prior_acceptance=learned.acceptance,
        prior_steps=learned.steps,
        opening_prior=learned.opening.acceptance[0],
        opening_prior_steps=learned.opening.steps,
    )
    following.begin()
    assert following.next_k() == 0
    fresh = avx2_policy(prior_acceptance=learned.acceptance, prior_steps=learned.steps)
    fresh.begin()
    assert fresh.next_k() > 0  # without it, the opening took the first position's rate


def test_an_opening_prior_is_worth_at_most_50_openings_and_only_sessions_that_drafted_leave_one():
    policy = avx2_policy(prior_acceptance=0.85, opening_prior=0.2, opening_prior_steps=400)
    assert policy.learned() is None  # nothing drafted: nothing to leave
    assert policy.learned_opening() == AcceptancePrior((0.2,), 50)
    policy.begin()
    policy.observe(step(4, 4, 0.045 * 4, AVX2_F32[5]))  # an opening, all accepted
    assert policy.learned().opening.acceptance == pytest.approx((11 / 51,)) and policy.learned().opening.steps == 51
    assert policy.learned().steps == 0  # an opening is not one of the drafting steps learned_prior stands for
