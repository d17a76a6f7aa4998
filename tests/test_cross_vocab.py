"""Drafts of another tokenizer (speccli.drafters.cross): the target's greedy tokens, its exact
distribution and its seeded sample, whatever the draft's tokens straddle, cut or spell."""

from __future__ import annotations

import collections
from typing import Sequence

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from typer.testing import CliRunner

import speccli.loop as decoder_module
from conftest import ON_CPU, SPECIALS, char_tokenizer, save_model_folder, tiny_llama, wrap
from speccli.cli import app
from speccli.config import SamplingConfig, SpecConfig
from speccli.drafters.cross import CrossVocabDrafter
from speccli.events import Provenance, StepEvent
from speccli.loop import SpeculativeDecoder
from speccli.drafters.vocab_bridge import CannotBridge, TokenBytes, bridge_vocabularies
from test_decoder_greedy import EOS, MAX_NEW, PROMPTS, emitted, target_greedy
from test_decoder_sampling import ALPHABET, assert_follows, continuation_counts, exact_continuation_distribution

CORPUS = [
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. Déjà vu, naïve café.",
    "世界你好，世界！ 🙂🙂 emoji and 日本語 text, ünïcödé everywhere.",
    "for i in range(10):\n    print(i, 'hello world')\n",
]
# Prompts that end inside a word, inside a run of multi-byte characters, and after a special.
EDGE_PROMPTS = ["The qui", "café naï", "世界你", "日本語", "🙂 emo", "hello</s>def f", "x"]


def byte_level_tokenizer(
    vocab_size: int, specials: Sequence[str], extra: Sequence[str] = ()
) -> PreTrainedTokenizerFast:
    """A byte-level BPE (as GPT-2's, Qwen's, SmolLM's) trained on CORPUS (+ `extra`)."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([*CORPUS, *extra] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def merged_tokenizer(
    alphabet: str, merges: Sequence[tuple[str, str]], specials: Sequence[str]
) -> PreTrainedTokenizerFast:
    """Tokens that are their own text, with merged ones: ids in another order than
    char_tokenizer's, and tokens ("ab") that straddle its tokens' boundaries."""
    pieces = [*specials, *reversed(list(dict.fromkeys(alphabet)))]
    pieces += [a + b for a, b in merges]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(pieces)}, merges=list(merges), unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def byte_pair():
    """A target and a draft tokenizer that split text (and characters) differently."""
    target = byte_level_tokenizer(300, SPECIALS)
    draft = byte_level_tokenizer(360, ["</s>", "<pad>", "<s>", "<unk>"], extra=["世界世界 🙂🙂🙂 café café"])
    return target, draft


class TextOracle:
    """A draft model that knows the target's text (`reference`): after any prefix of it, its
    logits favour the token of its own tokenizer that continues it, except at every
    `wrong_every`-th position (a rejection), and anywhere off the text."""

    def __init__(
        self, spelling: TokenBytes, reference: bytes, vocab_size: int, wrong_every: int = 0, max_length=None
    ) -> None:
        self.spelling, self.reference, self.rows = spelling, reference, vocab_size
        self.wrong_every = wrong_every
        self.max_length = max_length
        self._cached: list[int] = []
        self.fed = 0

    setup_seconds = 0.0
    chains = False
    device = torch.device("cpu")

    @property
    def vocab_size(self) -> int:
        return self.rows

    @property
    def cached_tokens(self) -> list[int]:
        return self._cached

    def rollback(self, length: int) -> None:
        del self._cached[length:]

    def forward(self, token_ids: Sequence[int], all_logits: bool = True) -> torch.Tensor:
        rows = []
        for token in token_ids:
            self._cached.append(int(token))
            rows.append(self._next_logits())
        self.fed += len(token_ids)
        out = torch.stack(rows)
        return out if all_logits else out[-1:]

    def _next_logits(self) -> torch.Tensor:
        row = torch.zeros(self.rows)
        said = self.spelling.bytes_of(self._cached)
        upcoming = self.spelling.encode(self.reference[len(said) :]) if self.reference.startswith(said) else []
        wrong = self.wrong_every and len(self._cached) % self.wrong_every == 0
        if upcoming and not wrong:
            row[upcoming[0]] = 12.0
        else:
            row[(len(self._cached) * 7) % self.rows] = 12.0
        return row


def oracle_drafter(target_tok, draft_tok, target_model, prompt_ids, wrong_every=0) -> CrossVocabDrafter:
    bridge = bridge_vocabularies(target_tok, draft_tok)
    reference = bridge.target.bytes_of(prompt_ids + target_greedy(target_model, prompt_ids) + [EOS])
    oracle = TextOracle(bridge.draft, reference, len(draft_tok), wrong_every)
    return CrossVocabDrafter(oracle, bridge, target_model.config.vocab_size)


def steps(events) -> list[StepEvent]:
    return [e for e in events if isinstance(e, StepEvent)]


# -- reading tokens as bytes ----------------------------------------------------------------


def test_each_spelling_of_tokens_reads_as_the_bytes_it_stands_for(byte_pair):
    target, _ = byte_pair
    spelling = TokenBytes.of(target)
    text = "naïve 世界 🙂".encode()
    ids = target("naïve 世界 🙂", add_special_tokens=False)["input_ids"]
    assert spelling.bytes_of(ids) == text
    assert all(spelling.table[spelling.byte_ids[b]] == bytes([b]) for b in range(256))
    assert spelling.table[target.convert_tokens_to_ids("</s>")] == b"</s>" and 2 in spelling.special

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": 3, "▁hi": 4, "<0xC3>": 5, "<0xA9>": 6, "h": 7, "i": 8}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    piece = TokenBytes.of(PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>"))
    assert piece.bytes_of([4, 5, 6]) == " hi".encode() + "é".encode()
    assert piece.byte_ids[0xC3] == 5 and piece.byte_ids[ord("h")] is None  # "h" is a letter, not a byte token

    assert TokenBytes.of(char_tokenizer()).bytes_of([3, 4]) == b"ab"


def byte_cuts(tokenizer, text: str) -> list[int]:
    """Where `tokenizer`'s tokens of `text` end, in bytes."""
    spelling, ends = TokenBytes.of(tokenizer), []
    for token in tokenizer(text, add_special_tokens=False)["input_ids"]:
        ends.append((ends[-1] if ends else 0) + len(spelling.table[token]))
    return ends


def test_the_test_tokenizers_cut_characters_at_different_bytes(byte_pair):
    target, draft = byte_pair
    assert byte_cuts(target, "語") == [1, 2, 3] and byte_cuts(draft, "語") == [1, 3]
    assert byte_cuts(target, "你") == [1, 2, 3] and byte_cuts(draft, "你") == [3]


def test_bytes_cut_inside_a_character_are_written_with_byte_tokens(byte_pair):
    for tokenizer in byte_pair:
        spelling = TokenBytes.of(tokenizer)
        smile = "🙂".encode()
        cut = "hi ".encode() + smile[:2]
        assert spelling.bytes_of(spelling.encode(cut)) == cut
        assert spelling.bytes_of(spelling.encode(smile[2:] + b" ok")) == smile[2:] + b" ok"
        assert spelling.bytes_of(spelling.encode(cut, complete=True)) == b"hi "
        # A special token's text is written as the special token.
        assert spelling.encode(b"a</s>")[-1] == tokenizer.convert_tokens_to_ids("</s>")


def test_the_bridge_pairs_tokens_spelled_the_same_and_special_tokens_only_with_special_ones(byte_pair):
    target, draft = byte_pair
    bridge = bridge_vocabularies(target, draft)
    assert target.convert_tokens_to_ids("</s>") != draft.convert_tokens_to_ids("</s>")
    assert int(bridge.draft_to_target[draft.convert_tokens_to_ids("</s>")]) == target.convert_tokens_to_ids("</s>")
    for draft_id, target_id in enumerate(bridge.draft_to_target.tolist()):
        if target_id >= 0:
            assert bridge.draft.table[draft_id] == bridge.target.table[target_id]
            assert (draft_id in bridge.draft.special) == (target_id in bridge.target.special)
            assert int(bridge.target_to_draft[target_id]) == draft_id
    assert 256 < bridge.shared < len(draft)
    assert (bridge.draft_to_target < 0).any()  # merges only the draft has


def test_a_draft_that_rewrites_text_or_shares_nothing_is_refused_in_one_line():
    target = char_tokenizer()
    lowercase = char_tokenizer()
    lowercase.backend_tokenizer.normalizer = normalizers.Lowercase()
    with pytest.raises(CannotBridge, match=r"^the draft's tokenizer rewrites text \(Lowercase\)"):
        bridge_vocabularies(target, lowercase)
    wordpiece = char_tokenizer()
    wordpiece.backend_tokenizer.decoder = decoders.WordPiece()
    with pytest.raises(CannotBridge, match="tokens spelled for a WordPiece decoder cannot be read as bytes"):
        bridge_vocabularies(wordpiece, target)
    other = merged_tokenizer("αβγδ", [], ["[UNK]", "[BOS]", "[EOS]"])
    with pytest.raises(CannotBridge, match="^the draft's tokenizer shares no token with the target's$"):
        bridge_vocabularies(target, other)


# -- greedy: string-level matching ----------------------------------------------------------


@pytest.mark.parametrize("wrong_every", [0, 3])
def test_greedy_output_is_the_targets_own_with_draft_tokens_across_its_boundaries(byte_pair, wrong_every):
    target_tok, draft_tok = byte_pair
    target = tiny_llama(len(target_tok), seed=21, logit_scale=20.0)
    accepted = drafted = 0
    for prompt in [*PROMPTS, *EDGE_PROMPTS]:
        ids = target_tok(prompt, add_special_tokens=False)["input_ids"]
        drafter = oracle_drafter(target_tok, draft_tok, target, ids, wrong_every)
        decoder = SpeculativeDecoder(wrap(target), target_tok, [EOS], drafter)
        events = list(decoder.generate(ids, SamplingConfig(), SpecConfig(k=4, max_new_tokens=MAX_NEW)))
        assert emitted(events) == target_greedy(target, ids), prompt
        accepted += sum(s.accepted for s in steps(events))
        drafted += sum(s.drafted for s in steps(events))
    rate = accepted / drafted
    assert (rate > 0.9) if wrong_every == 0 else (0.3 < rate < 0.9), rate


def test_draft_tokens_that_straddle_the_targets_are_guessed_as_target_tokens():
    target_tok = char_tokenizer(ALPHABET)
    draft_tok = merged_tokenizer(ALPHABET, [("a", "b"), ("c", "d"), ("ab", "cd")], SPECIALS)
    target = tiny_llama(len(target_tok), seed=5, hidden=16, layers=1, logit_scale=6.0)
    prompt = target_tok("abcdab", add_special_tokens=False)["input_ids"]
    drafter = oracle_drafter(target_tok, draft_tok, target, prompt)
    assert drafter.draft_ids(prompt) == draft_tok("abcdab", add_special_tokens=False)["input_ids"]
    assert len(drafter.draft_ids(prompt)) == 2  # "abcd", "ab": two draft tokens over six target ones
    decoder = SpeculativeDecoder(wrap(target), target_tok, [EOS], drafter)
    events = list(decoder.generate(prompt, SamplingConfig(), SpecConfig(k=4, max_new_tokens=MAX_NEW)))
    assert emitted(events) == target_greedy(target, prompt)
    assert sum(s.accepted for s in steps(events)) >= MAX_NEW // 2


def test_the_drafts_end_of_text_token_is_guessed_as_the_targets(byte_pair):
    target_tok, draft_tok = byte_pair
    target = tiny_llama(len(target_tok), seed=22, logit_scale=20.0)
    bridge = bridge_vocabularies(target_tok, draft_tok)
    drafter = CrossVocabDrafter(TextOracle(bridge.draft, b"hi</s>", len(draft_tok)), bridge, target.config.vocab_size)
    context = target_tok("hi", add_special_tokens=False)["input_ids"]
    assert drafter.propose(context, 4, SamplingConfig(), None).tokens == [EOS]
    # The target's special tokens in the context reach the draft as its own special tokens.
    assert drafter.draft_ids([*context, EOS])[-1] == draft_tok.convert_tokens_to_ids("</s>")


def test_a_text_longer_than_the_draft_can_read_is_decoded_without_drafting(byte_pair):
    target_tok, draft_tok = byte_pair
    target = tiny_llama(len(target_tok), seed=21, logit_scale=20.0)
    bridge = bridge_vocabularies(target_tok, draft_tok)
    ids = target_tok("The quick brown fox", add_special_tokens=False)["input_ids"]
    reference = bridge.target.bytes_of(ids + target_greedy(target, ids))
    short = TextOracle(bridge.draft, reference, len(draft_tok), max_length=len(bridge.draft.encode(reference[:30])))
    decoder = SpeculativeDecoder(wrap(target), target_tok, [EOS], CrossVocabDrafter(short, bridge, len(target_tok)))
    events = list(decoder.generate(ids, SamplingConfig(), SpecConfig(k=4, max_new_tokens=MAX_NEW)))
    assert emitted(events) == target_greedy(target, ids)
    drafted = [s.drafted for s in steps(events)]
    assert drafted[0] > 0 and drafted[-1] == 0  # it drafts while the text fits its context, then not
    assert len(short.cached_tokens) < short.max_length


def test_a_random_draft_of_another_tokenizer_keeps_the_greedy_output(byte_pair):
    target_tok, draft_tok = byte_pair
    target = tiny_llama(len(target_tok), seed=23, logit_scale=20.0)
    draft = tiny_llama(len(draft_tok), seed=24, embedding_rows=len(draft_tok) + 5, hidden=16, layers=1)
    bridge = bridge_vocabularies(target_tok, draft_tok)
    decoder = SpeculativeDecoder(
        wrap(target), target_tok, [EOS], CrossVocabDrafter(wrap(draft), bridge, len(target_tok))
    )
    for prompt in [*PROMPTS[:4], *EDGE_PROMPTS]:
        ids = target_tok(prompt, add_special_tokens=False)["input_ids"]
        for spec in (SpecConfig(k=3, max_new_tokens=MAX_NEW), SpecConfig(k="auto", max_new_tokens=MAX_NEW)):
            assert emitted(decoder.generate(ids, SamplingConfig(), spec)) == target_greedy(target, ids), prompt


# -- sampling: the draft restricted to the shared tokens ------------------------------------


@pytest.fixture(scope="module")
def lettered_cross_pair():
    target_tok = char_tokenizer(ALPHABET)
    draft_tok = merged_tokenizer(ALPHABET, [("a", "b"), ("b", "c"), ("c", "a")], SPECIALS)
    target = tiny_llama(len(target_tok), seed=5, hidden=16, layers=1, logit_scale=6.0)
    draft = tiny_llama(len(draft_tok), seed=6, hidden=16, layers=1, logit_scale=3.0)
    return target_tok, draft_tok, target, draft


@pytest.mark.slow
@pytest.mark.parametrize(
    "sampling",
    [SamplingConfig(temperature=1.0, seed=71), SamplingConfig(temperature=0.7, top_p=0.9, seed=72)],
    ids=["t1", "t0.7-topp0.9"],
)
def test_samples_drafted_across_tokenizers_follow_the_exact_target_distribution(
    lettered_cross_pair, sampling, monkeypatch
):
    monkeypatch.setattr(decoder_module, "coupled", lambda sampling: False)  # the rejection rule
    target_tok, draft_tok, target, draft = lettered_cross_pair
    vocab = len(target_tok)
    prompt = target_tok("abcab", add_special_tokens=False)["input_ids"]
    drafter = CrossVocabDrafter(wrap(draft), bridge_vocabularies(target_tok, draft_tok), vocab)
    decoder = SpeculativeDecoder(wrap(target), target_tok, [], drafter)
    counts, provenances = continuation_counts(decoder, prompt, sampling, 6_000, sampling.seed * 10_000, vocab)
    assert provenances[Provenance.ACCEPTED] > 1_000, provenances  # the draft's guesses were kept often enough to matter
    assert_follows(counts, exact_continuation_distribution(target, prompt, sampling), vocab)


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.8, 0.9)])
def test_a_seeded_sample_is_the_targets_own_whatever_tokenizer_drafts_it(byte_pair, temperature, top_p):
    target_tok, draft_tok = byte_pair
    target = tiny_llama(len(target_tok), seed=25, logit_scale=4.0)
    draft = tiny_llama(len(draft_tok), seed=26, hidden=16, layers=1, logit_scale=4.0)
    plain = SpeculativeDecoder(wrap(target), target_tok, [EOS])
    crossed = SpeculativeDecoder(
        wrap(target),
        target_tok,
        [EOS],
        CrossVocabDrafter(wrap(draft), bridge_vocabularies(target_tok, draft_tok), len(target_tok)),
    )
    for seed, prompt in enumerate([*PROMPTS[:3], *EDGE_PROMPTS[:3]]):
        ids = target_tok(prompt, add_special_tokens=False)["input_ids"]
        sampling = SamplingConfig(temperature=temperature, top_p=top_p, seed=seed)
        spec = SpecConfig(k=3, max_new_tokens=24)
        assert emitted(crossed.generate(ids, sampling, spec)) == emitted(plain.generate(ids, sampling, spec)), prompt


# -- the command line ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cross_folders(tmp_path_factory, byte_pair):
    target_tok, draft_tok = byte_pair
    target = tiny_llama(len(target_tok), seed=27, logit_scale=20.0)
    draft = tiny_llama(len(draft_tok), seed=28, hidden=16, layers=1)
    root = tmp_path_factory.mktemp("cross")
    return {
        "tokenizer": target_tok,
        "target_model": target,
        "target": str(save_model_folder(target, target_tok, root / "target")),
        "draft": str(save_model_folder(draft, draft_tok, root / "draft")),
    }


def test_generate_with_a_draft_of_another_tokenizer_prints_the_targets_text(cross_folders, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))
    tokenizer, target = cross_folders["tokenizer"], cross_folders["target_model"]
    ids = tokenizer("def fib(n):", add_special_tokens=False)["input_ids"]
    expected = tokenizer.decode(target_greedy(target, ids), skip_special_tokens=True)
    args = ["generate", "def fib(n):", "--target", cross_folders["target"], "--draft", cross_folders["draft"]]
    result = CliRunner().invoke(app, [*args, *ON_CPU, "--k", "3", "-n", str(MAX_NEW)])
    assert result.exit_code == 0, result.output
    assert result.stdout == expected
    assert "has another tokenizer" in result.stderr and "it drafts by text" in result.stderr


def test_a_draft_that_cannot_be_bridged_is_refused_before_its_weights_load(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))
    target_tok, draft_tok = char_tokenizer(), char_tokenizer("zyxwvutsrqponmlkjihgfedcba")
    draft_tok.backend_tokenizer.normalizer = normalizers.Lowercase()
    target = save_model_folder(tiny_llama(len(target_tok), seed=1), target_tok, tmp_path / "target")
    draft = save_model_folder(tiny_llama(len(draft_tok), seed=2), draft_tok, tmp_path / "draft")
    (draft / "model.safetensors").write_bytes(b"not weights")
    result = CliRunner().invoke(app, ["generate", "hi", "--target", str(target), "--draft", str(draft), "-q"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert lines[0] == "error: the draft's tokenizer rewrites text (Lowercase): its tokens cannot be matched by text"
    assert lines[1].startswith("hint: use --draft ngram, or a draft whose tokenizer writes text unchanged")
    assert "Traceback" not in result.stderr
