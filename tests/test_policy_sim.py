"""k auto against the best fixed k in hindsight, on simulated machines and texts
(tests/policy_sim.py): every cost curve seen so far, acceptance high, low and switching."""

from __future__ import annotations

import pytest

from policy_sim import ACCEPTANCE, CURVES, compare, simulate, text
from speccli.autok.policy import FixedDraftLength

SEEDS = (0, 1, 2)


@pytest.mark.parametrize("acceptance", sorted(ACCEPTANCE))
@pytest.mark.parametrize("curve", sorted(CURVES))
def test_adaptive_reaches_90_percent_of_the_best_fixed_k(curve, acceptance):
    for seed in SEEDS:
        adaptive, k, fixed = compare(CURVES[curve], ACCEPTANCE[acceptance], seed)
        assert adaptive.rate >= 0.9 * fixed.rate, (
            f"{curve}, {acceptance}, seed {seed}: k auto {adaptive.rate:.2f} tok/s, best fixed k={k} {fixed.rate:.2f}"
        )


@pytest.mark.parametrize("curve", sorted(CURVES))
def test_never_below_plain_decoding_by_more_than_the_probe_budget(curve):
    # A draft that is never right: everything drafted is lost, so the only cost is probing.
    never = [(2000, 0.0)]
    outcomes = text(never, 0)
    adaptive, _, _ = compare(CURVES[curve], never)
    plain = simulate(FixedDraftLength(0), CURVES[curve], outcomes)
    assert adaptive.rate >= 0.95 * plain.rate


@pytest.mark.parametrize("curve", sorted(CURVES))
def test_noisy_step_costs(curve):
    # Measured passes vary by 25% from step to step; the policy still keeps up.
    for acceptance in ("high", "low then high"):
        adaptive, k, fixed = compare(CURVES[curve], ACCEPTANCE[acceptance], seed=3, noise=0.25)
        assert adaptive.rate >= 0.9 * fixed.rate


def test_the_jump_curve_drafts_long_where_the_draft_is_good():
    # Issue 15: 404 ms for 1 token, ~1 s for 2 to 17: plain decoding until probes show the
    # draft is good, then drafts of 5 or more.
    adaptive, k, fixed = compare(CURVES["jump"], ACCEPTANCE["high"], seed=0)
    assert k >= 5 and adaptive.drafted / adaptive.steps >= 4
    assert adaptive.rate >= 1.2 * simulate(FixedDraftLength(0), CURVES["jump"], text(ACCEPTANCE["high"], 0)).rate
