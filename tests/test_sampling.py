"""Tests for speccli.verify: warping, the accept/resample primitives, and the
greedy and sampled verification rules.

The statistical tests check the property speculative sampling exists for: whatever the
draft distribution q, the tokens emitted follow the target distribution p exactly. They
use fixed seeds, so they are deterministic; the harness is also shown to reject wrong
rules (see the "power" tests), so a pass means something.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from speccli.config import SamplingConfig
from speccli.verify import (
    Verdict,
    accept_mask,
    residual_distribution,
    sample,
    verify_greedy,
    verify_sampled,
    warp,
)

PASS_P = 1e-3  # a correct rule must reach at least this p-value
POWER_P = 1e-6  # a wrong rule must fall below this one
VECTOR_DRAWS = 200_000
LOOP_DRAWS = 20_000
LARGEST_BELOW_ONE = 1.0 - 2.0**-24  # the largest float32 torch.rand can return

INF = float("inf")


def cfg(temperature=1.0, top_k=0, top_p=1.0):
    return SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def normalised(values) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float64)
    return (t / t.sum()).float()


# --------------------------------------------------------------------------- chi-square


def fit(counts, probs) -> tuple[float, int]:
    """(chi-square p-value of `counts` against `probs`, number of draws on tokens whose
    probability is zero). Bins with an expected count under 5 are pooled together."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    assert counts.shape == probs.shape
    probs = probs / probs.sum()
    forbidden = int(counts[probs == 0].sum())
    total = counts.sum()
    support = probs > 0
    obs, exp = counts[support], total * probs[support]
    big = exp >= 5
    obs_bins, exp_bins = list(obs[big]), list(exp[big])
    if (~big).any():
        obs_bins.append(obs[~big].sum())
        exp_bins.append(exp[~big].sum())
    if len(obs_bins) < 2:
        return 1.0, forbidden
    # Observed draws on zero-probability tokens are excluded from both sides, so the sums
    # match; a caller must look at `forbidden` separately.
    exp_bins = np.array(exp_bins) * (np.sum(obs_bins) / np.sum(exp_bins))
    return float(stats.chisquare(obs_bins, exp_bins).pvalue), forbidden


def assert_follows(counts, probs, what: str) -> None:
    pvalue, forbidden = fit(counts, probs)
    assert forbidden == 0, f"{what}: {forbidden} draws landed on tokens with probability 0"
    assert pvalue >= PASS_P, f"{what}: chi-square p-value {pvalue:.3g} < {PASS_P}"


def histogram(tokens: torch.Tensor, vocab: int) -> np.ndarray:
    return torch.bincount(tokens.reshape(-1), minlength=vocab).numpy()


# --------------------------------------------------------------------------- warp


class TestWarp:
    @pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
    def test_temperature_is_softmax_of_scaled_logits(self, temperature):
        logits = torch.randn(2, 3, 17, generator=gen(1)) * 4
        probs = warp(logits, cfg(temperature))
        assert probs.shape == logits.shape
        assert probs.dtype == torch.float32
        torch.testing.assert_close(probs, torch.softmax(logits / temperature, dim=-1))

    def test_greedy_config_raises(self):
        with pytest.raises(ValueError):
            warp(torch.zeros(5), SamplingConfig())
        with pytest.raises(ValueError):
            warp(torch.zeros(5), SamplingConfig(temperature=0.0, top_k=3, top_p=0.5))

    @pytest.mark.parametrize("k", [1, 2, 5, 11])
    def test_top_k_keeps_exactly_the_k_best(self, k):
        logits = torch.randn(6, 12, generator=gen(2)) * 3  # continuous: no ties
        probs = warp(logits, cfg(1.3, top_k=k))
        best = torch.topk(logits, k, dim=-1).indices
        expected_support = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, best, True)
        assert torch.equal(probs > 0, expected_support)
        expected = torch.softmax((logits / 1.3).masked_fill(~expected_support, -INF), dim=-1)
        torch.testing.assert_close(probs, expected)

    def test_top_k_one_is_one_hot_argmax(self):
        logits = torch.randn(4, 9, generator=gen(3))
        probs = warp(logits, cfg(0.7, top_k=1))
        assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 9).float())

    @pytest.mark.parametrize("k", [0, 9, 10, 1000])
    def test_top_k_zero_or_at_least_vocab_is_disabled(self, k):
        logits = torch.randn(3, 9, generator=gen(4))
        torch.testing.assert_close(warp(logits, cfg(top_k=k)), torch.softmax(logits, -1))

    def test_top_k_ties_keep_every_token_tied_with_the_kth(self):
        # Observed (and the same as transformers' TopKLogitsWarper): the cut is
        # "score < k-th best score", so every token tied with the k-th best survives and
        # more than k tokens can be kept.
        probs = warp(torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, -2.0]), cfg(top_k=2))
        torch.testing.assert_close(probs, torch.tensor([0.25, 0.25, 0.25, 0.0, 0.25, 0.0]))

    def test_top_k_with_fewer_finite_logits_than_k(self):
        logits = torch.tensor([-INF, 2.0, -INF, -INF, 0.0, -INF])
        probs = warp(logits, cfg(top_k=4))
        torch.testing.assert_close(probs, torch.softmax(logits, -1))
        assert torch.isfinite(probs).all()

    # Probabilities 0.5, 0.2, 0.15, 0.1, 0.05 placed in a shuffled order.
    TOP_P_PROBS = [0.1, 0.5, 0.05, 0.15, 0.2]

    @pytest.mark.parametrize(
        "top_p, kept",
        [
            (1e-6, [1]),
            (0.3, [1]),
            (0.49, [1]),
            (0.51, [1, 4]),
            (0.69, [1, 4]),
            (0.71, [1, 4, 3]),
            (0.84, [1, 4, 3]),
            (0.86, [1, 4, 3, 0]),
            (0.94, [1, 4, 3, 0]),
            (0.96, [1, 4, 3, 0, 2]),
            (0.999, [1, 4, 3, 0, 2]),
        ],
    )
    def test_top_p_keeps_smallest_prefix_reaching_top_p(self, top_p, kept):
        base = torch.tensor(self.TOP_P_PROBS)
        logits = torch.log(base) + 3.0  # a shift must not matter
        probs = warp(logits, cfg(top_p=top_p))
        expected = torch.zeros(5)
        expected[kept] = base[kept] / base[kept].sum()
        torch.testing.assert_close(probs, expected)
        assert (probs[kept] > 0).all()

    @pytest.mark.parametrize("top_p, kept", [(0.25, 1), (0.26, 2), (0.5, 2), (0.75, 3), (0.76, 4)])
    def test_top_p_exact_boundary(self, top_p, kept):
        # Uniform logits give exactly 0.25 each, so the prefix masses 0.25, 0.5, 0.75 are
        # exact: a prefix whose mass equals top_p already "reaches" it (as in
        # transformers' TopPLogitsWarper), so no further token is kept.
        probs = warp(torch.zeros(4), cfg(top_p=top_p))
        assert int((probs > 0).sum()) == kept
        torch.testing.assert_close(probs[probs > 0], torch.full((kept,), 1.0 / kept))

    def test_top_p_always_keeps_the_best_token(self):
        # The best token alone already exceeds any top_p: only it survives, as a one-hot.
        logits = torch.tensor([[0.0, 30.0, 1.0, 2.0], [5.0, 0.0, 0.0, 0.0]])
        probs = warp(logits, cfg(top_p=1e-9))
        assert torch.equal(probs, torch.tensor([[0.0, 1, 0, 0], [1.0, 0, 0, 0]]))

    def test_top_p_ties_keep_exactly_the_prefix_length(self):
        # Observed: with top_p 0.5 over three tied tokens (1/3 each) two are kept,
        # renormalised to 1/2 each; WHICH two depends on torch.sort's tie order and is
        # not part of the contract.
        probs = warp(torch.tensor([1.0, 1.0, 1.0, -30.0]), cfg(top_p=0.5))
        assert int((probs > 0).sum()) == 2
        assert probs[3] == 0
        torch.testing.assert_close(probs[probs > 0], torch.tensor([0.5, 0.5]))

    def test_top_p_matches_float64_reference(self):
        rng = np.random.default_rng(5)
        logits = rng.normal(size=(200, 30)) * rng.uniform(0.3, 4.0, size=(200, 1))
        checked = 0
        for top_p in (0.2, 0.5, 0.8, 0.9, 0.95):
            probs = warp(torch.tensor(logits, dtype=torch.float32), cfg(top_p=top_p)).numpy()
            for row, got in zip(logits, probs):
                full = np.exp(row - row.max())
                full /= full.sum()
                order = np.argsort(-full)
                mass_before = np.cumsum(full[order]) - full[order]
                if np.min(np.abs(mass_before - top_p)) < 1e-4:
                    continue  # too close to the boundary for float32 to be decisive
                keep = order[mass_before < top_p]
                expected = np.zeros_like(full)
                expected[keep] = full[keep] / full[keep].sum()
                np.testing.assert_allclose(got, expected, atol=2e-6, rtol=1e-4)
                checked += 1
        assert checked > 900

    @pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
    @pytest.mark.parametrize("top_k", [0, 1, 5, 50])
    @pytest.mark.parametrize("top_p", [1.0, 0.95, 0.9, 0.5, 0.1])
    def test_matches_transformers_warpers(self, temperature, top_k, top_p):
        lp = pytest.importorskip("transformers.generation.logits_process")
        warpers = [lp.TemperatureLogitsWarper(float(temperature))]
        if top_k:
            warpers.append(lp.TopKLogitsWarper(top_k))
        if top_p < 1.0:
            warpers.append(lp.TopPLogitsWarper(top_p))
        g = gen(1000 + top_k)
        for batch in range(4):
            logits = torch.randn(16, 100, generator=g) * (1.0 + batch)
            scores = logits.clone()
            for w in warpers:
                scores = w(None, scores)
            expected = torch.softmax(scores, dim=-1)
            got = warp(logits, cfg(temperature, top_k=top_k, top_p=top_p))
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
            assert torch.equal(got > 0, expected > 0)

    EXTREME_ROWS = [
        [-INF, 0.0, 1.0, -INF, 2.0, -INF],
        [-INF, -INF, -INF, 7.0, -INF, -INF],  # a single finite logit
        [1e30, -1e30, 0.0, 1e30, 5.0, -INF],
        [3e35, -3e35, 0.0, 1.0, -INF, 2.0],  # stays finite even divided by 1e-3
        [65504.0, -65504.0, 0.0, 1.0, 2.0, 3.0],
        [-1e30, -1e30, -1e30, -1e30, -1e30, -1e30],
        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        [1e-40, -1e-40, 0.0, 1e-30, 0.0, 0.0],
    ]

    @pytest.mark.parametrize(
        "sampling",
        [cfg(), cfg(0.9, top_k=3), cfg(1.0, top_p=0.5), cfg(1.0, top_k=2, top_p=0.9), cfg(1e-3)],
        ids=["plain", "topk", "topp", "both", "cold"],
    )
    def test_no_nan_for_extreme_logits(self, sampling):
        logits = torch.tensor(self.EXTREME_ROWS)
        probs = warp(logits, sampling)
        assert torch.isfinite(probs).all(), probs
        assert (probs >= 0).all()
        torch.testing.assert_close(probs.sum(-1), torch.ones(len(logits)))
        assert (probs[torch.isneginf(logits)] == 0).all()
        assert probs[1, 3] == 1.0
        # Every row must also be drawable.
        sample(probs, gen(6))

    def test_half_precision_logits(self):
        logits = (torch.randn(3, 20, generator=gen(7)) * 5).to(torch.bfloat16)
        probs = warp(logits, cfg(0.8, top_k=7, top_p=0.9))
        assert probs.dtype == torch.float32
        assert torch.isfinite(probs).all()
        torch.testing.assert_close(probs.sum(-1), torch.ones(3))

    @pytest.mark.parametrize("temperature", [1.0, 2.0])
    def test_near_float32_max_logits_at_temperature_at_least_one(self, temperature):
        logits = torch.tensor([[3e38, -3e38, 0.0, 3e38], [-3.4e38, 3.4e38, -INF, 0.0]])
        for sampling in (cfg(temperature), cfg(temperature, top_k=2, top_p=0.7)):
            probs = warp(logits, sampling)
            assert torch.isfinite(probs).all()
            torch.testing.assert_close(probs.sum(-1), torch.ones(2))
            assert probs[1, 1] == 1.0 and probs[0, 1] == 0.0

    def test_finite_logits_that_overflow_under_temperature(self):
        # Dividing by the temperature before subtracting the row max would overflow to inf.
        probs = warp(torch.tensor([3e38, 0.0, 1.0]), cfg(0.5))
        assert torch.equal(probs, torch.tensor([1.0, 0.0, 0.0]))


# --------------------------------------------------------------------------- residual


class TestResidual:
    def test_hand_computed(self):
        p = torch.tensor([0.4, 0.4, 0.2, 0.0])
        q = torch.tensor([0.1, 0.2, 0.3, 0.4])
        # max(0, p - q) = [0.3, 0.2, 0, 0], mass 0.5
        torch.testing.assert_close(residual_distribution(p, q), torch.tensor([0.6, 0.4, 0, 0]))
        p = torch.tensor([0.5, 0.3, 0.2])
        q = torch.tensor([0.2, 0.5, 0.3])
        torch.testing.assert_close(residual_distribution(p, q), torch.tensor([1.0, 0, 0]))

    def test_one_hot_q_removes_the_drafted_token(self):
        p = torch.tensor([0.1, 0.5, 0.15, 0.25])
        q = torch.tensor([0.0, 1.0, 0.0, 0.0])
        torch.testing.assert_close(residual_distribution(p, q), torch.tensor([0.2, 0, 0.3, 0.5]))

    def test_equal_p_and_q_gives_p(self):
        p = normalised([3, 0, 1, 5, 0, 2])
        out = residual_distribution(p, p.clone())
        assert torch.isfinite(out).all()
        assert torch.equal(out, p)

    def test_q_dominating_everywhere_gives_p(self):
        # Not a distribution pair, but the fallback must still be p rather than NaN.
        p = normalised([1, 2, 3])
        out = residual_distribution(p, torch.ones(3))
        assert torch.equal(out, p)

    def test_disjoint_supports_give_p(self):
        p = normalised([2, 3, 5, 0, 0, 0])
        q = normalised([0, 0, 0, 1, 1, 2])
        torch.testing.assert_close(residual_distribution(p, q), p)

    def test_batched_rows_are_independent(self):
        g = gen(8)
        p = torch.rand(2, 3, 7, generator=g) ** 2
        q = torch.rand(2, 3, 7, generator=g) ** 2
        p[1, 2, :3] = 0.0  # zeros in p
        q[0, 2, 4:] = 0.0  # zeros in q
        p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
        p[0, 1] = q[0, 1]  # one row with p == q
        out = residual_distribution(p, q)
        assert out.shape == (2, 3, 7)
        for i in range(2):
            for j in range(3):
                torch.testing.assert_close(out[i, j], residual_distribution(p[i, j], q[i, j]))
        torch.testing.assert_close(out[0, 1], p[0, 1])
        torch.testing.assert_close(out.sum(-1), torch.ones(2, 3))
        assert (out >= 0).all()

    def test_float64(self):
        p = torch.tensor([0.4, 0.4, 0.2, 0.0], dtype=torch.float64)
        q = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
        out = residual_distribution(p, q)
        assert out.dtype == torch.float64
        torch.testing.assert_close(out, torch.tensor([0.6, 0.4, 0, 0], dtype=torch.float64))


# --------------------------------------------------------------------------- accept_mask


UNIFORMS = torch.tensor([0.0, 1e-30, 1e-7, 0.25, 0.5, 0.75, 0.999999, LARGEST_BELOW_ONE])


class TestAcceptMask:
    def test_q_zero_p_positive_always_accepts(self):
        p = torch.tensor([1e-30, 1e-7, 0.3, 1.0])
        u, pp = torch.meshgrid(UNIFORMS, p, indexing="ij")
        assert accept_mask(pp, torch.zeros_like(pp), u).all()

    def test_p_zero_never_accepts(self):
        q = torch.tensor([0.0, 1e-30, 0.3, 1.0])
        u, qq = torch.meshgrid(UNIFORMS, q, indexing="ij")
        assert not accept_mask(torch.zeros_like(qq), qq, u).any()

    def test_p_at_least_q_always_accepts(self):
        q = torch.rand(1000, generator=gen(9)) * torch.logspace(-30, 0, 1000)
        q = q.clamp_min(1e-30)
        u = torch.cat([UNIFORMS, torch.rand(992, generator=gen(10))])
        assert accept_mask(q, q, u).all()
        assert accept_mask(q * 1.5, q, u).all()
        assert accept_mask(torch.ones_like(q), q, u).all()
        u_max = torch.full_like(q, LARGEST_BELOW_ONE)
        assert accept_mask(q, q, u_max).all()

    def test_accepts_iff_u_below_ratio(self):
        p = torch.tensor([0.1, 0.2, 0.3])
        q = torch.tensor([0.4, 0.4, 0.6])  # ratios 0.25, 0.5, 0.5
        assert accept_mask(p, q, torch.tensor([0.24, 0.49, 0.49])).tolist() == [True] * 3
        assert accept_mask(p, q, torch.tensor([0.26, 0.51, 0.51])).tolist() == [False] * 3

    def test_broadcasts_over_batch_dims(self):
        out = accept_mask(torch.full((2, 3), 0.5), torch.full((2, 3), 1.0), torch.full((2, 3), 0.4))
        assert out.shape == (2, 3) and out.dtype == torch.bool and out.all()


# --------------------------------------------------------------------------- verify_greedy


def logits_with_argmax(best: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.randn(len(best), vocab, generator=gen(11))
    logits[torch.arange(len(best)), torch.tensor(best)] = 10.0
    return logits


class TestVerifyGreedy:
    def test_all_accepted_gives_bonus_from_last_row(self):
        logits = logits_with_argmax([3, 1, 4, 7])
        verdict = verify_greedy(logits, torch.tensor([3, 1, 4]))
        assert verdict == Verdict.chain(3, 7, drafted=3)
        assert verdict.path == [0, 1, 2] and not verdict.resampled  # a bonus
        assert isinstance(verdict.accepted, int) and isinstance(verdict.next_token, int)

    @pytest.mark.parametrize(
        "draft, expected",
        [
            ([0, 1, 4], Verdict.chain(0, 3, drafted=3)),
            ([3, 2, 4], Verdict.chain(1, 1, drafted=3)),
            ([3, 1, 5], Verdict.chain(2, 4, drafted=3)),
            ([3, 2, 9], Verdict.chain(1, 1, drafted=3)),  # the first mismatch wins
            ([9, 9, 9], Verdict.chain(0, 3, drafted=3)),
        ],
    )
    def test_first_mismatch(self, draft, expected):
        verdict = verify_greedy(logits_with_argmax([3, 1, 4, 7]), torch.tensor(draft))
        assert verdict == expected
        assert verdict.resampled

    def test_zero_length_draft(self):
        verdict = verify_greedy(logits_with_argmax([6]), torch.zeros(0, dtype=torch.long))
        assert verdict == Verdict.chain(0, 6, drafted=0)
        assert verdict.path == [] and not verdict.resampled

    def test_ties_resolve_to_the_first_index(self):
        # Observed (torch.argmax): a draft token tied for the max but not the first such
        # index is rejected, and the first index is emitted.
        logits = torch.tensor([[0.0, 5.0, 5.0], [1.0, 0.0, 0.0]])
        assert verify_greedy(logits, torch.tensor([2])) == Verdict.chain(0, 1, drafted=1)
        assert verify_greedy(logits, torch.tensor([1])) == Verdict.chain(1, 0, drafted=1)


# --------------------------------------------------------------------------- the rule, vectorised


def draw_drafts(q: torch.Tensor, n: int, g: torch.Generator) -> torch.Tensor:
    return sample(q.expand(n, -1), g)


def correct_rule(x, p, q, g):
    u = torch.rand(x.shape, generator=g)
    accepted = accept_mask(p[x], q[x], u)
    out = x.clone()
    rejected = (~accepted).nonzero().squeeze(-1)
    if rejected.numel():
        m = rejected.numel()
        out[rejected] = sample(residual_distribution(p.expand(m, -1), q.expand(m, -1)), g)
    return out


def always_accept_rule(x, p, q, g):
    return x


def resample_from_p_rule(x, p, q, g):
    u = torch.rand(x.shape, generator=g)
    accepted = accept_mask(p[x], q[x], u)
    out = x.clone()
    rejected = (~accepted).nonzero().squeeze(-1)
    out[rejected] = sample(p.expand(rejected.numel(), -1), g)
    return out


def inverted_ratio_rule(x, p, q, g):
    """Accepts with min(1, q/p) instead of min(1, p/q)."""
    u = torch.rand(x.shape, generator=g)
    accepted = accept_mask(q[x], p[x], u)
    out = x.clone()
    rejected = (~accepted).nonzero().squeeze(-1)
    if rejected.numel():
        m = rejected.numel()
        out[rejected] = sample(residual_distribution(p.expand(m, -1), q.expand(m, -1)), g)
    return out


def ignore_q_rule(x, p, q, g):
    """Treats a stochastic drafter as one-hot (as if verify_sampled got q=None). This is
    still lossless, only less efficient: the one-hot rule is exact for any fixed x."""
    u = torch.rand(x.shape, generator=g)
    accepted = accept_mask(p[x], torch.ones_like(p[x]), u)
    out = x.clone()
    rejected = (~accepted).nonzero().squeeze(-1)
    if rejected.numel():
        one_hot = torch.nn.functional.one_hot(x[rejected], p.shape[-1]).to(p.dtype)
        out[rejected] = sample(residual_distribution(p.expand(len(rejected), -1), one_hot), g)
    return out


def run_rule(rule, p, q, seed, n=VECTOR_DRAWS) -> np.ndarray:
    g = gen(seed)
    x = draw_drafts(q, n, g)
    return histogram(rule(x, p, q, g), p.shape[-1])


def dirichlet_pair(vocab, alpha, seed):
    pq = np.random.default_rng(seed).dirichlet(np.full(vocab, alpha), size=2)
    pq = torch.tensor(pq, dtype=torch.float32)
    pq = pq / pq.sum(-1, keepdim=True)
    return pq[0], pq[1]


def warped_pair():
    g = gen(12)
    base = torch.randn(40, generator=g) * 2
    target = base + torch.randn(40, generator=g) * 0.8
    draft = base + torch.randn(40, generator=g) * 0.8
    sampling = cfg(0.7, top_k=20, top_p=0.9)
    return warp(target, sampling), warp(draft, sampling)


CASES = {
    "zeros_in_p": (
        normalised([30, 20, 0, 15, 0, 25, 10, 0]),
        normalised([10, 10, 20, 10, 15, 10, 10, 15]),
    ),
    "zeros_in_q": (
        normalised([5, 10, 15, 20, 5, 10, 15, 5, 10, 5]),
        normalised([0, 40, 0, 10, 30, 0, 0, 20, 0, 0]),
    ),
    "p_equals_q": (
        normalised([1, 2, 3, 4, 5, 6, 0, 7, 8, 9, 10, 11]),
        normalised([1, 2, 3, 4, 5, 6, 0, 7, 8, 9, 10, 11]),
    ),
    "disjoint": (
        normalised([1, 2, 3, 4, 5, 0, 0, 0, 0, 0]),
        normalised([0, 0, 0, 0, 0, 5, 4, 3, 2, 1]),
    ),
    "one_hot_q_dense": (
        normalised([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]),
        normalised([0] * 5 + [1] + [0] * 10),
    ),
    "dirichlet": dirichlet_pair(50, 0.5, 13),
    "warped": warped_pair(),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rule_outputs_follow_p(case):
    p, q = CASES[case]
    assert p.shape == q.shape and 8 <= p.shape[-1] <= 50
    torch.testing.assert_close(p.sum(), torch.tensor(1.0))
    torch.testing.assert_close(q.sum(), torch.tensor(1.0))
    counts = run_rule(correct_rule, p, q, seed=100 + len(case))
    assert counts.sum() == VECTOR_DRAWS
    assert_follows(counts, p, case)


def test_cases_are_what_they_claim():
    p, q = CASES["zeros_in_q"]
    assert ((q == 0) & (p > 0)).any()
    p, q = CASES["zeros_in_p"]
    assert ((p == 0) & (q > 0)).any()
    p, q = CASES["disjoint"]
    assert not ((p > 0) & (q > 0)).any()
    p, q = CASES["warped"]
    assert (p == 0).any() and (q == 0).any() and not torch.equal(p > 0, q > 0)


# A full-support pair on which all three wrong rules give visibly different outputs.
POWER_P_DIST = normalised([40, 25, 15, 10, 4, 3, 2, 1])
POWER_Q_DIST = normalised([5, 10, 15, 20, 20, 10, 10, 10])


def test_one_hot_rule_is_lossless_for_any_drafter():
    p, q = CASES["dirichlet"]
    assert_follows(run_rule(ignore_q_rule, p, q, seed=150), p, "one-hot rule on a random draft")


@pytest.mark.parametrize("rule", [always_accept_rule, resample_from_p_rule, inverted_ratio_rule])
def test_harness_rejects_wrong_rules(rule):
    counts = run_rule(rule, POWER_P_DIST, POWER_Q_DIST, seed=200)
    pvalue, forbidden = fit(counts, POWER_P_DIST)
    assert forbidden == 0  # full support: the chi-square alone has to catch it
    assert pvalue < POWER_P, f"{rule.__name__} not rejected (p-value {pvalue:.3g})"
    # ... while the correct rule passes on the very same pair.
    assert_follows(run_rule(correct_rule, POWER_P_DIST, POWER_Q_DIST, seed=200), POWER_P_DIST, "power")


def test_harness_catches_draws_on_zero_probability_tokens():
    p, q = CASES["zeros_in_p"]
    _, forbidden = fit(run_rule(always_accept_rule, p, q, seed=201), p)
    assert forbidden > 0
    with pytest.raises(AssertionError, match="probability 0"):
        assert_follows(run_rule(always_accept_rule, p, q, seed=201), p, "always accept")


# --------------------------------------------------------------------------- verify_sampled


def as_verdicts(p, drafts, q, seed):
    g = gen(seed)
    return [verify_sampled(p, d, q, g) for d in drafts]


class TestVerifySampledBasics:
    def test_deterministic_under_a_seed(self):
        p = torch.softmax(torch.randn(4, 9, generator=gen(14)), -1)
        q = torch.softmax(torch.randn(3, 9, generator=gen(15)), -1)
        drafts = sample(q.expand(50, 3, 9), gen(16))
        assert as_verdicts(p, drafts, q, 17) == as_verdicts(p, drafts, q, 17)

    def test_zero_length_draft_samples_from_first_row(self):
        p = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
        empty = torch.zeros(0, dtype=torch.long)
        for q in (None, torch.zeros(0, 4)):
            assert verify_sampled(p, empty, q, gen(18)) == Verdict.chain(0, 2, drafted=0)

    def test_target_certain_of_draft_always_accepts(self):
        p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
        q = torch.tensor([[0.3, 0.4, 0.3], [0.0, 0.1, 0.9]])
        g = gen(19)
        for _ in range(200):
            assert verify_sampled(p, torch.tensor([1, 2]), q, g) == Verdict.chain(2, 0, drafted=2)
            assert verify_sampled(p, torch.tensor([1, 2]), None, g) == Verdict.chain(2, 0, drafted=2)

    def test_target_zero_on_draft_never_accepts(self):
        p = torch.tensor([[0.5, 0.0, 0.5], [0.2, 0.3, 0.5]])
        q = torch.tensor([[0.1, 0.8, 0.1]])
        g = gen(20)
        for qq in (q, None):
            for _ in range(200):
                verdict = verify_sampled(p, torch.tensor([1]), qq, g)
                assert verdict.accepted == 0 and verdict.next_token in (0, 2)

    def test_draft_with_zero_draft_probability_is_accepted_when_p_positive(self):
        p = torch.tensor([[0.2, 0.8], [1.0, 0.0]])
        q = torch.tensor([[1.0, 0.0]])
        g = gen(21)
        assert all(verify_sampled(p, torch.tensor([1]), q, g) == Verdict.chain(1, 0, drafted=1) for _ in range(200))


@pytest.mark.parametrize("case, seed", [("zeros_in_q", 300), ("dirichlet", 301)])
def test_verify_sampled_single_token_follows_p(case, seed):
    p0, q0 = CASES[case]
    vocab = p0.shape[-1]
    bonus_dist = torch.flip(p0, dims=[0])  # a different row for the bonus token
    p = torch.stack([p0, bonus_dist])
    q = q0[None]
    g = gen(seed)
    drafts = draw_drafts(q0, LOOP_DRAWS, g)
    first, bonus = [], []
    for x in drafts:
        verdict = verify_sampled(p, x.reshape(1), q, g)
        assert verdict.accepted in (0, 1)
        if verdict.accepted:
            first.append(int(x))
            bonus.append(verdict.next_token)
        else:
            # Rejection implies p(x) < q(x), so the residual has no mass on x.
            assert verdict.next_token != int(x)
            first.append(verdict.next_token)
    assert_follows(histogram(torch.tensor(first), vocab), p0, f"{case} first token")
    assert_follows(histogram(torch.tensor(bonus), vocab), bonus_dist, f"{case} bonus token")
    alpha = float(torch.minimum(p0, q0).sum())
    binom = stats.binomtest(len(bonus), LOOP_DRAWS, alpha)
    assert binom.pvalue >= PASS_P, (len(bonus) / LOOP_DRAWS, alpha)


def test_verify_sampled_one_hot_multi_token_joint_distribution():
    """q=None: a deterministic drafter proposed d. Treat p[i] as the target's conditional
    at position i given the drafted prefix; the emitted (accepted, next_token) outcome
    must then have exactly the target's own joint probability."""
    vocab, draft = 8, [2, 5, 1]
    p = torch.stack(
        [
            normalised([5, 5, 60, 10, 0, 10, 5, 5]),
            normalised([10, 0, 5, 5, 5, 65, 5, 5]),
            normalised([0, 55, 10, 10, 5, 5, 10, 5]),
            normalised([20, 10, 10, 20, 10, 10, 10, 10]),
        ]
    )
    n = len(draft)
    expected = np.zeros((n + 1, vocab))
    prefix = 1.0
    for j in range(n + 1):
        row = p[j].double().numpy()
        expected[j] = prefix * row
        if j < n:
            expected[j, draft[j]] = 0.0  # a rejection never re-emits the drafted token
            prefix *= row[draft[j]]
    assert math.isclose(expected.sum(), 1.0, rel_tol=1e-6)

    g = gen(400)
    d = torch.tensor(draft)
    counts = np.zeros((n + 1, vocab))
    for _ in range(LOOP_DRAWS):
        verdict = verify_sampled(p, d, None, g)
        counts[verdict.accepted, verdict.next_token] += 1
    assert_follows(counts, expected, "one-hot joint")
    # Expected counts in the deepest category are large enough to be tested unpooled.
    assert expected[n].sum() * LOOP_DRAWS > 2000


def acceptance_theory(alphas: list[float]) -> np.ndarray:
    """P(accepted == j) when draft position i survives independently with alphas[i]."""
    n = len(alphas)
    theory, prefix = np.zeros(n + 1), 1.0
    for j, a in enumerate(alphas):
        theory[j] = prefix * (1 - a)
        prefix *= a
    theory[n] = prefix
    return theory


def run_multi_token(p, q, seed):
    """verify_sampled on LOOP_DRAWS drafts drawn row by row from q; returns the
    histogram of `accepted` and, per output position, the tokens emitted there."""
    n, vocab = q.shape
    g = gen(seed)
    drafts = sample(q.expand(LOOP_DRAWS, n, vocab), g)
    accepted = np.zeros(n + 1)
    by_position = [[] for _ in range(n + 1)]
    for d in drafts:
        verdict = verify_sampled(p, d, q, g)
        accepted[verdict.accepted] += 1
        emitted = d[: verdict.accepted].tolist() + [verdict.next_token]
        for i, token in enumerate(emitted):
            by_position[i].append(token)
    return accepted, by_position


def test_verify_sampled_multi_token_acceptance_counts():
    """i.i.d. rows: every draft position has the same p and q, so the number accepted is
    a truncated geometric with per-token acceptance alpha = sum(min(p, q)), and each
    emitted token, wherever it exists, is distributed as p."""
    vocab, n = 20, 4
    p0, q0 = dirichlet_pair(vocab, 1.0, 22)
    alpha = float(torch.minimum(p0, q0).sum())
    assert 0.4 < alpha < 0.9
    p = p0.expand(n + 1, -1).contiguous()
    q = q0.expand(n, -1).contiguous()
    accepted, by_position = run_multi_token(p, q, seed=500)
    theory = acceptance_theory([alpha] * n)
    np.testing.assert_allclose(theory, [alpha**j * (1 - alpha) for j in range(n)] + [alpha**n])
    pvalue, forbidden = fit(accepted, theory)
    assert forbidden == 0 and pvalue >= PASS_P, (accepted / LOOP_DRAWS, theory)
    # P(accepted >= 1) = alpha
    assert stats.binomtest(int(accepted[1:].sum()), LOOP_DRAWS, alpha).pvalue >= PASS_P
    for i, tokens in enumerate(by_position):
        assert_follows(histogram(torch.tensor(tokens), vocab), p0, f"position {i}")
    # The same acceptance-count test must reject a slightly wrong alpha.
    assert fit(accepted, acceptance_theory([alpha - 0.02] * n))[0] < POWER_P


def test_verify_sampled_multi_token_distinct_rows():
    """Every position with its own p[i] and q[i] (zeros in both): position i survives
    with alpha_i = sum(min(p[i], q[i])), and the token emitted at position i, wherever
    it exists, follows p[i]. Catches mixing up rows (e.g. the residual of the wrong q)."""
    vocab, n = 12, 3
    rows = [dirichlet_pair(vocab, 0.8, 600 + i) for i in range(n + 1)]
    p = torch.stack([r[0] for r in rows])
    q = torch.stack([r[1] for r in rows[:n]])
    p[0, :3] = 0.0
    q[1, 5:8] = 0.0
    p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
    alphas = [float(torch.minimum(p[i], q[i]).sum()) for i in range(n)]
    accepted, by_position = run_multi_token(p, q, seed=601)
    assert_follows(accepted, acceptance_theory(alphas), "accepted counts")
    for i, tokens in enumerate(by_position):
        assert_follows(histogram(torch.tensor(tokens), vocab), p[i], f"position {i}")
