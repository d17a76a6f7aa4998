"""Tokenizer compatibility between a target and its draft."""

from __future__ import annotations

import copy

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from conftest import PRINTABLE, SPECIALS, char_tokenizer
from speccli.models.pairs.compat import check_tokenizers_compatible
from speccli.models.errors import ModelLoadError, TokenizerMismatchError


def test_identical_tokenizers_are_compatible():
    check_tokenizers_compatible(char_tokenizer(), char_tokenizer())


def test_different_alphabets_name_the_first_differing_id():
    target = char_tokenizer("abcdef")
    draft = char_tokenizer("abxdyf")
    with pytest.raises(TokenizerMismatchError) as info:
        check_tokenizers_compatible(target, draft)
    # ids 0-2 are <unk> <s> </s>; 'a' is 3, 'b' 4, 'c' 5.
    assert str(info.value) == "tokenizers differ at id 5: target 'c' vs draft 'x' (2 of 9 shared ids differ)"
    assert "use --draft auto, ngram, or a draft of the target's family" in info.value.hint
    assert isinstance(info.value, ModelLoadError)


def test_single_difference_message():
    with pytest.raises(TokenizerMismatchError) as info:
        check_tokenizers_compatible(char_tokenizer("ab\n"), char_tokenizer("ab "))
    assert str(info.value) == "tokenizers differ at id 5: target '\\n' vs draft ' '"


def test_extra_tokens_appended_are_fine():
    target = char_tokenizer()
    draft = copy.deepcopy(target)
    draft.add_tokens(["<extra_0>", "<extra_1>", "<tool>"])
    assert len(draft) == len(target) + 3
    check_tokenizers_compatible(target, draft)
    check_tokenizers_compatible(draft, target)
    # A smaller vocabulary whose ids are a prefix of the other's is fine too.
    check_tokenizers_compatible(char_tokenizer(PRINTABLE), char_tokenizer(PRINTABLE[:40]))


def _tokenizer_with_specials(unk: str, bos: str, eos: str, pad: str | None = None) -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + ["<pad>"] + list("abc"))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    kwargs = {"pad_token": pad} if pad else {}
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=unk, bos_token=bos, eos_token=eos, **kwargs)


def test_different_special_tokens():
    target = _tokenizer_with_specials("<unk>", "<s>", "</s>")
    swapped = _tokenizer_with_specials("<unk>", "</s>", "<s>")
    with pytest.raises(TokenizerMismatchError) as info:
        check_tokenizers_compatible(target, swapped)
    assert str(info.value) == "tokenizers' bos tokens differ: target '<s>' (id 1) vs draft '</s>' (id 2)"

    other_eos = _tokenizer_with_specials("<unk>", "<s>", "<pad>")
    with pytest.raises(
        TokenizerMismatchError, match="eos tokens differ: target '</s>' \\(id 2\\) vs draft '<pad>' \\(id 3\\)"
    ):
        check_tokenizers_compatible(target, other_eos)

    padded = _tokenizer_with_specials("<unk>", "<s>", "</s>", pad="<pad>")
    pad_is_eos = _tokenizer_with_specials("<unk>", "<s>", "</s>", pad="</s>")
    with pytest.raises(TokenizerMismatchError, match="pad tokens differ"):
        check_tokenizers_compatible(padded, pad_is_eos)


def test_special_defined_on_one_side_only_is_fine():
    # Only one of them has a pad token: nothing to compare.
    check_tokenizers_compatible(
        _tokenizer_with_specials("<unk>", "<s>", "</s>", pad="<pad>"), _tokenizer_with_specials("<unk>", "<s>", "</s>")
    )


def test_a_hole_in_one_vocabulary_is_a_mismatch():
    class Holey:
        """A tokenizer-like object with no token at id 4."""

        def __init__(self, vocab):
            self.vocab = vocab

        def __len__(self):
            return max(self.vocab.values()) + 1

        def get_vocab(self):
            return dict(self.vocab)

    full = Holey({"a": 0, "b": 1, "c": 2, "d": 3, "e": 4, "f": 5})
    holey = Holey({"a": 0, "b": 1, "c": 2, "d": 3, "f": 5})
    with pytest.raises(TokenizerMismatchError, match="at id 4: target 'e' vs draft \\(no token\\)"):
        check_tokenizers_compatible(full, holey)


def test_tokenizers_that_add_other_special_tokens_around_a_text_are_refused():
    from tokenizers import processors

    target = char_tokenizer()
    with_bos = copy.deepcopy(target)
    with_bos.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    assert with_bos("a")["input_ids"] == [1, 3]
    with pytest.raises(TokenizerMismatchError) as info:
        check_tokenizers_compatible(target, with_bos)
    assert str(info.value) == "tokenizers add different special tokens around a text: target [] vs draft [1]"
    check_tokenizers_compatible(with_bos, copy.deepcopy(with_bos))


def test_tokenizers_of_other_kinds_are_refused():
    vocab = {tok: i for i, tok in enumerate(SPECIALS + list("abc"))}
    unigram = Tokenizer(models.Unigram([(tok, -1.0) for tok in vocab], unk_id=0))
    draft = PreTrainedTokenizerFast(tokenizer_object=unigram, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    with pytest.raises(TokenizerMismatchError, match="tokenizers are of different kinds: target BPE vs draft Unigram"):
        check_tokenizers_compatible(char_tokenizer("abc"), draft)
