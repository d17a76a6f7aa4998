"""The one way to generate above the engine, in the spirit of mlx-lm's stream_generate.

`Speculator.stream(prompt, sampling, spec)` encodes the prompt (speccli.prompts),
checks that it fits the context, makes sure `k auto` starts from calibrated costs, and
returns a `Generation`: iterate it for `Response`s (the engine's event plus the running
figures); what it emitted accumulates on it, also when the iteration ends early. The plain
baseline (the target alone, no drafter) comes from the same call with `plain=True`.

generate, chat, bench and scripts/ all go through here; none of them drives the engine's
decoder itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from speccli.autok.costs import CostCurve
from speccli.backends.base import CausalLM
from speccli.config import AUTO_K, SamplingConfig, SpecConfig
from speccli.context import check_fits
from speccli.drafters.base import Drafter, LearnsText
from speccli.events import Event, EventStream, TokenEvent
from speccli.loop import SpeculativeDecoder
from speccli.prompts import Prompt, encode_prompt
from speccli.stats import GenerationStats

INTERRUPTED = "interrupted"

# Measures pass costs for `k auto` (or reads them from a cache) for drafts up to max_k.
Calibrate = Callable[[int], "CostCurve | None"]
# Keeps what `k auto` learned about the draft (given the decoder that ran, and max_k) for the
# next session; returns a notice for the user, if any (shown after the output, not inside it).
Remember = Callable[[SpeculativeDecoder, int], "str | None"]


@dataclass(frozen=True)
class Response:
    """One event of a streamed generation, with the generation's running figures."""

    event: Event
    stats: GenerationStats

    @property
    def token(self) -> TokenEvent | None:
        """The emitted token (its id, text and provenance), if this event is one."""
        return self.event if isinstance(self.event, TokenEvent) else None

    @property
    def text(self) -> str:
        """The text this event adds to the output ("" for events that are not tokens)."""
        token = self.token
        return token.text if token is not None else ""


class Generation:
    """One generation. Iterate it (once) for its Responses; its tokens, text and figures
    accumulate here as they stream, so an iteration cut short (Ctrl-C, close()) still
    leaves what was emitted, with `finish_reason` "interrupted"."""

    def __init__(
        self, prompt_ids: list[int], events: EventStream, on_end: Callable[[Generation], object] | None = None
    ) -> None:
        self.prompt_ids = prompt_ids
        self._events = events
        self._on_end = on_end
        self.stats = GenerationStats()
        self.tokens: list[TokenEvent] = []

    def __iter__(self) -> Iterator[Response]:
        self.stats.start()
        for event in self._events:
            self.stats.observe(event)
            if isinstance(event, TokenEvent):
                self.tokens.append(event)
            yield Response(event, self.stats)
        self._ended()

    def _ended(self) -> None:
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end(self)

    def run(self) -> Generation:
        """Generate to the end without streaming."""
        for _ in self:
            pass
        return self

    def close(self) -> list[TokenEvent]:
        """End the generation where it is (Ctrl-C, or a consumer that stops early) and
        return the token events the engine still held back (an incomplete multi-byte
        character, text that might begin a stop string): they join the tokens, text and
        figures here, and a consumer shows them like the others. [] after a finished one."""
        tail = self._events.flush()
        for event in tail:
            self.stats.observe(event)
            self.tokens.append(event)
        self._ended()
        return tail

    @property
    def token_ids(self) -> list[int]:
        return [t.token_id for t in self.tokens]

    @property
    def text(self) -> str:
        return "".join(t.text for t in self.tokens)

    @property
    def finished(self) -> bool:
        return self.stats.finish_reason is not None

    @property
    def finish_reason(self) -> str:
        return self.stats.finish_reason or INTERRUPTED


class Speculator:
    """A target, its drafter and its tokenizer, ready to generate.

    Holds the speculative decoder (reused from one generation to the next, so what `k auto`
    learned about this machine and this draft carries over across prompts and chat turns)
    and the plain decoders over the same target and KV cache. `calibrate` gives `k auto`
    its measured costs (and the acceptance an earlier session learned); `remember`, called
    after each generation with `k auto` with the decoder that ran it, keeps what it learned
    for the next session.
    """

    def __init__(
        self,
        decoder: SpeculativeDecoder,
        calibrate: Calibrate | None = None,
        remember: Remember | None = None,
        notify: Callable[[str], None] | None = None,
    ) -> None:
        self.decoder = decoder
        self._calibrate = calibrate
        self._remember = remember
        self._notify = notify
        self._plain: dict[bool, SpeculativeDecoder] = {}
        # What the work after a generation has to tell the user: a one-shot consumer shows it
        # after the output (take_notices); otherwise the next `stream` hands it to `notify`.
        self.notices: list[str] = []

    def take_notices(self) -> list[str]:
        """The notices not shown yet, once."""
        notices, self.notices = self.notices, []
        return notices

    @classmethod
    def over(
        cls,
        target: CausalLM,
        tokenizer,
        eos_token_ids: Sequence[int],
        drafter: Drafter | None = None,
        costs: CostCurve | None = None,
        calibrate: Calibrate | None = None,
    ) -> Speculator:
        return cls(SpeculativeDecoder(target, tokenizer, eos_token_ids, drafter, costs), calibrate)

    @property
    def target(self) -> CausalLM:
        return self.decoder.target

    @property
    def tokenizer(self):
        return self.decoder.tokenizer

    @property
    def drafter(self) -> Drafter | None:
        return self.decoder.drafter

    def use_drafter(self, drafter: Drafter | None) -> None:
        """Draft with `drafter` from now on. The same drafter keeps its decoder (and what
        `k auto` learned); another one gets a new decoder with the same costs."""
        if drafter is not self.decoder.drafter:
            old = self.decoder
            self.decoder = SpeculativeDecoder(old.target, old.tokenizer, old.eos_token_ids, drafter, old.costs)

    def encode(self, prompt: Prompt | Sequence[int]) -> list[int]:
        """Token ids of a prompt (ids are taken as they are). Raises PromptError, or
        ContextOverflowError when the prompt leaves no room for a new token."""
        ids = encode_prompt(self.tokenizer, prompt) if isinstance(prompt, Prompt) else list(prompt)
        check_fits(len(ids), self.target.max_length)
        return ids

    def calibrate(self, max_k: int) -> CostCurve | None:
        """Give the decoder measured pass costs for `k auto`, unless it has them."""
        if self.decoder.drafter is not None and self.decoder.costs is None and self._calibrate is not None:
            self.decoder.costs = self._calibrate(max_k)
        return self.decoder.costs

    def stream(
        self,
        prompt: Prompt | Sequence[int],
        sampling: SamplingConfig,
        spec: SpecConfig,
        *,
        plain: bool = False,
        stop_at_eos: bool = True,
        cold: bool = False,
        learn: bool = True,
    ) -> Generation:
        """A generation from `prompt`: speculative, or (`plain`) the target alone.

        stop_at_eos=False decodes past end-of-sequence tokens (a timing run). cold=True
        empties the target's cache and the drafter's state first, so nothing of an earlier
        generation is reused. learn=False keeps the prompt and answer from a drafter that
        learns from texts (suffix drafting: a warm-up, or a run timed against others). The
        prompt is encoded and checked, and the costs calibrated, before this returns;
        generating starts when the Generation is iterated.
        """
        if not stop_at_eos and not plain:
            raise ValueError("only plain decoding can run past end-of-sequence tokens")
        ids = self.encode(prompt)
        if self._notify is not None:
            for notice in self.take_notices():
                self._notify(notice)
        decoder = self._plain_decoder(stop_at_eos) if plain else self.decoder
        adaptive = decoder.drafter is not None and spec.k == AUTO_K
        if adaptive:
            self.calibrate(spec.max_k)
        if cold:
            self.target.rollback(0)
            if decoder.drafter is not None:
                decoder.drafter.rollback(0)
        remember = self._remember if adaptive else None
        learner = decoder.drafter if learn and isinstance(decoder.drafter, LearnsText) else None
        max_k = spec.max_k

        def on_end(generation: Generation) -> None:
            if learner is not None:  # suffix drafting: the prompt and answer join its history
                learner.learn_text([*generation.prompt_ids, *generation.token_ids])
            if remember is not None:
                notice = remember(decoder, max_k)
                if notice is not None:
                    self.notices.append(notice)

        return Generation(ids, decoder.generate(ids, sampling, spec), on_end)

    def _plain_decoder(self, stop_at_eos: bool) -> SpeculativeDecoder:
        if stop_at_eos not in self._plain:
            d = self.decoder
            eos = d.eos_token_ids if stop_at_eos else ()
            self._plain[stop_at_eos] = SpeculativeDecoder(d.target, d.tokenizer, eos, drafter=None)
        return self._plain[stop_at_eos]
