"""Draft chains on the device (StaticCausalLM.chain with speccli.drafters.chain's picker):
the same drafts as the pass-by-pass loop (greedy and coupled sampling token for token, the
cut after an unsure token, across an attention-window boundary), the cache left as that loop
leaves it, whole after an interruption; and the inverse-distribution draw it samples with.
On the CPU the chain runs eagerly; on CUDA the same passes are replayed as one graph."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama, wrap_static
from speccli.config import SamplingConfig, SpecConfig
from speccli.coupling import PositionNoise
from speccli.drafters.chain import DevicePicker
from speccli.drafters.model import ModelDrafter
from speccli.events import StepEvent
from speccli.loop import SpeculativeDecoder
import speccli.verify as verify
from speccli.verify import sample, sample_at
from test_decoder_greedy import EOS, MAX_NEW, PROMPTS, emitted, encode, target_greedy

VOCAB = 64


def drafter(model, chains: bool, **kwargs) -> ModelDrafter:
    return ModelDrafter(wrap_static(model, device_chains=chains), VOCAB, **kwargs)


@pytest.fixture(scope="module")
def draft_model():
    return tiny_llama(VOCAB, seed=11, logit_scale=3.0, max_positions=1024)


def test_the_static_backend_chains_only_where_asked_or_graphed(draft_model):
    assert not wrap_static(draft_model).chains  # the CPU: no graphs, a pass at a time
    assert wrap_static(draft_model, device_chains=True).chains
    target = wrap_static(draft_model, device_chains=True)
    target.capture_hidden()
    assert not target.chains  # a model whose hidden states are kept is a target


@pytest.mark.parametrize("stop_confidence", [0.0, 0.5])
@pytest.mark.parametrize("k", [1, 2, 5])
def test_a_greedy_chain_drafts_what_the_pass_by_pass_loop_drafts(draft_model, k, stop_confidence):
    host, device = (
        drafter(draft_model, False, stop_confidence=stop_confidence),
        drafter(draft_model, True, stop_confidence=stop_confidence),
    )
    context = [1, 5, 9, 13]
    cut = 0
    for step in range(6):
        expected = host.propose(context, k, SamplingConfig(), None)
        got = device.propose(context, k, SamplingConfig(), None)
        assert got.tokens == expected.tokens and got.probs is None
        assert list(device.model.cached_tokens) == list(host.model.cached_tokens)
        cut += len(got.tokens) < k
        context = context + got.tokens + [(7 * step) % VOCAB]  # a "bonus" token the draft has not seen
    if stop_confidence and k > 1:
        assert cut > 0  # some chains were cut after an unsure token


def test_a_coupled_chain_draws_the_same_tokens_and_q_as_the_loop(draft_model):
    sampling = SamplingConfig(temperature=0.8, top_k=20, top_p=0.95, seed=99)
    noise = PositionNoise(sampling.seed, VOCAB)
    host, device = drafter(draft_model, False), drafter(draft_model, True)
    context = [1, 4, 8]
    for step in range(5):
        shifted = lambda i, base=len(context): noise(base + i)  # noqa: E731 - the noise of the drafted positions
        expected = host.propose(context, 4, sampling, None, shifted)
        got = device.propose(context, 4, sampling, None, shifted)
        assert got.tokens == expected.tokens
        torch.testing.assert_close(got.probs, expected.probs)
        context = context + got.tokens[:2]


def test_a_sampled_chain_returns_the_q_of_each_token(draft_model):
    sampling = SamplingConfig(temperature=1.0)
    chain = drafter(draft_model, True)
    generator = torch.Generator().manual_seed(3)
    draft = chain.propose([1, 2, 3], 4, sampling, generator)
    assert len(draft.tokens) == 4 and draft.probs.shape == (4, VOCAB)
    torch.testing.assert_close(draft.probs.sum(dim=-1), torch.ones(4))
    assert all(draft.probs[i, t] > 0 for i, t in enumerate(draft.tokens))
    assert list(chain.model.cached_tokens) == [1, 2, 3] + draft.tokens[:3]


def test_a_chain_across_an_attention_window_boundary(draft_model):
    """The window of a chain's passes is the one its last pass needs (256 -> 512 slots here)."""
    host, device = drafter(draft_model, False), drafter(draft_model, True)
    context = [(3 * i) % VOCAB for i in range(253)]
    assert device.model.window(252) == 256 and device.model.window(252 + 6) == 512
    assert (
        device.propose(context, 7, SamplingConfig(), None).tokens
        == host.propose(context, 7, SamplingConfig(), None).tokens
    )


def test_an_interrupted_chain_leaves_the_cache_as_it_was(draft_model):
    device = drafter(draft_model, True)
    reference = drafter(draft_model, True)
    context = [1, 6, 11, 16]
    picker = DevicePicker(SamplingConfig(), False, VOCAB, VOCAB, torch.device("cpu"), 8)
    pick = picker.pick

    def interrupted(logits, index):
        if index == 2:
            raise KeyboardInterrupt
        return pick(logits, index)

    picker.pick = interrupted
    lm = device.model
    logits = device.context_logits(context)
    with pytest.raises(KeyboardInterrupt):
        lm.chain(logits, 4, picker)
    assert list(lm.cached_tokens) == context  # as context_logits left it
    # Whole: the next draft is what a fresh drafter drafts.
    assert (
        device.propose(context, 4, SamplingConfig(), None).tokens
        == reference.propose(context, 4, SamplingConfig(), None).tokens
    )
    assert list(lm.cached_tokens) == list(reference.model.cached_tokens)


@pytest.mark.parametrize("k", [3, "auto"])
def test_chains_give_the_targets_greedy_text(pairs, tokenizer, k):
    pair = pairs[0]
    target = wrap_static(pair.target)
    chain = ModelDrafter(wrap_static(pair.draft, device_chains=True), len(tokenizer), stop_confidence=0.4)
    decoder = SpeculativeDecoder(target, tokenizer, [EOS], chain)
    drafted = 0
    for prompt in PROMPTS:
        ids = encode(tokenizer, prompt)
        events = list(decoder.generate(ids, SamplingConfig(), SpecConfig(k=k, max_new_tokens=MAX_NEW)))
        assert emitted(events) == target_greedy(pair.target, ids), prompt
        drafted += sum(e.drafted for e in events if isinstance(e, StepEvent))
    assert drafted > 0


# --------------------------------------------------------------------------- the draw


def test_sample_at_inverts_the_distribution():
    probs = torch.tensor([0.0, 0.25, 0.0, 0.5, 0.25, 0.0])
    draws = 4000
    counts = torch.zeros(6)
    for j in range(draws):  # evenly spaced uniforms: the counts are the probabilities to 1/draws
        counts[sample_at(probs, torch.tensor([(j + 0.5) / draws]))] += 1
    torch.testing.assert_close(counts / draws, probs.double().float(), atol=1 / draws, rtol=0)


@pytest.mark.parametrize("uniform", [0.0, 1e-300, 0.25, 0.9999999999999999])
def test_sample_at_never_draws_a_token_of_probability_zero(uniform):
    probs = torch.tensor([0.0, 0.0, 0.25, 0.0, 0.75, 0.0, 0.0])
    token = int(sample_at(probs, torch.tensor([uniform], dtype=torch.float64)))
    assert probs[token] > 0
    assert token == (2 if uniform < 0.25 else 4)


@pytest.mark.parametrize("block", [2, 3, 1024])
def test_sample_at_inverts_rows_across_blocks(block, monkeypatch):
    """Blocks of 2 and 3 ids: padding, blocks without mass, a target on a block boundary; rows at once."""
    monkeypatch.setattr(verify, "SAMPLE_BLOCK", block)
    probs = torch.tensor([[0.0, 0.0, 0.0, 0.1, 0.2, 0.0, 0.0, 0.3, 0.4], [0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5]])
    draws = 6000
    uniform = ((torch.arange(draws, dtype=torch.float64) + 0.5) / draws).view(-1, 1, 1).expand(-1, 2, 1)
    tokens = sample_at(probs.expand(draws, -1, -1), uniform)
    assert tokens.shape == (draws, 2, 1)
    for row in range(2):
        counts = torch.bincount(tokens[:, row, 0], minlength=9).double() / draws
        torch.testing.assert_close(counts, probs[row].double(), atol=1 / draws, rtol=0)
    edges = sample_at(probs, torch.tensor([[0.0], [0.9999999999999999]], dtype=torch.float64))
    assert edges.flatten().tolist() == [3, 8]  # never an id without mass at either end


def test_sample_draws_each_row_from_its_distribution():
    probs = torch.zeros(3, 151936)
    probs[0, 151935] = 1.0  # the last id, in the padded last block
    probs[1, [5, 70000]] = torch.tensor([0.25, 0.75])
    probs[2, 1024] = 2.0  # unnormalised: the row's mass scales the target
    generator = torch.Generator().manual_seed(0)
    draws = torch.stack([sample(probs, generator) for _ in range(2000)])
    assert draws[:, 0].unique().tolist() == [151935] and draws[:, 2].unique().tolist() == [1024]
    share = float((draws[:, 1] == 70000).double().mean())
    assert draws[:, 1].unique().tolist() == [5, 70000] and 0.72 < share < 0.78


# --------------------------------------------------------------------------- on CUDA


@pytest.mark.cuda
@pytest.mark.parametrize(
    "sampling",
    [SamplingConfig(), SamplingConfig(temperature=0.8, top_k=20, top_p=0.95, seed=7)],
    ids=["greedy", "coupled"],
)
def test_a_graphed_chain_drafts_what_the_loop_drafts_on_cuda(sampling):
    model = tiny_llama(VOCAB, seed=11, logit_scale=3.0, max_positions=1024).to("cuda")
    host = ModelDrafter(wrap_static(model, device_chains=False), VOCAB)
    graphed = ModelDrafter(wrap_static(model), VOCAB)
    assert graphed.model.graphs_enabled and graphed.model.chains
    noise = PositionNoise(sampling.seed, VOCAB) if sampling.seed is not None else None
    context = [1, 5, 9, 13]
    for _ in range(4):  # captured, then replayed
        expected = host.propose(context, 4, sampling, None, noise)
        got = graphed.propose(context, 4, sampling, None, noise)
        assert got.tokens == expected.tokens
        if expected.probs is not None:
            torch.testing.assert_close(got.probs, expected.probs, rtol=1e-5, atol=1e-6)
        assert list(graphed.model.cached_tokens) == list(host.model.cached_tokens)
        context = context + got.tokens[:2]
    assert graphed.model.graphs_error is None and graphed.model.graphed_chain_lengths == [4]


@pytest.mark.cuda
def test_fused_graphed_decoding_equals_the_unfused_targets_greedy_on_cuda(pairs, tokenizer):
    import copy

    from speccli.backends.fused import fuse_projections

    pair = pairs[0]
    target, draft = copy.deepcopy(pair.target).to("cuda"), copy.deepcopy(pair.draft).to("cuda")
    assert fuse_projections(target) and fuse_projections(draft)
    decoder = SpeculativeDecoder(
        wrap_static(target), tokenizer, [EOS], ModelDrafter(wrap_static(draft), len(tokenizer))
    )
    for prompt in PROMPTS[:2]:  # (the CUDA tests share a minute in scripts/gpu_check.sh)
        ids = encode(tokenizer, prompt)
        for tree in (False, True):
            events = decoder.generate(ids, SamplingConfig(), SpecConfig(k=4, max_new_tokens=MAX_NEW, tree=tree))
            assert emitted(events) == target_greedy(pair.target, ids), (prompt, tree)
