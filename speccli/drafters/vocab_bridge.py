"""A bridge between two tokenizers, for a draft of another family (speccli.drafters.cross).

Both sides are read as bytes: every token id's bytes (`TokenBytes`), so that a text is the
same whichever tokenizer wrote it, and a text that ends inside a multi-byte character is
still a text. Three ways of spelling tokens are read: byte-level BPE (GPT-2, Llama 3, Qwen,
SmolLM: each byte is one character of a fixed table), SentencePiece (a space is "▁", a
byte outside the vocabulary is "<0xNN>"), and tokens that are their own text (a decoder
that only joins them). Another spelling (WordPiece's "##") cannot be read as bytes: such a
draft is refused, as is one whose tokenizer cannot write text back unchanged (a lowercasing
or accent-stripping normaliser), or one that shares too few tokens with the target.

The tokens both sides spell the same (`VocabBridge.shared`) are what the sampled rule
drafts: the draft's distribution restricted to them and renormalised is a distribution over
target tokens, so the usual rejection rule stays exact (Timor et al., ICML 2025: "TLI").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from speccli.errors import UsageError

__all__ = ["CannotBridge", "TokenBytes", "VocabBridge", "bridge_vocabularies"]

# Normalisers that keep a text's meaning (Unicode composition; SentencePiece's spaces): any
# other (lowercasing, stripping accents) makes a draft's text another text than the target's.
KEPT_TEXT = {"NFC", "NFKC", "Prepend", "Replace", "Sequence"}

_HINT = "use --draft ngram, or a draft whose tokenizer writes text unchanged"


class CannotBridge(UsageError):
    """No draft across these tokenizers can work (exit code 2, with a hint)."""


class UnreadableTokens(ValueError):
    """A tokenizer whose tokens cannot be read as bytes."""


def _decoder_kind(tokenizer: Any) -> str:
    """How the tokenizer spells tokens: "bytelevel", "sentencepiece" or "literal"."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise UnreadableTokens(f"{type(tokenizer).__name__} is not a fast tokenizer")
    decoder = backend.decoder
    if decoder is None:
        return "literal"
    spec = json.loads(decoder.__getstate__())
    kinds = _decoder_types(spec)
    if "ByteLevel" in kinds:
        return "bytelevel"
    if "Metaspace" in kinds or "ByteFallback" in kinds or _replaces_metaspace(spec):
        return "sentencepiece"
    if kinds <= {"Fuse", "Sequence", "Strip"}:
        return "literal"
    raise UnreadableTokens(f"tokens spelled for a {'/'.join(sorted(kinds))} decoder cannot be read as bytes")


def _decoder_types(spec: dict[str, Any]) -> set[str]:
    kinds = {str(spec.get("type"))}
    for part in spec.get("decoders") or []:
        kinds |= _decoder_types(part)
    return kinds


def _replaces_metaspace(spec: dict[str, Any]) -> bool:
    if spec.get("type") == "Replace":
        return (spec.get("pattern") or {}).get("String") == "▁"
    return any(_replaces_metaspace(part) for part in spec.get("decoders") or [])


def _byte_level_table() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


@dataclass(frozen=True)
class TokenBytes:
    """Every id's bytes under one tokenizer, and how to write bytes as its ids."""

    tokenizer: Any
    table: tuple[bytes | None, ...]  # id -> its bytes (None: no token has the id)
    special: frozenset[int]  # ids of special tokens (their bytes: their text)
    byte_ids: tuple[int | None, ...]  # byte value -> the id of the token of that byte alone
    prefix: tuple[int, ...]  # ids the tokenizer puts before any text (a BOS)

    @classmethod
    def of(cls, tokenizer: Any) -> TokenBytes:
        """Read every id of `tokenizer`."""
        kind = _decoder_kind(tokenizer)
        vocab: dict[str, int] = tokenizer.get_vocab()
        size = max(vocab.values(), default=-1) + 1
        added = {index: token for index, token in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        special = frozenset(i for i, token in added.items() if getattr(token, "special", False) and i < size)
        table: list[bytes | None] = [None] * size
        byte_ids: list[int | None] = [None] * 256
        level = _byte_level_table() if kind == "bytelevel" else {}
        for token, index in vocab.items():
            if not 0 <= index < size:
                continue
            if index in added:
                table[index] = str(added[index].content).encode()
                continue
            data = _token_bytes(token, kind, level)
            table[index] = data
            if data is not None and len(data) == 1 and _spells_one_byte(token, kind):
                byte_ids[data[0]] = index
        ids = list(tokenizer("", add_special_tokens=True)["input_ids"])
        return cls(tokenizer, tuple(table), special, tuple(byte_ids), tuple(ids[:1]) if ids else ())

    def bytes_of(self, ids: Sequence[int]) -> bytes:
        """The text `ids` spell, as bytes (an id without a token spells nothing)."""
        table = self.table
        return b"".join(table[i] or b"" for i in ids if 0 <= i < len(table))

    def encode(self, data: bytes, complete: bool = False) -> list[int]:
        """Ids that spell `data`: its valid UTF-8 as the tokenizer writes it (special tokens'
        text as the special tokens), any other byte as its byte token where the tokenizer
        has one. `complete`: leave out a character cut off at the end instead."""
        ids: list[int] = []
        while data:
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as error:
                if error.start:
                    ids += self._text_ids(data[: error.start].decode("utf-8"))
                if complete and error.reason == "unexpected end of data":
                    return ids
                for byte in data[error.start : error.end]:
                    index = self.byte_ids[byte]
                    if index is None:
                        return ids  # the rest would not follow what is written
                    ids.append(index)
                data = data[error.end :]
                continue
            return ids + self._text_ids(text)
        return ids

    def _text_ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def _token_bytes(token: str, kind: str, level: dict[str, int]) -> bytes | None:
    if kind == "bytelevel":
        try:
            return bytes(level[char] for char in token)
        except KeyError:
            return token.encode()  # not spelled in the byte table (a plain added token)
    if kind == "sentencepiece":
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            try:
                return bytes([int(token[3:5], 16)])
            except ValueError:
                pass
        return token.replace("▁", " ").encode()
    return token.encode()


def _spells_one_byte(token: str, kind: str) -> bool:
    """A token that stands for one byte value whatever its text (not a one-letter word piece)."""
    if kind == "sentencepiece":
        return token.startswith("<0x")
    return True


@dataclass(frozen=True)
class VocabBridge:
    """The target's and a draft's tokens, and the ids both spell the same."""

    target: TokenBytes
    draft: TokenBytes
    draft_to_target: torch.Tensor  # [draft ids] long: the target id spelled the same, -1 where none
    target_to_draft: torch.Tensor  # [target ids] long: the reverse

    @property
    def shared(self) -> int:
        return int((self.draft_to_target >= 0).sum())

    def share_of_target(self) -> float:
        """The share of the target's tokens the draft can propose under the sampled rule."""
        spelled = sum(data is not None for data in self.target.table)
        return self.shared / spelled if spelled else 0.0


def bridge_vocabularies(target_tok: Any, draft_tok: Any) -> VocabBridge:
    """The bridge between the tokenizers, or CannotBridge saying in one line why
    none can work (tokens not readable as bytes, a draft that rewrites text, too little
    shared)."""
    sides = []
    for role, tokenizer in (("target", target_tok), ("draft", draft_tok)):
        try:
            sides.append(TokenBytes.of(tokenizer))
        except UnreadableTokens as error:
            raise CannotBridge(f"the {role}'s tokenizer cannot draft across tokenizers: {error}", _HINT)
        rewrites = _rewriting_normalisers(tokenizer)
        if rewrites:
            raise CannotBridge(
                f"the {role}'s tokenizer rewrites text ({', '.join(rewrites)}): its tokens cannot be matched by text",
                _HINT,
            )
    target, draft = sides
    by_bytes: dict[tuple[bytes, bool], int] = {}
    for index, data in enumerate(target.table):
        if data is not None:
            by_bytes.setdefault((data, index in target.special), index)
    draft_to_target = torch.full((len(draft.table),), -1, dtype=torch.long)
    target_to_draft = torch.full((len(target.table),), -1, dtype=torch.long)
    for index, data in enumerate(draft.table):
        match = None if data is None else by_bytes.get((data, index in draft.special))
        if match is not None and target_to_draft[match] < 0:
            draft_to_target[index] = match
            target_to_draft[match] = index
    bridge = VocabBridge(target, draft, draft_to_target, target_to_draft)
    if bridge.shared <= len(draft.special):
        raise CannotBridge("the draft's tokenizer shares no token with the target's", _HINT)
    return bridge


def _rewriting_normalisers(tokenizer: Any) -> list[str]:
    """The normalisers of `tokenizer` that change what a text says (lowercasing...)."""
    normalizer = tokenizer.backend_tokenizer.normalizer
    if normalizer is None:
        return []
    spec = json.loads(normalizer.__getstate__())
    return sorted(kind for kind in _normaliser_types(spec) if kind not in KEPT_TEXT)


def _normaliser_types(spec: dict[str, Any]) -> set[str]:
    kinds = {str(spec.get("type"))}
    for part in spec.get("normalizers") or []:
        kinds |= _normaliser_types(part)
    return kinds
