"""Cache rollback, token provenance, and stops."""

from __future__ import annotations

from typing import Sequence

import pytest
import torch

from conftest import wrap, wrap_static
from speccli.autok.policy import DraftLengthPolicy
from speccli.backends.hf import HFCausalLM
from speccli.config import SamplingConfig, SpecConfig
from speccli.drafters.base import Draft, Drafter
from speccli.drafters.model import ModelDrafter
from speccli.drafters.ngram import PromptLookupDrafter
from speccli.events import (
    FinishEvent,
    FinishReason,
    PrefillEvent,
    Provenance,
    StepEvent,
    TokenEvent,
)
from speccli.loop import SpeculativeDecoder

EOS = 2


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def fresh_next_logits(model, tokens: Sequence[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([list(tokens)])).logits[0, -1]


def assert_cache_matches_fresh_prefill(backend: HFCausalLM, model, next_token: int) -> None:
    """Scoring one more token from the (rolled back) cache gives the logits of a fresh
    prefill of the same tokens; then the cache is put back as it was."""
    cached = list(backend.cached_tokens)
    from_cache = backend.forward([next_token])[-1]
    expected = fresh_next_logits(model, cached + [next_token])
    torch.testing.assert_close(from_cache, expected, rtol=1e-4, atol=1e-4)
    backend.rollback(len(cached))
    assert list(backend.cached_tokens) == cached


@pytest.mark.parametrize("backend", [wrap, wrap_static], ids=["dynamic-cache", "static-cache"])
@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=1.0, seed=3)])
def test_rolled_back_caches_equal_a_fresh_prefill(pairs, tokenizer, sampling, backend):
    pair = pairs[0]
    target, draft = backend(pair.target), backend(pair.draft)
    decoder = SpeculativeDecoder(target, tokenizer, [], ModelDrafter(draft, len(tokenizer)))
    prompt = encode(tokenizer, "def fib(n):")
    context = list(prompt)
    checked = 0
    for event in decoder.generate(prompt, sampling, SpecConfig(k=4, max_new_tokens=60)):
        if isinstance(event, TokenEvent):
            context.append(event.token_id)
        if isinstance(event, StepEvent) and event.accepted < event.drafted:
            if len(target.cached_tokens) == len(context):
                # A token whose text is empty so far (</s> here) is held back until the
                # next one: its event comes later. Check at the other rejections.
                continue
            # Right after a rejection: the target holds all but the pending token,
            # the draft at most the settled context.
            assert list(target.cached_tokens) == context[:-1]
            assert list(draft.cached_tokens) == context[: len(draft.cached_tokens)]
            assert_cache_matches_fresh_prefill(target, pair.target, context[-1])
            if draft.cached_tokens:
                assert_cache_matches_fresh_prefill(draft, pair.draft, context[len(draft.cached_tokens)])
            checked += 1
    assert checked >= 3


def test_a_draft_model_reads_the_text_only_when_asked_to_draft(pairs, tokenizer):
    pair = pairs[0]
    target, draft = wrap(pair.target), wrap(pair.draft)
    decoder = SpeculativeDecoder(target, tokenizer, [], ModelDrafter(draft, len(tokenizer)))
    prompt = encode(tokenizer, "def fib(n):")
    plain = run(decoder, tokenizer, "def fib(n):", k=0, max_new=12)
    assert list(draft.cached_tokens) == []  # k = 0 throughout: the draft model never ran

    events = list(decoder.generate(prompt, SamplingConfig(), SpecConfig(k=3, max_new_tokens=12)))
    steps = [e for e in events if isinstance(e, StepEvent)]
    # The first drafting step reads the prompt (timed apart, as part of its draft time).
    assert 0 < steps[0].catch_up_seconds <= steps[0].draft_seconds
    tokens = [e.token_id for e in events if isinstance(e, TokenEvent)]
    assert tokens == [e.token_id for e in plain if isinstance(e, TokenEvent)]


def test_rollback_to_zero_and_reuse_across_generations(pairs, tokenizer):
    pair = pairs[1]
    backend = wrap(pair.target)
    backend.forward(encode(tokenizer, "hello world"))
    backend.rollback(0)
    assert list(backend.cached_tokens) == []
    decoder = SpeculativeDecoder(backend, tokenizer, [])
    first = list(decoder.generate(encode(tokenizer, "hello world"), SamplingConfig(), SpecConfig(max_new_tokens=4)))
    second = list(decoder.generate(encode(tokenizer, "hello there"), SamplingConfig(), SpecConfig(max_new_tokens=4)))
    assert first[0] == PrefillEvent(11, 0, first[0].seconds)
    assert second[0].reused_tokens == len("hello ")
    assert_cache_matches_fresh_prefill(backend, pair.target, 5)


class SecondChoiceDrafter(Drafter):
    """Always wrong in greedy mode: drafts the target's second-best token."""

    name = "second-choice"

    def __init__(self, model) -> None:
        self.model = model

    def start(self, context: Sequence[int]) -> None:
        pass

    def propose(self, context, k, sampling, generator, noise=None) -> Draft:
        with torch.no_grad():
            logits = self.model(input_ids=torch.tensor([list(context)])).logits[0, -1]
        second = int(torch.topk(logits, 2).indices[1])
        return Draft([second] * k)

    def rollback(self, length: int) -> None:
        pass


def run(decoder, tokenizer, prompt, k=4, max_new=24, sampling=SamplingConfig(), stops=()):
    return list(
        decoder.generate(
            encode(tokenizer, prompt), sampling, SpecConfig(k=k, max_new_tokens=max_new, stop_strings=stops)
        )
    )


def test_target_as_its_own_draft_accepts_every_token(pairs, tokenizer):
    pair = pairs[0]
    decoder = SpeculativeDecoder(wrap(pair.target), tokenizer, [], ModelDrafter(wrap(pair.target), len(tokenizer)))
    events = run(decoder, tokenizer, "def fib(n):", k=4, max_new=25)
    steps = [e for e in events if isinstance(e, StepEvent)]
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert [(s.drafted, s.accepted) for s in steps] == [(4, 4)] * 5
    assert [t.provenance for t in tokens] == ([Provenance.ACCEPTED] * 4 + [Provenance.BONUS]) * 5
    assert [t.draft_position for t in tokens] == [0, 1, 2, 3, 4] * 5
    assert [t.step for t in tokens] == [s for s in range(1, 6) for _ in range(5)]


def test_always_wrong_draft_yields_one_resampled_token_per_step(pairs, tokenizer):
    pair = pairs[0]
    decoder = SpeculativeDecoder(wrap(pair.target), tokenizer, [], SecondChoiceDrafter(pair.target))
    events = run(decoder, tokenizer, "def fib(n):", k=3, max_new=12)
    steps = [e for e in events if isinstance(e, StepEvent)]
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    # The last steps draft less, so as never to pass max_new_tokens.
    assert [(s.drafted, s.accepted) for s in steps] == [(3, 0)] * 9 + [(2, 0), (1, 0), (0, 0)]
    assert [t.provenance for t in tokens] == [Provenance.RESAMPLED] * 11 + [Provenance.TARGET]
    assert [t.step for t in tokens] == list(range(1, 13))


def test_eos_stops_and_is_not_emitted_even_if_accepted_in_the_same_step(pairs, tokenizer):
    pair = pairs[0]
    plain = SpeculativeDecoder(wrap(pair.target), tokenizer, [])
    free_run = [e.token_id for e in run(plain, tokenizer, "hello", max_new=20) if isinstance(e, TokenEvent)]
    stop_token = free_run[5]
    expected = free_run[: free_run.index(stop_token)]
    decoder = SpeculativeDecoder(
        wrap(pair.target), tokenizer, [stop_token], ModelDrafter(wrap(pair.target), len(tokenizer))
    )
    events = run(decoder, tokenizer, "hello", k=8, max_new=20)
    assert [e.token_id for e in events if isinstance(e, TokenEvent)] == expected
    finish = events[-1]
    assert isinstance(finish, FinishEvent)
    assert finish.reason is FinishReason.EOS and finish.new_tokens == len(expected)
    # The whole run fitted in the first step: the tokens after the stop were accepted and dropped.
    assert isinstance(events[-2], StepEvent) and events[-2].accepted == 8


def test_stop_string_cuts_text_and_tokens(pairs, tokenizer):
    pair = pairs[0]
    plain = SpeculativeDecoder(wrap(pair.target), tokenizer, [])
    text = "".join(e.text for e in run(plain, tokenizer, "hello", max_new=20) if isinstance(e, TokenEvent))
    stop = text[6:8]
    expected_text = text[: text.index(stop)]
    decoder = SpeculativeDecoder(wrap(pair.target), tokenizer, [], ModelDrafter(wrap(pair.target), len(tokenizer)))
    events = run(decoder, tokenizer, "hello", k=8, max_new=20, stops=("never-there", stop))
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert "".join(t.text for t in tokens) == expected_text
    assert len(tokens) == len(expected_text)  # one character per token
    finish = events[-1]
    assert finish.reason is FinishReason.STOP_STRING and finish.stop_string == stop


def test_context_window_full_stops_generation(tokenizer):
    from conftest import tiny_llama

    model = tiny_llama(len(tokenizer), seed=3, max_positions=16, logit_scale=20.0)
    decoder = SpeculativeDecoder(wrap(model), tokenizer, [], ModelDrafter(wrap(model), len(tokenizer)))
    events = run(decoder, tokenizer, "0123456789", k=4, max_new=50)
    finish = events[-1]
    assert finish.reason is FinishReason.CONTEXT
    assert 10 + finish.new_tokens == 17  # positions 0..15 scored, the 17th token predicted from the 16th


def test_a_prompt_that_fills_the_context_is_refused(tokenizer):
    from conftest import tiny_llama

    model = tiny_llama(len(tokenizer), seed=3, max_positions=16)
    decoder = SpeculativeDecoder(wrap(model), tokenizer, [])
    with pytest.raises(ValueError, match="the prompt is 16 tokens long and the model's context holds 16"):
        run(decoder, tokenizer, "0123456789abcdef")


def test_prompt_lookup_drafts_the_continuation_of_the_latest_longest_match():
    drafter = PromptLookupDrafter(max_ngram=3)
    context = [7, 1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 0, 2, 3]
    drafter.start(context)
    # "2 3" ends the context; the longest earlier match is 3-gram "0 2 3"? no: "0 2 3" occurs
    # only at the end, so the 2-gram "2 3" is used, latest occurrence at index 7..8.
    assert drafter.propose(context, 3, SamplingConfig(), None).tokens == [4, 5, 6]
    context += [4]
    # The 3-gram "2 3 4" now matches at 7..9, continuing with 5, 6, 0, 2.
    assert drafter.propose(context, 4, SamplingConfig(), None).tokens == [5, 6, 0, 2]
    assert drafter.propose([1, 2, 3], 4, SamplingConfig(), None).tokens == []  # a new text: re-index
    assert drafter.propose([5, 5], 0, SamplingConfig(), None).tokens == []


def test_prompt_lookup_says_how_long_a_match_its_draft_follows():
    drafter = PromptLookupDrafter(max_ngram=3)
    context = [7, 1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 0, 2, 3]
    drafter.start(context)
    assert drafter.match_length(context) == 2  # "2 3", as above
    assert drafter.match_length(context + [4]) == 3  # "2 3 4"
    assert drafter.match_length(context + [4, 8]) == 0  # 8 never occurred before
    assert drafter.match_length(context + [4, 8, 6]) == 1  # "6" did, "8 6" did not


class MatchRecorder(DraftLengthPolicy):
    """A policy that drafts 2 tokens and records the match lengths the decoder told it."""

    def __init__(self) -> None:
        self.matches: list[int] = []

    def expect(self, match: int) -> None:
        self.matches.append(match)

    def next_k(self) -> int:
        return 2

    def observe(self, step) -> None:
        pass


def test_the_decoder_tells_the_policy_the_match_before_each_step(pairs, tokenizer):
    drafter = PromptLookupDrafter()
    decoder = SpeculativeDecoder(wrap(pairs[0].target), tokenizer, [], drafter)
    policy = MatchRecorder()
    prompt = encode(tokenizer, "abcab")
    contexts, context, step_tokens = [], list(prompt), []  # the context at the start of each step
    for event in decoder.generate(prompt, SamplingConfig(), SpecConfig(max_new_tokens=12), policy):
        if isinstance(event, StepEvent):  # after the step's tokens
            contexts.append(list(context))
            context += [e.token_id for e in step_tokens]
            step_tokens = []
        if isinstance(event, TokenEvent):
            step_tokens.append(event)
    assert len(policy.matches) == len(contexts) > 1
    assert policy.matches[0] == 2  # "ab" occurred before
    fresh = PromptLookupDrafter()
    fresh.start(prompt)
    assert policy.matches == [fresh.match_length(context) for context in contexts]


def test_events_arrive_in_order_and_count_up(pairs, tokenizer):
    pair = pairs[0]
    decoder = SpeculativeDecoder(wrap(pair.target), tokenizer, [], ModelDrafter(wrap(pair.draft), len(tokenizer)))
    events = run(decoder, tokenizer, "hello", k=3, max_new=15)
    assert isinstance(events[0], PrefillEvent) and isinstance(events[-1], FinishEvent)
    steps = [e for e in events if isinstance(e, StepEvent)]
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert sum(s.tokens for s in steps) == len(tokens) == 15
    assert all(s.draft_seconds >= 0 and s.verify_seconds > 0 for s in steps)
    assert events[-1].steps == len(steps)
