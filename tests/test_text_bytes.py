"""Output text when a generation ends inside a multi-byte character: the text must be the
tokenizer's decode of the emitted ids, U+FFFD included, never shorter.

A byte-level tokenizer (one token per byte) and a tiny Llama wired so that greedy decoding
cycles through a fixed byte sequence that holds a 2-byte and a 4-byte character."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from conftest import ON_CPU, save_model_folder, tiny_llama, wrap
from speccli.backends.hf import HFCausalLM
from speccli.config import SamplingConfig, SpecConfig
from speccli.drafters.model import ModelDrafter
from speccli.events import FinishEvent, FinishReason, Provenance, StepEvent, TokenEvent
from speccli.loop import SpeculativeDecoder
from speccli.stats import GenerationStats
from speccli.text import OutputText

# The commands here run with k auto (calibrating) unless told otherwise: keep it out of ~/.cache.
pytestmark = pytest.mark.usefixtures("private_cache")


REPO = Path(__file__).resolve().parents[1]
SPECIALS = ["<unk>", "<s>", "</s>"]
EOS = 2
FIRST_BYTE = len(SPECIALS)  # the token of byte b is FIRST_BYTE + b
CYCLE = "xé😀"  # bytes 78 | c3 a9 | f0 9f 98 80: every byte distinct, so each has one successor
PROMPT = "x"
EXPECTED = [FIRST_BYTE + b for b in (CYCLE[1:] + CYCLE).encode()]  # the greedy continuation of PROMPT


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per byte: a multi-byte character takes several tokens. Bytes are spelled
    with GPT-2's byte-to-character map, as the ByteLevel pre-tokenizer and decoder expect."""
    spelled = {}
    extra = 0
    printable = (
        set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | set(range(ord("®"), ord("ÿ") + 1))
    )
    for b in range(256):
        if b in printable:
            spelled[b] = chr(b)
        else:
            spelled[b] = chr(256 + extra)
            extra += 1
    vocab = {token: i for i, token in enumerate(SPECIALS + [spelled[b] for b in range(256)])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def cycling_model(vocab_size: int, max_positions: int = 512):
    """A Llama whose greedy next token depends only on the last one and walks CYCLE round:
    the layers add nothing to the residual stream, each cycle token's embedding is its own
    axis, and the head maps that axis to the token's successor."""
    model = tiny_llama(vocab_size, seed=0, max_positions=max_positions)
    ids = [FIRST_BYTE + b for b in CYCLE.encode()]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
        for axis, (token, successor) in enumerate(zip(ids, ids[1:] + ids[:1])):
            model.model.embed_tokens.weight[token, axis] = 1.0
            model.lm_head.weight[successor, axis] = 10.0
    return model


@pytest.fixture(scope="module")
def byte_tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def model(byte_tok):
    return cycling_model(len(byte_tok))


def test_the_fixture_splits_characters(byte_tok, model):
    prompt = byte_tok(PROMPT)["input_ids"]
    assert prompt == [FIRST_BYTE + ord("x")]
    assert byte_tok(CYCLE)["input_ids"] == [FIRST_BYTE + b for b in CYCLE.encode()]
    out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    assert out[0, 1:].tolist() == EXPECTED[:8]
    assert byte_tok.decode(EXPECTED[:4]) == "é\ufffd"


def _decoder(model, byte_tok, drafted: bool, backend=None) -> SpeculativeDecoder:
    drafter = ModelDrafter(wrap(model), len(byte_tok)) if drafted else None
    return SpeculativeDecoder(backend or wrap(model), byte_tok, [EOS], drafter)


# Cut after the first byte of é, after the second byte of the emoji, after its third.
@pytest.mark.parametrize("max_new", [1, 4, 5])
@pytest.mark.parametrize("drafted", [False, True], ids=["plain", "drafted"])
@pytest.mark.parametrize("stops", [(), ("zz", "😀x")], ids=["no-stops", "stops"])
def test_text_ending_inside_a_character_is_the_tokenizers_decode(byte_tok, model, max_new, drafted, stops):
    decoder = _decoder(model, byte_tok, drafted)
    spec = SpecConfig(k=3 if drafted else 0, max_new_tokens=max_new, stop_strings=stops)
    stats = GenerationStats()
    events = []
    for event in decoder.generate(byte_tok(PROMPT)["input_ids"], SamplingConfig(), spec):
        stats.observe(event)
        events.append(event)
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    ids = [e.token_id for e in tokens]
    assert ids == EXPECTED[:max_new]
    text = "".join(e.text for e in tokens)
    assert text == byte_tok.decode(ids, skip_special_tokens=True)
    assert text.endswith("\ufffd")
    assert isinstance(events[-1], FinishEvent) and events[-1].reason is FinishReason.LENGTH
    # The held-back text came with a token: no extra token was counted.
    assert stats.new_tokens == max_new == events[-1].new_tokens
    assert sum(stats.provenance.values()) == max_new


def test_end_of_sequence_or_full_context_inside_a_character(byte_tok, model):
    prompt = byte_tok(PROMPT)["input_ids"]
    spec = SpecConfig(k=0, max_new_tokens=50)
    # The emoji's third byte taken as an end-of-sequence token: c3 a9 f0 9f, then EOS.
    by_eos = SpeculativeDecoder(wrap(model), byte_tok, [FIRST_BYTE + 0x98]).generate(prompt, SamplingConfig(), spec)
    # A context of 5 positions: the prompt and 4 new tokens, c3 a9 f0 9f.
    short = cycling_model(len(byte_tok), max_positions=5)
    by_context = SpeculativeDecoder(wrap(short), byte_tok, [EOS]).generate(prompt, SamplingConfig(), spec)
    for generation, reason in [(by_eos, FinishReason.EOS), (by_context, FinishReason.CONTEXT)]:
        events = list(generation)
        tokens = [e for e in events if isinstance(e, TokenEvent)]
        assert [e.token_id for e in tokens] == EXPECTED[:4]
        assert "".join(e.text for e in tokens) == byte_tok.decode(EXPECTED[:4]) == "é\ufffd"
        assert events[-1].reason is reason


class InterruptedBackend(HFCausalLM):
    """Ctrl-C inside the engine: the forward pass number `at` raises KeyboardInterrupt."""

    def __init__(self, model, at: int) -> None:
        super().__init__(model)
        self.at = at
        self.calls = 0

    def forward(self, token_ids, all_logits=True):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return super().forward(token_ids, all_logits)


def test_interrupt_inside_the_engine_gives_back_the_held_tokens(byte_tok, model):
    # Plain decoding, one token a pass (a one-token prompt needs no prefill pass): passes
    # 1..4 emit c3 a9 f0 9f, the fifth is interrupted.
    backend = InterruptedBackend(model, at=5)
    generation = _decoder(model, byte_tok, drafted=False, backend=backend).generate(
        byte_tok(PROMPT)["input_ids"], SamplingConfig(), SpecConfig(k=0, max_new_tokens=50)
    )
    seen = []
    with pytest.raises(KeyboardInterrupt):
        for event in generation:
            seen.append(event)
    held = generation.flush()
    tokens = [e for e in seen if isinstance(e, TokenEvent)] + held
    ids = [e.token_id for e in tokens]
    assert ids == EXPECTED[:4]
    assert "".join(e.text for e in tokens) == byte_tok.decode(ids) == "é\ufffd"
    assert generation.flush() == []


def test_consumer_stopping_between_events_gets_the_held_tokens(byte_tok, model):
    # The first step drafts 4 (all accepted) and adds a bonus: c3 a9 f0 9f 98. When its
    # StepEvent arrives, é has come and the emoji's first three bytes are held. The consumer
    # stops there (a Ctrl-C in its own code, or a break).
    generation = _decoder(model, byte_tok, drafted=True).generate(
        byte_tok(PROMPT)["input_ids"], SamplingConfig(), SpecConfig(k=4, max_new_tokens=50)
    )
    seen = []
    for event in generation:
        if isinstance(event, StepEvent):
            break
        seen.append(event)
    tokens = [e for e in seen if isinstance(e, TokenEvent)] + generation.flush()
    ids = [e.token_id for e in tokens]
    assert ids == EXPECTED[:5]
    assert "".join(e.text for e in tokens) == byte_tok.decode(ids) == "é\ufffd"


def test_finished_generation_has_nothing_to_flush(byte_tok, model):
    generation = _decoder(model, byte_tok, drafted=False).generate(
        byte_tok(PROMPT)["input_ids"], SamplingConfig(), SpecConfig(k=0, max_new_tokens=3)
    )
    assert "".join(e.text for e in generation if isinstance(e, TokenEvent)) == "é\ufffd"
    assert generation.flush() == []


def test_held_stop_string_prefix_then_incomplete_character(byte_tok):
    # "a" might begin the stop string "ab"; then c3 arrives and the generation ends.
    output = OutputText(byte_tok, byte_tok("x")["input_ids"], ["ab"])
    for position, byte in enumerate(b"a\xc3"):
        output.push(FIRST_BYTE + byte, Provenance.TARGET, 1, position)
    assert list(output.take()) == []
    output.finish()
    released = list(output.take())
    assert [e.text for e in released] == ["a", "\ufffd"]
    assert output.stopped_by is None


def test_stream_generation_prints_the_held_text_on_ctrl_c(byte_tok, model, capsys):
    from speccli.api import Speculator
    from speccli.ui.plain import print_generation

    backend = InterruptedBackend(model, at=5)
    generator = Speculator(_decoder(model, byte_tok, drafted=False, backend=backend))
    sampling, spec = SamplingConfig(), SpecConfig(k=0, max_new_tokens=50)
    generation = generator.stream(byte_tok(PROMPT)["input_ids"], sampling, spec)
    finished = print_generation(SimpleNamespace(), generation, sampling, spec, as_json=False, show_stats=False)
    assert finished is False
    assert capsys.readouterr().out == byte_tok.decode(EXPECTED[:4]) == "é\ufffd"


@pytest.fixture(scope="module")
def folder(byte_tok, model, tmp_path_factory):
    return str(save_model_folder(model, byte_tok, tmp_path_factory.mktemp("bytes") / "model"))


def specgen(*args: str, cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "speccli.cli", *args],
        input=b"",
        capture_output=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "SPECGEN_CACHE": str(cache)},
        timeout=300,
    )


def test_cli_stdout_and_json_end_inside_a_character(byte_tok, folder, tmp_path):
    expected = byte_tok.decode(EXPECTED[:5], skip_special_tokens=True)
    assert expected == "é\ufffd"
    common = [PROMPT, "--target", folder, *ON_CPU, "--dtype", "float32", "-q", "-n", "5"]
    plain = specgen("generate", *common, "--draft", folder, "--k", "3", cache=tmp_path)
    assert plain.returncode == 0, plain.stderr.decode()
    assert plain.stdout.decode() == expected
    as_json = specgen("generate", *common, "--draft", "none", "--json", cache=tmp_path)
    assert as_json.returncode == 0, as_json.stderr.decode()
    payload = json.loads(as_json.stdout)
    assert payload["token_ids"] == EXPECTED[:5]
    assert payload["text"] == byte_tok.decode(payload["token_ids"], skip_special_tokens=True) == expected
    assert payload["stats"]["new_tokens"] == 5


def test_chat_shows_and_keeps_the_held_text_on_ctrl_c(byte_tok, model):
    import io

    from speccli.api import Speculator
    from speccli.chat import ChatSession
    from speccli.ui.chat import ChatUI

    tokenizer = byte_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    backend = InterruptedBackend(model, at=5)  # the user's "x" is the prompt, as in PROMPT
    session = ChatSession(Speculator(_decoder(model, tokenizer, drafted=False, backend=backend)))
    out, err = io.StringIO(), io.StringIO()
    ChatUI(session, out, err, out_colour=False, err_colour=False).stream_answer(session.ask(PROMPT))
    turn = session.last_turn
    assert turn.interrupted and turn.stats.new_tokens == 4
    assert turn.answer == tokenizer.decode(EXPECTED[:4]) == "é\ufffd"
    assert out.getvalue() == "é\ufffd\n"
    assert session.messages[-1] == {"role": "assistant", "content": "é\ufffd"}
