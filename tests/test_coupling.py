"""Coupled sampling (speccli.coupling): with a seed, the noise of output position t
depends on (seed, t) only; the output is the target's own Gumbel-max sample for that seed,
whatever the drafter, k or timing, and it is distributed exactly as the target's."""

from __future__ import annotations

import collections

import pytest
import torch
from scipy.stats import chisquare, gumbel_r, kstest

import speccli.coupling as coupling
from conftest import wrap
from speccli.api import Speculator
from speccli.config import SamplingConfig, SpecConfig
from speccli.coupling import (
    PositionNoise,
    coupled,
    gumbel_argmax,
    gumbel_noise,
    position_seed,
)
from speccli.drafters.model import ModelDrafter
from speccli.drafters.ngram import PromptLookupDrafter
from speccli.events import Provenance, StepEvent, TokenEvent
from speccli.loop import SpeculativeDecoder
from speccli.verify import Verdict, verify_coupled, warp
from test_decoder_sampling import (
    CONTINUATION,
    assert_follows,
    chi_square_pvalue_lenient,
    continuation_counts,
    exact_continuation_distribution,
    small_pair,  # noqa: F401 - a fixture: the same enumerable pair as the rejection rule's test
)

# --------------------------------------------------------------------------- the noise


def test_noise_is_a_function_of_seed_and_position_only():
    first = [gumbel_noise(7, t, 50) for t in range(6)]
    # Any order, any cache, any other draws in between: the same noise.
    torch.rand(1000)
    noise = PositionNoise(7, 50)
    assert all(torch.equal(noise(t), first[t]) for t in (5, 0, 3, 1, 4, 2))
    assert torch.equal(noise.rows(2, 3), torch.stack(first[2:5]))
    assert torch.equal(noise.from_position(3)(1), first[4])
    noise.forget_before(4)
    assert torch.equal(noise(3), first[3])
    # Different positions and seeds differ; seeds outside 64 bits and negative seeds work.
    assert len({tuple(n.tolist()) for n in first}) == 6
    assert not torch.equal(gumbel_noise(8, 0, 50), first[0])
    for seed in (-1, 2**70, 0):
        assert torch.isfinite(gumbel_noise(seed, 3, 50)).all()
    assert position_seed(1, 0) != position_seed(0, 1) != position_seed(1, 1)
    assert gumbel_noise(7, 0, 50).dtype == torch.float32


def test_noise_is_standard_gumbel():
    draws = torch.cat([gumbel_noise(11, t, 10) for t in range(20_000)]).double().numpy()
    assert kstest(draws, gumbel_r.cdf).pvalue >= 1e-3
    # The test has power: a shift of 0.02 is rejected.
    assert kstest(draws, gumbel_r(loc=0.02).cdf).pvalue < 1e-6


def test_gumbel_argmax_samples_exactly_and_never_picks_a_zero():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, 3.0, -2.0, 0.0])
    sampling = SamplingConfig(temperature=0.9, top_k=5, top_p=0.95)
    p = warp(logits, sampling)
    assert (p == 0).sum() >= 3  # top-k and top-p removed tokens
    draws = 20_000
    tokens = torch.stack([gumbel_argmax(p, gumbel_noise(3, t, len(p))) for t in range(draws)])
    counts = torch.bincount(tokens, minlength=len(p))
    assert counts[p == 0].sum() == 0
    kept = p > 0
    expected = p[kept].double() / p[kept].double().sum()
    assert chisquare(counts[kept].double().numpy(), (expected * draws).numpy()).pvalue >= 1e-3
    # The test has power: a distribution 10% off is rejected.
    off = expected * torch.linspace(0.9, 1.1, int(kept.sum()), dtype=torch.float64)
    assert chisquare(counts[kept].double().numpy(), (off / off.sum() * draws).numpy()).pvalue < 1e-6


def test_verify_coupled_is_the_targets_gumbel_max_token_at_each_position():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.8, 0.0], [0.25, 0.25, 0.25, 0.25]])
    zero = torch.zeros(3, 4)
    # Zero noise: the target's token is its argmax at each row.
    assert verify_coupled(p, torch.tensor([0, 2]), zero) == Verdict.chain(2, 0, drafted=2)  # both survive, bonus
    assert verify_coupled(p, torch.tensor([0, 1]), zero) == Verdict.chain(
        1, 2, drafted=2
    )  # second rejected: target's own
    assert verify_coupled(p, torch.tensor([1, 2]), zero) == Verdict.chain(0, 0, drafted=2)
    assert verify_coupled(p[:1], torch.tensor([], dtype=torch.long), zero[:1]) == Verdict.chain(0, 0, drafted=0)
    # Noise moves the target's token; a zero of p stays impossible whatever the noise.
    noise = torch.tensor([[0.0, 5.0, 0.0, 100.0], [0.0, 0.0, 0.0, 100.0], [0.0, 0.0, 9.0, 0.0]])
    assert verify_coupled(p, torch.tensor([1, 2]), noise) == Verdict.chain(2, 2, drafted=2)
    assert verify_coupled(p, torch.tensor([0, 2]), noise) == Verdict.chain(0, 1, drafted=2)


def test_the_rule_follows_the_seed():
    assert coupled(SamplingConfig(temperature=0.8, seed=0))
    assert not coupled(SamplingConfig(temperature=0.8))  # no seed: rejection sampling
    assert not coupled(SamplingConfig(temperature=0.0, seed=3))  # greedy is unchanged


# --------------------------------------------------------------------------- the decoder

PROMPT = "def fib(n):\n    "
SEEDS = range(20)


def sampling_for(seed: int) -> SamplingConfig:
    # Plain temperature, and top-k with top-p, in turn.
    if seed % 2:
        return SamplingConfig(temperature=1.0, top_k=20, top_p=0.9, seed=seed)
    return SamplingConfig(temperature=0.8, seed=seed)


def outputs_by_method(generator: Speculator, model_drafter: ModelDrafter, prompt: list[int], sampling, max_new: int):
    """token ids of one seeded generation by each method, 'auto' twice in a row."""
    out = {}
    spec = lambda k, tree=False: SpecConfig(k=k, max_new_tokens=max_new, tree=tree)  # noqa: E731
    out["plain"] = generator.stream(prompt, sampling, spec(4), plain=True).run().token_ids
    generator.use_drafter(model_drafter)
    stats = {}
    for k in (1, 4, "auto", "auto again"):
        generation = generator.stream(prompt, sampling, spec(k.split()[0] if isinstance(k, str) else k)).run()
        out[f"k={k}"] = generation.token_ids
        stats[k] = generation.stats
    # Trees: each depth's candidates ranked by that position's noise, verified by it.
    for k in (4, "auto"):
        generation = generator.stream(prompt, sampling, spec(k, tree=True)).run()
        out[f"tree k={k}"] = generation.token_ids
        stats[f"tree {k}"] = generation.stats
    generator.use_drafter(PromptLookupDrafter())
    out["ngram"] = generator.stream(prompt, sampling, spec("auto")).run().token_ids
    out["ngram tree"] = generator.stream(prompt, sampling, spec(4, tree=True)).run().token_ids
    return out, stats


@pytest.mark.parametrize("pair_index, seeds", [(0, SEEDS), (1, range(5))], ids=["close-draft", "unrelated-draft"])
def test_a_seed_gives_the_targets_own_sample_whatever_the_drafter_and_k(pairs, tokenizer, pair_index, seeds):
    pair = pairs[pair_index]
    prompt = tokenizer(PROMPT)["input_ids"]
    generator = Speculator.over(wrap(pair.target), tokenizer, [2])
    model_drafter = ModelDrafter(wrap(pair.draft), len(tokenizer))
    accepted = 0
    for seed in seeds:
        sampling = sampling_for(seed)
        out, stats = outputs_by_method(generator, model_drafter, prompt, sampling, max_new=16)
        assert len(set(map(tuple, out.values()))) == 1, (seed, out)
        accepted += sum(s.accepted for s in stats.values())
    if pair_index == 0:
        assert accepted > 0  # drafts were accepted, not only the target's own tokens emitted
    # Different seeds give different samples.
    firsts = {
        tuple(generator.stream(prompt, sampling_for(s), SpecConfig(max_new_tokens=8), plain=True).run().token_ids)
        for s in seeds
    }
    assert len(firsts) > len(seeds) // 2


def test_without_a_seed_samples_differ(pairs, tokenizer):
    pair = pairs[0]
    prompt = tokenizer(PROMPT)["input_ids"]
    generator = Speculator.over(wrap(pair.target), tokenizer, [2], ModelDrafter(wrap(pair.draft), len(tokenizer)))
    sampling = SamplingConfig(temperature=1.0)
    texts = {
        tuple(generator.stream(prompt, sampling, SpecConfig(k=4, max_new_tokens=16)).run().token_ids) for _ in range(4)
    }
    assert len(texts) > 1


def test_provenance_and_noise_kept_per_position(pairs, tokenizer):
    """Accepted drafts, rejections (the target's own token) and bonus tokens all occur,
    and the decoder keeps only the noise of unsettled positions."""
    pair = pairs[0]
    prompt = tokenizer(PROMPT)["input_ids"]
    decoder = SpeculativeDecoder(wrap(pair.target), tokenizer, [], ModelDrafter(wrap(pair.draft), len(tokenizer)))
    provenances = collections.Counter()
    for seed in range(6):
        events = list(
            decoder.generate(prompt, SamplingConfig(temperature=1.0, seed=seed), SpecConfig(k=3, max_new_tokens=20))
        )
        provenances.update(e.provenance for e in events if isinstance(e, TokenEvent))
        assert sum(e.drafted for e in events if isinstance(e, StepEvent)) > 0
    assert {Provenance.ACCEPTED, Provenance.RESAMPLED, Provenance.BONUS} <= set(provenances)


# --------------------------------------------------------------------------- exactness over seeds

DRAWS = 2000
WRONG_DRAWS = 400


@pytest.mark.slow
def test_coupled_samples_over_seeds_follow_the_exact_target_distribution(small_pair, monkeypatch):
    tokenizer, target, draft = small_pair
    vocab = len(tokenizer)
    prompt = tokenizer("abc", add_special_tokens=False)["input_ids"]
    decoder = SpeculativeDecoder(wrap(target), tokenizer, [], ModelDrafter(wrap(draft), vocab))
    sampling = SamplingConfig(temperature=0.7, top_k=6, top_p=0.9)
    counts, provenances = continuation_counts(decoder, prompt, sampling, DRAWS, 0, vocab)
    assert {Provenance.ACCEPTED, Provenance.RESAMPLED, Provenance.BONUS} <= set(provenances)
    exact = exact_continuation_distribution(target, prompt, sampling)
    assert_follows(counts, exact, vocab)
    # The test has power: the same draws are clearly not the draft's distribution ...
    assert chi_square_pvalue_lenient(counts, exact_continuation_distribution(draft, prompt, sampling)) < 1e-6
    # ... and a wrong coupling (every position drawing the same noise, so that its tokens
    # are correlated) is rejected from far fewer draws.
    original = coupling.position_seed
    monkeypatch.setattr(coupling, "position_seed", lambda seed, position: original(seed, 0))
    wrong, _ = continuation_counts(decoder, prompt, sampling, WRONG_DRAWS, 10**6, vocab)
    assert chi_square_pvalue_lenient(wrong, exact) < 1e-6
