"""Telling rounding near-ties from real mismatches (speccli.bench.divergence)."""

from __future__ import annotations

import pytest
import torch

from speccli.bench.divergence import Divergence, classify, first_difference, near_tie_tolerance, ulp


@pytest.mark.parametrize(
    ("value", "dtype", "expected"),
    [
        (16.445, torch.bfloat16, 0.125),  # a bfloat16 logit between 16 and 32 moves in steps of 1/8
        (-16.445, torch.bfloat16, 0.125),
        (31.9, torch.bfloat16, 0.125),
        (32.0, torch.bfloat16, 0.25),
        (1.0, torch.bfloat16, 2.0**-7),
        (16.445, torch.float16, 2.0**-6),
        (16.445, torch.float32, 2.0**-19),
    ],
)
def test_ulp(value, dtype, expected):
    assert ulp(value, dtype) == expected


def test_tolerance_is_two_ulps_of_the_larger_logit_and_zero_in_float32():
    assert near_tie_tolerance(16.375, 15.9, torch.bfloat16) == 0.25
    assert near_tie_tolerance(15.9, 15.8, torch.bfloat16) == 0.125
    assert near_tie_tolerance(16.375, 15.9, torch.float16) == 2.0**-5
    assert near_tie_tolerance(16.375, 16.375, torch.float32) == 0.0


def logits_with(**values: float) -> torch.Tensor:
    logits = torch.zeros(10)
    for name, value in values.items():
        logits[int(name.removeprefix("t"))] = value
    return logits


def test_a_near_tie_and_its_description():
    logits = logits_with(t3=16.375, t4=16.375)
    d = classify(2, [1, 2, 3], [1, 2, 4], logits, torch.bfloat16)
    assert (d.position, d.plain_token, d.spec_token, d.gap, d.tolerance) == (2, 3, 4, 0.0, 0.25)
    assert d.near_tie and d.kind == "near-tie"
    assert d.describe() == "near-tie at token 2 (gap 0.000, bfloat16)"


def test_a_wide_gap_is_a_mismatch():
    d = classify(0, [3], [4], logits_with(t3=17.5, t4=16.2), torch.bfloat16)
    assert d.gap == pytest.approx(1.3, abs=1e-5) and not d.near_tie
    assert d.describe() == "MISMATCH at token 0 (gap 1.300; plain id 3, speculative id 4)"


def test_just_past_the_tolerance_is_a_mismatch():
    assert classify(0, [3], [4], logits_with(t3=16.0, t4=15.75), torch.bfloat16).near_tie  # 0.25: two ulps
    assert not classify(0, [3], [4], logits_with(t3=16.0, t4=15.74), torch.bfloat16).near_tie


def test_float32_makes_every_divergence_a_mismatch():
    d = classify(1, [1, 3], [1, 4], logits_with(t3=5.0, t4=5.0), torch.float32)
    assert d.gap == 0.0 and d.tolerance == 0.0 and not d.near_tie


def test_a_run_that_ended_by_end_of_sequence_stands_for_its_best_end_id():
    logits = logits_with(t7=16.3, t2=16.375, t9=3.0)
    d = classify(2, [5, 6, 7], [5, 6], logits, torch.bfloat16, spec_ended_by=[2, 9])
    assert d.spec_token is None and d.gap == pytest.approx(0.075, abs=1e-5) and d.near_tie


def test_an_unscored_divergence_is_a_mismatch():
    d = classify(2, [5, 6, 7], [5, 6], None, torch.bfloat16)
    assert d.gap is None and not d.near_tie
    assert d.describe() == "MISMATCH at token 2 (plain id 7, speculative ended, not scored)"
    # Ended, but not by end-of-sequence: nothing stands for it.
    assert not classify(2, [5, 6, 7], [5, 6], logits_with(t7=1.0), torch.bfloat16).near_tie


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([5, 6, 7], [5, 6]) == 2


def test_as_dict():
    d = Divergence(4, 3, None, 0.0625, 0.25, "bfloat16")
    assert d.as_dict() == {
        "kind": "near-tie",
        "position": 4,
        "plain_token": 3,
        "speculative_token": None,
        "gap": 0.0625,
        "tolerance": 0.25,
        "dtype": "bfloat16",
    }
