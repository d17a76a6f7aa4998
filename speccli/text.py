"""Turning emitted token ids into text as they stream, and stopping at stop strings."""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Iterator, Protocol, Sequence

from speccli.events import Provenance, TokenEvent


class Detokenizer(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDecoder:
    """Text deltas for a growing list of token ids.

    Decodes a short window of recent tokens rather than the whole output (constant work
    per token), keeps a few prompt tokens as the window's start so that a leading space
    of the first generated token survives, and holds back a delta that ends in an
    incomplete UTF-8 character (decoded as U+FFFD) until its remaining bytes arrive.
    `flush` gives what is still held when no more tokens will come.
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

    @property
    def held_tokens(self) -> int:
        """How many of the last pushed tokens have no text yet (they end in an incomplete
        character, or decode to nothing)."""
        return len(self._ids) - self._read_offset

    def flush(self) -> str:
        """The text of the held tokens as the tokenizer decodes them now: an incomplete
        character at the end comes out as U+FFFD, as in `tokenizer.decode` of all the ids."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]


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

    A token is released (becomes a TokenEvent) once its text is known. Tokens that end in
    an incomplete multi-byte character are held until the character completes. With stop
    strings, tokens whose text might be the start of a stop string are held until it is
    clear; when a stop string appears, the text before it is released and nothing after.
    `finish` releases whatever is still held when no more tokens will come: an incomplete
    character at the end is then the last token's text, as U+FFFD, so that the released
    text equals the tokenizer's decode of the released ids.

    Released events wait in a queue until `take` hands them out one by one, so that none
    is lost when the consumer stops in the middle of several.
    """

    def __init__(self, tokenizer: Detokenizer, prompt_ids: Sequence[int], stop_strings: Sequence[str]) -> None:
        self._decoder = IncrementalDecoder(tokenizer, prompt_ids)
        self._stops = tuple(stop_strings)
        self._pending: list[TokenEvent] = []
        self._buffer = ""  # text of pending tokens not yet released
        self._ready: deque[TokenEvent] = deque()
        self.stopped_by: str | None = None

    def push(self, token_id: int, provenance: Provenance, step: int, draft_position: int) -> None:
        """Add one token; `take` then gives the token events that can be released. After a
        stop string is found, `stopped_by` is set and the caller must stop generating."""
        piece = self._decoder.push(token_id)
        self._pending.append(TokenEvent(token_id, piece, provenance, step, draft_position))
        self._buffer += piece
        self._settle(keep=self._decoder.held_tokens)

    def finish(self) -> None:
        """No more tokens: release everything held, the text of an incomplete character at
        the end (U+FFFD) going to the last token. Harmless to call twice."""
        tail = self._decoder.flush()
        if tail and self._pending:
            last = self._pending[-1]
            self._pending[-1] = replace(last, text=last.text + tail)
            self._buffer += tail
        self._settle(keep=0, final=True)

    def take(self) -> Iterator[TokenEvent]:
        """The released token events not handed out yet, oldest first."""
        while self._ready:
            yield self._ready.popleft()

    def _settle(self, keep: int, final: bool = False) -> None:
        """Release what can be released, never the last `keep` pending tokens."""
        found = [(self._buffer.find(s), s) for s in self._stops if s in self._buffer]
        if found:
            cut, self.stopped_by = min(found)
            self._release(cut, drop_rest=True)
        elif final:
            self._release(len(self._buffer))
        else:
            self._release(len(self._buffer) - _held_back_length(self._buffer, self._stops), keep)

    def _release(self, chars: int, keep: int = 0, drop_rest: bool = False) -> None:
        """Release the held tokens whose text lies within the first `chars` held characters."""
        used = 0
        while len(self._pending) > keep and used + len(self._pending[0].text) <= chars:
            if drop_rest and used == chars:
                break  # an empty-text token at the stop point belongs to the stop string
            used += len(self._pending[0].text)
            self._ready.append(self._pending.pop(0))
        if drop_rest:
            if self._pending and chars > used:
                # The stop string begins inside this token: keep the text before it.
                head = self._pending[0]
                self._ready.append(replace(head, text=head.text[: chars - used]))
            self._pending.clear()
            self._buffer = ""
        else:
            self._buffer = self._buffer[used:]
