"""Speculative sampling draws continuations exactly as the target does (chi-square against
the distribution computed by enumeration), and its caches roll back exactly."""

from __future__ import annotations

import collections
import functools
import itertools

import pytest
import torch
from scipy.stats import chisquare
from transformers import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import speccli.loop as decoder_module
import speccli.verify as sampling_module
from conftest import char_tokenizer, perturbed_copy, tiny_llama, wrap, wrap_static
from speccli.config import SamplingConfig, SpecConfig
from speccli.drafters.model import ModelDrafter
from speccli.events import Provenance, StepEvent, TokenEvent
from speccli.loop import SpeculativeDecoder

ALPHABET = "abcdefghijklm"  # 13 characters + 3 special tokens: a vocabulary of 16
CONTINUATION = 3
# Enough for the checks below to reject each of these wrong decoders by far (t1, one run of
# 8000 draws; the first-token / first-two-tokens / joint p-values): the residual drawn from
# p instead of norm(max(0, p - q)) 1e-76 / 1e-115 / 1e-10; q taken from the next draft
# position 0 / 0 / 1e-50; the bonus token drawn from the last draft position's row
# 0.14 / 0.82 / 3e-25. The marginals find a wrong rule at a step from far fewer draws than
# the joint, whose mass is spread over vocab**3 bins; the joint finds what happens later.
DRAWS = 6_000
# Draft chains drafted on the device (StaticCausalLM.chain), drawn by inverting q's distribution.
wrap_chains = functools.partial(wrap_static, device_chains=True)


def exact_continuation_distribution(model, prompt: list[int], sampling: SamplingConfig) -> torch.Tensor:
    """P(t1, t2, t3 | prompt) under the target with the warp applied by transformers'
    own logits processors, by enumerating every continuation in one batched pass."""
    vocab = model.config.vocab_size
    processors = LogitsProcessorList([TemperatureLogitsWarper(sampling.temperature)])
    if sampling.top_k:
        processors.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1.0:
        processors.append(TopPLogitsWarper(sampling.top_p))

    prefixes = torch.tensor(list(itertools.product(range(vocab), repeat=CONTINUATION - 1)))
    batch = torch.cat([torch.tensor(prompt).expand(len(prefixes), -1), prefixes], dim=1)
    with torch.no_grad():
        logits = model(input_ids=batch).logits  # [V^2, len, V]
    steps = logits[:, len(prompt) - 1 :, :]  # scores of t1, t2, t3
    probs = []
    for position in range(CONTINUATION):
        context = batch[:, : len(prompt) + position]
        warped = processors(context, steps[:, position, :].clone())
        probs.append(torch.softmax(warped, dim=-1))
    # probs[0][b] is the same row for every b; probs[1][b] depends on t1 = prefixes[b, 0].
    joint = torch.zeros((vocab,) * CONTINUATION, dtype=torch.float64)
    for b, (t1, t2) in enumerate(prefixes.tolist()):
        joint[t1, t2, :] = probs[0][b, t1].double() * probs[1][b, t2].double() * probs[2][b].double()
    return joint.flatten()


def prefix_pvalue(counts: torch.Tensor, expected_probs: torch.Tensor, vocab: int, tokens: int) -> float:
    """The chi-square p-value of the continuations' first `tokens` tokens."""
    observed = counts.view(vocab**tokens, -1).sum(dim=1)
    expected = expected_probs.view(vocab**tokens, -1).sum(dim=1)
    return chi_square_pvalue(observed, expected)


def assert_follows(counts: torch.Tensor, expected_probs: torch.Tensor, vocab: int) -> None:
    """The first token's marginal, the first two tokens' and the whole continuation's
    joint all fit the expected distribution (each p >= 1e-3)."""
    for tokens in range(1, CONTINUATION + 1):
        pvalue = prefix_pvalue(counts, expected_probs, vocab, tokens)
        assert pvalue >= 1e-3, f"the first {tokens} token(s): p = {pvalue:.3g}"


def chi_square_pvalue(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Bins expected to hold fewer than 5 draws are pooled; a draw in a bin of probability
    zero is impossible under the target and fails outright."""
    total = int(counts.sum())
    impossible = counts[expected_probs == 0].sum()
    assert impossible == 0, f"{int(impossible)} draws of continuations the target cannot produce"
    expected = expected_probs.double() / expected_probs.double().sum() * total
    large = expected >= 5
    observed = counts[large].double().tolist() + [float(counts[~large].sum())]
    wanted = expected[large].tolist() + [float(expected[~large].sum())]
    if wanted[-1] == 0:
        observed, wanted = observed[:-1], wanted[:-1]
    return float(chisquare(observed, wanted).pvalue)


@pytest.fixture(scope="module")
def small_pair():
    tokenizer = char_tokenizer(ALPHABET)
    vocab = len(tokenizer)
    target = tiny_llama(vocab, seed=5, hidden=16, layers=1, logit_scale=6.0)
    draft = perturbed_copy(target, noise=1.0, seed=6)
    return tokenizer, target, draft


@pytest.mark.slow
@pytest.mark.parametrize(
    "sampling, stop_confidence, backend, tree",
    [
        (SamplingConfig(temperature=1.0, seed=1234), 0.0, wrap, False),
        (SamplingConfig(temperature=0.7, top_k=6, top_p=0.9, seed=4321), 0.0, wrap, False),
        # Stopping the draft after a token it was unsure of decides the draft length from
        # the sampled tokens themselves: a stopping time, so the output stays exact.
        (SamplingConfig(temperature=1.0, seed=2468), 0.12, wrap, False),
        # The static-cache backend (rollback moves a write position) samples exactly too.
        (SamplingConfig(temperature=1.0, seed=1357), 0.12, wrap_static, False),
        (SamplingConfig(temperature=1.0, seed=1358), 0.12, wrap_chains, False),
        (SamplingConfig(temperature=0.7, top_k=6, top_p=0.9, seed=4322), 0.0, wrap_chains, False),
        # Trees: siblings drawn without replacement, the multi-candidate rule, the path's
        # cache entries moved into place (and a tree's depth decided by its own draws).
        (SamplingConfig(temperature=1.0, seed=9753), 0.0, wrap, True),
        (SamplingConfig(temperature=0.7, top_k=6, top_p=0.9, seed=8642), 0.0, wrap_static, True),
    ],
    ids=[
        "t1",
        "t0.7-topk6-topp0.9",
        "t1-early-stop",
        "t1-early-stop-static-cache",
        "t1-early-stop-device-chains",
        "t0.7-topk6-topp0.9-device-chains",
        "t1-tree",
        "t0.7-topk6-topp0.9-tree-static-cache",
    ],
)
def test_speculative_samples_follow_the_exact_target_distribution(
    small_pair, sampling, stop_confidence, backend, tree, monkeypatch
):
    # The rejection rule, which runs when no seed is given; seeded here (through the
    # decoder's torch.Generator) so that the test is reproducible. The coupled rule that
    # a seed selects is tested in test_coupling.py.
    monkeypatch.setattr(decoder_module, "coupled", lambda sampling: False)
    tokenizer, target, draft = small_pair
    vocab = len(tokenizer)
    prompt = tokenizer("abc", add_special_tokens=False)["input_ids"]
    drafter = ModelDrafter(backend(draft), vocab, stop_confidence=stop_confidence)
    decoder = SpeculativeDecoder(backend(target), tokenizer, [], drafter)
    spec = SpecConfig(k=2, max_new_tokens=CONTINUATION, tree=tree)
    generator_seed = torch.Generator().manual_seed(sampling.seed)
    counts = torch.zeros(vocab**CONTINUATION, dtype=torch.long)
    provenances = collections.Counter()
    first_draft_lengths = collections.Counter()
    first_pass_sizes = collections.Counter()
    for _ in range(DRAWS):
        seed = int(torch.randint(0, 2**62, (1,), generator=generator_seed))
        run = SamplingConfig(sampling.temperature, sampling.top_k, sampling.top_p, seed=seed)
        events = list(decoder.generate(prompt, run, spec))
        first_step = next(e for e in events if isinstance(e, StepEvent))
        first_draft_lengths[first_step.drafted] += 1
        first_pass_sizes[first_step.fed] += 1
        tokens = [e for e in events if isinstance(e, TokenEvent)]
        assert len(tokens) == CONTINUATION
        index = 0
        for event in tokens:
            index = index * vocab + event.token_id
            provenances[event.provenance] += 1
        counts[index] += 1
    # Every branch of the rule was exercised.
    assert {Provenance.ACCEPTED, Provenance.RESAMPLED, Provenance.BONUS} <= set(provenances)
    if stop_confidence:  # both stopped and full drafts happened
        assert first_draft_lengths[1] > DRAWS / 20 and first_draft_lengths[2] > DRAWS / 20, first_draft_lengths
    elif not tree:
        assert set(first_draft_lengths) == {2}
    if tree:  # passes that checked more than one chain's worth of candidates
        assert sum(n for size, n in first_pass_sizes.items() if size > 3) > DRAWS / 20, first_pass_sizes
    assert_follows(counts, exact_continuation_distribution(target, prompt, sampling), vocab)
    # The same draws are clearly not the draft's distribution.
    draft_exact = exact_continuation_distribution(draft, prompt, sampling)
    assert chi_square_pvalue_lenient(counts, draft_exact) < 1e-6


def continuation_counts(
    decoder, prompt, sampling: SamplingConfig, draws: int, first_seed: int, vocab: int, spec: SpecConfig | None = None
):
    counts = torch.zeros(vocab**CONTINUATION, dtype=torch.long)
    provenances = collections.Counter()
    spec = spec or SpecConfig(k=2, max_new_tokens=CONTINUATION)
    for seed in range(first_seed, first_seed + draws):
        run = SamplingConfig(sampling.temperature, sampling.top_k, sampling.top_p, seed=seed)
        tokens = [e for e in decoder.generate(prompt, run, spec) if isinstance(e, TokenEvent)]
        assert len(tokens) == CONTINUATION
        index = 0
        for event in tokens:
            index = index * vocab + event.token_id
            provenances[event.provenance] += 1
        counts[index] += 1
    return counts, provenances


@pytest.mark.slow
def test_the_checks_reject_a_residual_drawn_from_p_from_1500_draws(small_pair, monkeypatch):
    """The checks' power, measured on every run: the commonest wrong rule (after a
    rejection, drawing from p rather than from norm(max(0, p - q))) fails them from a
    quarter of the draws the tests above take."""
    monkeypatch.setattr(decoder_module, "coupled", lambda sampling: False)
    monkeypatch.setattr(sampling_module, "residual_distribution", lambda p, q: p)
    tokenizer, target, draft = small_pair
    vocab = len(tokenizer)
    prompt = tokenizer("abc", add_special_tokens=False)["input_ids"]
    decoder = SpeculativeDecoder(wrap(target), tokenizer, [], ModelDrafter(wrap(draft), vocab))
    counts, _ = continuation_counts(decoder, prompt, SamplingConfig(temperature=1.0), 1500, 0, vocab)
    exact = exact_continuation_distribution(target, prompt, SamplingConfig(temperature=1.0))
    assert prefix_pvalue(counts, exact, vocab, 1) < 1e-6
    with pytest.raises(AssertionError, match="the first 1 token"):
        assert_follows(counts, exact, vocab)


def chi_square_pvalue_lenient(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """As chi_square_pvalue, but draws in zero-probability bins count against the fit."""
    expected = expected_probs.clamp_min(1e-12)
    return chi_square_pvalue(counts, expected / expected.sum())
