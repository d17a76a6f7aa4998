"""Turning emitted token ids into text as they stream, and stopping at stop strings."""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol, Sequence

from speccli.engine.events import Provenance, TokenEvent


class Detokenizer(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDecoder:
    """Text deltas for a growing list of token ids.

    Decodes a short window of recent tokens rather than the whole output (constant work
    per token), keeps a few prompt tokens as the window's start so that a leading space
    of the first generated token survives, and holds back a delta that ends in an
    incomplete UTF-8 character (decoded as U+FFFD) until its remaining bytes arrive.
    """

    CONTEXT_TOKENS = 6

    def __init__(self, tokenizer: Detokenizer, prompt_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self._ids = list(prompt_ids[-self.CONTEXT_TOKENS :])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return new_text[len(prefix_text) :]
        return ""


def _held_back_length(text: str, stop_strings: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that could be the start of a stop string."""
    longest = 0
    for stop in stop_strings:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


class OutputText:
    """Attaches text to emitted tokens and applies stop strings.

    Without stop strings each token is released at once with its text. With stop
    strings, tokens whose text might be the start of a stop string are held until it is
    clear; when a stop string appears, the text before it is released and nothing after.
    """

    def __init__(
        self, tokenizer: Detokenizer, prompt_ids: Sequence[int], stop_strings: Sequence[str]
    ) -> None:
        self._decoder = IncrementalDecoder(tokenizer, prompt_ids)
        self._stops = tuple(stop_strings)
        self._pending: list[TokenEvent] = []
        self._buffer = ""  # text of pending tokens not yet released
        self.stopped_by: str | None = None

    def push(
        self, token_id: int, provenance: Provenance, step: int, draft_position: int
    ) -> list[TokenEvent]:
        """Add one token; returns the token events that can be released now. After a stop
        string is found, `stopped_by` is set and the caller must stop generating."""
        piece = self._decoder.push(token_id)
        event = TokenEvent(token_id, piece, provenance, step, draft_position)
        if not self._stops:
            return [event]
        self._pending.append(event)
        self._buffer += piece
        found = [(self._buffer.find(s), s) for s in self._stops if s in self._buffer]
        if found:
            cut, self.stopped_by = min(found)
            return self._release(cut, drop_rest=True)
        return self._release(len(self._buffer) - _held_back_length(self._buffer, self._stops))

    def flush(self) -> list[TokenEvent]:
        """Release everything held (the generation ended without a stop string)."""
        return self._release(len(self._buffer))

    def _release(self, chars: int, drop_rest: bool = False) -> list[TokenEvent]:
        """Release the held tokens whose text lies within the first `chars` held characters."""
        released: list[TokenEvent] = []
        used = 0
        while self._pending and used + len(self._pending[0].text) <= chars:
            if drop_rest and used == chars:
                break  # an empty-text token at the stop point belongs to the stop string
            used += len(self._pending[0].text)
            released.append(self._pending.pop(0))
        if drop_rest:
            if self._pending and chars > used:
                # The stop string begins inside this token: keep the text before it.
                head = self._pending[0]
                released.append(replace(head, text=head.text[: chars - used]))
            self._pending.clear()
            self._buffer = ""
        else:
            self._buffer = self._buffer[used:]
        return released
