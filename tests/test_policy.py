"""The draft-length policies: fixed, and adaptive by expected tokens per second."""

from __future__ import annotations

import pytest

from speccli.config import SpecConfig, parse_draft_length
from speccli.engine.events import StepEvent
from speccli.engine.policy import AdaptiveDraftLength, FixedDraftLength, StepCosts, expected_tokens


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


def test_step_costs_smooth_new_measurements():
    costs = StepCosts(smoothing=0.5)
    costs.observe(step(0, 0, 0.0, 1.0))
    costs.observe(step(0, 0, 0.0, 3.0))
    assert costs.verify_seconds(1) == 2.0


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
    assert 1 in chosen[-40:]  # it still probes now and then


def test_verify_cost_growth_limits_k():
    # Verifying costs 0.2 s up to 3 tokens and doubles past that (as float32 on a CPU);
    # drafts are free and always right: 2 drafted tokens (3 fed) are the sweet spot.
    policy = AdaptiveDraftLength(max_k=8)
    chosen = train(policy, acceptance=1.0, verify=lambda n: 0.2 if n <= 3 else 0.4 + 0.1 * n, draft_per_token=0.0, steps=80)
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
