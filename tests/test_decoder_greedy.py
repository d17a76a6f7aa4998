"""Greedy speculative decoding emits exactly the target's own greedy tokens (float32)."""

from __future__ import annotations

import time

import pytest
import torch

from conftest import wrap
from speccli.autok.policy import AdaptiveDraftLength
from speccli.config import SamplingConfig, SpecConfig
from speccli.drafters.model import ModelDrafter
from speccli.drafters.ngram import PromptLookupDrafter
from speccli.events import FinishEvent, FinishReason, StepEvent, TokenEvent
from speccli.loop import SpeculativeDecoder

PROMPTS = [
    "def fib(n):",
    "hello world",
    "abcabcabcabc",
    "x",
    "The quick brown fox jumps over the lazy dog.",
    "for i in range(10):\n    print(i)\nfor i in range(10):",
    "1, 2, 3, 4, 5, 6,",
    "import torch\nimport numpy as np\nimport",
    "aaaaaaaa",
    "Once upon a time",
    "SELECT * FROM users WHERE id =",
    '{"key": "value", "other": ',
    "zzz yyy xxx www",
    "To be, or not to be,",
    "while True:\n    pass",
    "0123456789",
    "ABABABAB",
    "q",
    "{[()]}",
    "the the the the",
]
MAX_NEW = 32
EOS = 2


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def target_greedy(model, prompt_ids: list[int]) -> list[int]:
    out = model.generate(
        torch.tensor([prompt_ids], device=model.device), max_new_tokens=MAX_NEW, do_sample=False, num_beams=1
    )
    new = out[0, len(prompt_ids) :].tolist()
    return new[: new.index(EOS)] if EOS in new else new


def emitted(events) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenEvent)]


@pytest.fixture(scope="module")
def references(pairs, tokenizer):
    return {
        (pair.name, prompt): target_greedy(pair.target, encode(tokenizer, prompt))
        for pair in pairs
        for prompt in PROMPTS
    }


@pytest.mark.parametrize(
    "k, tree", [(1, False), (2, False), (4, False), (8, False), ("auto", False), (1, True), (4, True), ("auto", True)]
)
@pytest.mark.parametrize("pair_index", [0, 1])
def test_model_draft_equals_target_greedy(pairs, tokenizer, references, pair_index, k, tree):
    pair = pairs[pair_index]
    # One decoder for all prompts: each generation reuses and rolls back the caches
    # left by the previous one, which must not change a single token.
    decoder = SpeculativeDecoder(wrap(pair.target), tokenizer, [EOS], ModelDrafter(wrap(pair.draft), len(tokenizer)))
    drafted = 0
    branched = False
    for prompt in PROMPTS:
        events = list(
            decoder.generate(
                encode(tokenizer, prompt), SamplingConfig(), SpecConfig(k=k, max_new_tokens=MAX_NEW, tree=tree)
            )
        )
        assert emitted(events) == references[(pair.name, prompt)], prompt
        steps = [e for e in events if isinstance(e, StepEvent)]
        drafted += sum(e.drafted for e in steps)
        branched |= any(e.fed > e.drafted + 1 for e in steps)
        assert all(e.tree == (tree and e.drafted > 0) for e in steps)
    assert drafted > 0
    # Trees branch (a pass holds more tokens than one chain k deep would).
    assert branched == tree


@pytest.mark.parametrize(
    "k, tree", [(1, False), (2, False), (4, False), (8, False), ("auto", False), (4, True), ("auto", True)]
)
@pytest.mark.parametrize("pair_index", [0, 1])
def test_prompt_lookup_equals_target_greedy(pairs, tokenizer, references, pair_index, k, tree):
    pair = pairs[pair_index]
    decoder = SpeculativeDecoder(wrap(pair.target), tokenizer, [EOS], PromptLookupDrafter())
    accepted = 0
    for prompt in PROMPTS:
        events = list(
            decoder.generate(
                encode(tokenizer, prompt), SamplingConfig(), SpecConfig(k=k, max_new_tokens=MAX_NEW, tree=tree)
            )
        )
        assert emitted(events) == references[(pair.name, prompt)], prompt
        accepted += sum(e.accepted for e in events if isinstance(e, StepEvent))
    # Random models repeat themselves, so lookup must have found and kept some drafts.
    assert accepted > 0


def test_close_draft_is_mostly_accepted(pairs, tokenizer):
    pair = pairs[0]
    decoder = SpeculativeDecoder(wrap(pair.target), tokenizer, [EOS], ModelDrafter(wrap(pair.draft), len(tokenizer)))
    steps = [
        e
        for prompt in PROMPTS[:5]
        for e in decoder.generate(encode(tokenizer, prompt), SamplingConfig(), SpecConfig(k=1, max_new_tokens=MAX_NEW))
        if isinstance(e, StepEvent)
    ]
    rate = sum(s.accepted for s in steps) / sum(s.drafted for s in steps)
    assert rate > 0.5


def test_each_generation_tells_k_auto_its_opening_step(pairs, tokenizer):
    # The answer's first token is the draft's hardest guess: k auto learns it apart (begin()).
    class Recording(AdaptiveDraftLength):
        calls: list[str] = []

        def begin(self) -> None:
            self.calls.append("begin")
            super().begin()

        def next_k(self) -> int:
            self.calls.append("k")
            return super().next_k()

    pair = pairs[0]
    decoder = SpeculativeDecoder(wrap(pair.target), tokenizer, [EOS], ModelDrafter(wrap(pair.draft), len(tokenizer)))
    policy = Recording(max_k=4)
    for prompt in PROMPTS[:2]:
        list(decoder.generate(encode(tokenizer, prompt), SamplingConfig(), SpecConfig(max_new_tokens=8), policy))
    second = policy.calls.index("begin", 1)
    assert policy.calls[0] == "begin" and policy.calls[second + 1] == "k" and policy.calls.count("begin") == 2
    assert "begin" not in policy.calls[1:second] and len(policy.calls) > second + 1


def test_plain_decoding_without_drafter(pairs, tokenizer, references):
    pair = pairs[1]
    decoder = SpeculativeDecoder(wrap(pair.target), tokenizer, [EOS])
    events = list(decoder.generate(encode(tokenizer, PROMPTS[0]), SamplingConfig(), SpecConfig(max_new_tokens=MAX_NEW)))
    assert emitted(events) == references[(pair.name, PROMPTS[0])]
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert all(s.drafted == 0 for s in steps)
    assert len(steps) == len(emitted(events))
    assert all(e.provenance.value == "target" for e in events if isinstance(e, TokenEvent))


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_max_new_tokens_is_exact_even_when_a_step_could_overshoot(pairs, tokenizer, tree):
    pair = pairs[0]
    decoder = SpeculativeDecoder(wrap(pair.target), tokenizer, [], ModelDrafter(wrap(pair.draft), len(tokenizer)))
    for max_new in (1, 2, 3, 7, 10):
        spec = SpecConfig(k=8, max_new_tokens=max_new, tree=tree)
        events = list(decoder.generate(encode(tokenizer, "hello"), SamplingConfig(), spec))
        assert len(emitted(events)) == max_new
        finish = events[-1]
        assert isinstance(finish, FinishEvent)
        assert finish.reason is FinishReason.LENGTH and finish.new_tokens == max_new


@pytest.mark.parametrize("pair_index", [0, 1])
def test_early_stop_on_draft_confidence_keeps_the_output_and_shortens_drafts(pairs, tokenizer, references, pair_index):
    pair = pairs[pair_index]
    k = 3
    decoder = SpeculativeDecoder(
        wrap(pair.target), tokenizer, [EOS], ModelDrafter(wrap(pair.draft), len(tokenizer), stop_confidence=0.2)
    )
    short = full = 0
    for prompt in PROMPTS:
        events = list(
            decoder.generate(encode(tokenizer, prompt), SamplingConfig(), SpecConfig(k=k, max_new_tokens=MAX_NEW))
        )
        assert emitted(events) == references[(pair.name, prompt)], prompt
        drafted = [e.drafted for e in events if isinstance(e, StepEvent)][:-1]  # the last step may be cut by room
        short += sum(1 for d in drafted if d < k)
        full += sum(1 for d in drafted if d == k)
    assert short > 0 and full > 0


def test_forward_time_is_counted(pairs, tokenizer):
    target = wrap(pairs[0].target)
    assert target.forward_seconds == 0.0
    decoder = SpeculativeDecoder(target, tokenizer, [EOS])
    started = time.perf_counter()
    list(decoder.generate(encode(tokenizer, "hello"), SamplingConfig(), SpecConfig(max_new_tokens=8)))
    assert 0.0 < target.forward_seconds <= time.perf_counter() - started
