"""The generation layer: one prompt encoder, one context check, calibration where `k auto`
starts, the plain baseline from the same place, and what a Generation keeps."""

from __future__ import annotations

import pytest

from conftest import char_tokenizer, wrap
from speccli.api import Speculator
from speccli.autok.costs import CostCurve
from speccli.config import SamplingConfig, SpecConfig
from speccli.context import ContextOverflowError
from speccli.drafters.model import ModelDrafter
from speccli.events import Provenance
from speccli.prompts import NoChatTemplateError, Prompt, PromptError, encode_prompt
from speccli.stats import speedup

EOS = 2
FLAT = CostCurve({n: 0.01 for n in range(1, 10)}, 0.001)
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def generator_for(pair, tokenizer, calls: list[int] | None = None) -> Speculator:
    def calibrate(max_k: int) -> CostCurve:
        calls.append(max_k)
        return FLAT

    target = wrap(pair.target)
    drafter = ModelDrafter(wrap(pair.draft), target.vocab_size)
    return Speculator.over(target, tokenizer, [EOS], drafter, calibrate=calibrate if calls is not None else None)


def test_k_auto_calibrates_once_when_first_asked_for_and_seeds_the_policy(pairs, tokenizer):
    calls: list[int] = []
    generator = generator_for(pairs[0], tokenizer, calls)
    greedy = SamplingConfig()
    generator.stream(Prompt.of("abc"), greedy, SpecConfig(k=4, max_new_tokens=4)).run()
    generator.stream(Prompt.of("abc"), greedy, SpecConfig(k="auto", max_new_tokens=4), plain=True).run()
    assert calls == []  # a fixed k and the plain baseline need no costs
    auto = SpecConfig(k="auto", max_new_tokens=4)
    first = generator.stream(Prompt.of("abc"), greedy, auto)
    assert calls == [16] and generator.decoder.costs is FLAT
    assert generator.decoder.policy_for(auto).costs.verify == FLAT.verify_seconds  # starts from the calibration
    first.run()
    generator.stream(Prompt.of("abc"), greedy, auto).run()
    assert calls == [16]


def test_plain_baseline_comes_from_the_same_generator_and_matches_greedy(pairs, tokenizer):
    generator = generator_for(pairs[0], tokenizer)
    spec = SpecConfig(k=3, max_new_tokens=12)
    speculative = generator.stream(Prompt.of("def fib(n):"), SamplingConfig(), spec).run()
    plain = generator.stream(Prompt.of("def fib(n):"), SamplingConfig(), spec, plain=True).run()
    assert speculative.token_ids == plain.token_ids
    assert plain.stats.drafted == 0 and {t.provenance for t in plain.tokens} == {Provenance.TARGET}
    assert speculative.stats.drafted > 0
    assert speculative.text == tokenizer.decode(speculative.token_ids)
    assert speculative.finish_reason == "length"


def test_past_eos_only_for_plain_decoding(pairs, tokenizer):
    generator = generator_for(pairs[0], tokenizer)
    with pytest.raises(ValueError, match="only plain decoding can run past end-of-sequence tokens"):
        generator.stream([5, 6], SamplingConfig(), SpecConfig(), stop_at_eos=False)


def test_a_generation_cut_short_keeps_its_tokens_and_says_interrupted(pairs, tokenizer):
    generator = generator_for(pairs[0], tokenizer)
    generation = generator.stream(Prompt.of("abc"), SamplingConfig(), SpecConfig(k=2, max_new_tokens=50))
    for response in generation:
        if len(generation.tokens) == 3:
            break
    generation.close()
    assert len(generation.token_ids) == 3 and not generation.finished
    assert generation.finish_reason == "interrupted"
    assert response.stats is generation.stats and response.text == generation.tokens[-1].text


def test_the_one_context_check_is_typed_and_runs_before_generating(pairs):
    tokenizer = char_tokenizer()
    generator = generator_for(pairs[0], tokenizer)
    with pytest.raises(ContextOverflowError) as info:
        generator.stream(Prompt.of("x" * 600), SamplingConfig(), SpecConfig())
    assert (info.value.prompt_tokens, info.value.context) == (600, 512)
    assert str(info.value) == "the prompt is 600 tokens long and the model's context holds 512"


def test_one_encoder_for_text_and_conversations():
    tokenizer = char_tokenizer()
    assert encode_prompt(tokenizer, Prompt.of("hi")) == tokenizer("hi")["input_ids"]
    with pytest.raises(NoChatTemplateError):
        encode_prompt(tokenizer, Prompt.of("hi", chat=True))
    tokenizer.chat_template = TEMPLATE
    assert (
        tokenizer.decode(encode_prompt(tokenizer, Prompt.of("hi", chat=True, system="S")))
        == "system: S\nuser: hi\nassistant:"
    )
    given = Prompt.conversation([{"role": "system", "content": "A"}, {"role": "user", "content": "hi"}], system="B")
    assert (
        tokenizer.decode(encode_prompt(tokenizer, given)) == "system: A\nuser: hi\nassistant:"
    )  # its own system stays
    tokenizer.chat_template = "{{ raise_exception('no') }}"
    with pytest.raises(PromptError, match="^the model's chat template refused the conversation: no$"):
        encode_prompt(tokenizer, Prompt.of("hi", chat=True))


def test_speedup_is_one_formula():
    assert speedup(6.0, 3.0) == 2.0
    assert speedup(6.0, None) is None and speedup(None, 3.0) is None and speedup(6.0, 0.0) is None
