"""What the decode loop yields. Renderers and statistics consume these; nothing here prints."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Protocol


class Provenance(str, Enum):
    """Where an emitted token came from."""

    ACCEPTED = "accepted"  # drafted, then accepted by the target's verification
    RESAMPLED = "resampled"  # drawn from the target's residual after a draft token was rejected
    BONUS = "bonus"  # drawn from the target after every drafted token was accepted
    TARGET = "target"  # plain target decoding: nothing was drafted this step


def step_provenances(accepted: int, drafted: int, resampled: bool) -> list[Provenance]:
    """Where each token a step settled came from: the accepted drafts, then the target's
    own (resampled after a rejection, a bonus after none, its plain token without a draft)."""
    if drafted == 0:
        last = Provenance.TARGET
    else:
        last = Provenance.RESAMPLED if resampled else Provenance.BONUS
    return [Provenance.ACCEPTED] * accepted + [last]


class FinishReason(str, Enum):
    EOS = "eos"
    LENGTH = "length"  # max_new_tokens reached
    STOP_STRING = "stop_string"
    CONTEXT = "context"  # the model's context window is full


@dataclass(frozen=True)
class PrefillEvent:
    """The prompt was brought into the target's cache (only the tokens not already cached)."""

    prompt_tokens: int
    reused_tokens: int
    seconds: float


@dataclass(frozen=True)
class TokenEvent:
    """One emitted token. `text` is its share of the output text (may be empty while a
    multi-byte character is incomplete, or cut short at a stop string)."""

    token_id: int
    text: str
    provenance: Provenance
    step: int
    draft_position: int  # index within the step: 0 .. drafted (the last is the resampled/bonus token)


@dataclass(frozen=True)
class StepEvent:
    """One target verification pass.

    A chain step drafts `drafted` tokens and feeds drafted + 1. A tree step drafts a tree
    `drafted` deep with `fed` - 1 nodes; `accepted` is the length of the accepted path."""

    step: int
    drafted: int
    accepted: int
    draft_seconds: float
    verify_seconds: float
    fed: int = 0  # tokens in the target's pass; 0 means drafted + 1 (a chain)
    tree: bool = False
    # The part of draft_seconds the draft model spent reading text it had not seen (the
    # prompt, the tokens of plain steps) before drafting: not a cost of each drafted token.
    catch_up_seconds: float = 0.0
    # A lookahead step (or a tree with a guess grafted in): how long prompt lookup's guess in
    # its tree was, and how many of the accepted tokens it had (the rest came from the
    # window's and the pool's n-grams, or the drafter's own nodes).
    guessed: int = 0
    guessed_kept: int = 0
    # A tree with another candidate's guess grafted in (also counted in guessed, guessed_kept):
    # the (depth, accepted) of the drafting candidate's own nodes, what its k auto learns from.
    own: tuple[int, int] | None = None
    # How the step drafted: "plain", or the drafter and its form ("model chain", "ngram tree",
    # "lookahead"): what --stats and --json count by method.
    method: str = "plain"

    def __post_init__(self) -> None:
        if self.fed == 0:
            object.__setattr__(self, "fed", self.drafted + 1)

    @property
    def tokens(self) -> int:
        """Tokens this step produced: the accepted drafts plus the resampled or bonus token."""
        return self.accepted + 1


@dataclass(frozen=True)
class FinishEvent:
    reason: FinishReason
    new_tokens: int
    steps: int
    seconds: float
    stop_string: str | None = None


Event = PrefillEvent | TokenEvent | StepEvent | FinishEvent


class HeldText(Protocol):
    """The output text as the loop releases it (speccli.text.OutputText): tokens held back
    until their text is certain, released at the end."""

    def finish(self) -> None: ...

    def take(self) -> Iterator[TokenEvent]: ...


class EventStream(Iterator[Event]):
    """The events of one generation, as `SpeculativeDecoder.generate` returns them.

    A generation that runs to its end releases every token's event, its FinishEvent last.
    A consumer that stops before the end (Ctrl-C, whether it lands in the engine or in the
    consumer's own code, or a break) calls `flush()`: it ends the generation and returns
    the token events still held back, so that the joined text of all token events is the
    tokenizer's decode of their ids, an incomplete character at the end included (U+FFFD).
    Held back are tokens whose text might begin a stop string and tokens ending in an
    incomplete multi-byte character. They are tokens like the others (count them, show
    them). After a generation that finished, `flush()` returns [].
    """

    def __init__(self, events: Generator[Event, None, None], output: HeldText) -> None:
        self._events = events
        self._output = output

    def __iter__(self) -> "EventStream":
        return self

    def __next__(self) -> Event:
        return next(self._events)

    def close(self) -> None:
        self._events.close()

    def flush(self) -> list[TokenEvent]:
        self._events.close()
        self._output.finish()
        return list(self._output.take())
