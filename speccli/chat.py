"""A chat session without any terminal: the conversation, the settings a user may change
while chatting, per-answer and session statistics, and the session's own measurement of
plain target decoding that the speed-up is reported against.

The REPL (speccli.ui.chat) reads input and renders events; everything it remembers
lives here, so it can be tested without a terminal and saved as JSON.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from collections import abc
from typing import TYPE_CHECKING, Any, Iterator

from speccli.config import AUTO_K, SamplingConfig, SpecConfig
from speccli.context import ContextOverflowError
from speccli.events import Event, TokenEvent
from speccli.prompts import Message, Prompt, PromptError
from speccli.stats import GenerationStats, speedup

if TYPE_CHECKING:  # pragma: no cover - the engine (torch) loads when a session starts
    from speccli.api import Generation, Speculator

SAVE_FORMAT = "specgen-chat/1"

DEFAULT_MAX_TOKENS = 512
# The baseline slice: plain target tokens measured after each finished answer, and the most
# measured in one session (see PlainBaseline).
DEFAULT_BASELINE_TOKENS = 8
DEFAULT_BASELINE_BUDGET = 64

SETTING_NAMES = ("temperature", "top_p", "top_k", "k", "max_tokens", "seed", "tree")
_SETTING_ALIASES = {
    "temp": "temperature",
    "max_new_tokens": "max_tokens",
    "n": "max_tokens",
}


class ChatError(Exception):
    """Something a user did that the session refuses: one line, shown as it is."""


class SettingError(ChatError):
    """A bad /set name or value."""


def _setting_name(raw: str) -> str:
    name = raw.strip().lower().replace("-", "_")
    name = _SETTING_ALIASES.get(name, name)
    if name not in SETTING_NAMES:
        raise SettingError(f"unknown setting {raw!r}; one of {', '.join(SETTING_NAMES)}")
    return name


def _parse_int(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise SettingError(f"{name} must be a whole number, got {raw!r}") from None


def _parse_switch(name: str, raw: str) -> bool:
    switch = {"on": True, "true": True, "yes": True, "1": True, "off": False, "false": False, "no": False, "0": False}
    value = switch.get(raw.lower())
    if value is None:
        raise SettingError(f"{name} must be on, off or auto, got {raw!r}")
    return value


def _parse_float(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise SettingError(f"{name} must be a number, got {raw!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise SettingError(f"{name} must be a finite number, got {raw!r}")
    return value


# Each /set name, and the field of SamplingConfig or SpecConfig it sets.
_FIELDS: dict[str, tuple[str, str]] = {
    "temperature": ("sampling", "temperature"),
    "top_k": ("sampling", "top_k"),
    "top_p": ("sampling", "top_p"),
    "seed": ("sampling", "seed"),
    "k": ("spec", "k"),
    "max_tokens": ("spec", "max_new_tokens"),
    "tree": ("spec", "tree"),
}


@dataclass(frozen=True)
class ChatSettings:
    """What the next answer is generated with: the configs themselves, under the names
    /set uses. Every instance is valid (the configs check themselves; k >= 1 here)."""

    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    spec: SpecConfig = field(default_factory=lambda: SpecConfig(k=AUTO_K, max_new_tokens=DEFAULT_MAX_TOKENS))

    def __post_init__(self) -> None:
        if isinstance(self.spec.k, int) and self.spec.k < 1:
            raise SettingError(f"k must be at least 1, got {self.spec.k}")

    @classmethod
    def of(cls, **values: Any) -> ChatSettings:
        """Settings from /set names (temperature, top_k, top_p, seed, k, max_tokens, tree).
        Raises SettingError."""
        settings = cls()
        for name, value in values.items():
            settings = settings.with_value(name, value)
        return settings

    def value(self, name: str) -> Any:
        config, attribute = _FIELDS[name]
        return getattr(getattr(self, config), attribute)

    def with_value(self, name: str, value: Any) -> ChatSettings:
        config, attribute = _FIELDS[name]
        try:
            updated = replace(getattr(self, config), **{attribute: value})
        except ValueError as error:
            raise SettingError(str(error)) from None
        return replace(self, **{config: updated})

    def changed(self, name: str, raw: str) -> tuple[str, "ChatSettings"]:
        """The settings with `name` set from the text `raw`: (canonical name, new settings).
        Raises SettingError with one line for an unknown name or a bad value."""
        name = _setting_name(name)
        raw = raw.strip()
        if not raw:
            raise SettingError(f"/set {name} needs a value")
        value: Any
        if name in ("temperature", "top_p"):
            value = _parse_float(name, raw)
        elif name == "seed":
            value = None if raw.lower() in ("none", "off", "random") else _parse_int(name, raw)
        elif name == "k" and raw.lower() == AUTO_K:
            value = AUTO_K
        elif name == "tree":
            value = None if raw.lower() == "auto" else _parse_switch(name, raw)
        else:
            value = _parse_int(name, raw)
        return name, self.with_value(name, value)

    def describe(self) -> str:
        s, seed = self.sampling, self.sampling.seed
        mode = "greedy" if s.greedy else "sampling"
        return (
            f"temperature {s.temperature:g} ({mode}), top_p {s.top_p:g}, top_k {s.top_k}"
            f"{' (off)' if s.top_k == 0 else ''}, k {self.spec.k}, max_tokens {self.spec.max_new_tokens},"
            f" seed {'none' if seed is None else seed}"
        )

    def as_dict(self) -> dict:
        return {name: self.value(name) for name in _FIELDS}


@dataclass
class Turn:
    """One answer the model gave (or began): the question, the text, its figures."""

    user: str
    answer: str = ""
    stats: GenerationStats = field(default_factory=GenerationStats)
    settings: dict = field(default_factory=dict)
    interrupted: bool = False
    regenerated: bool = False  # this answer replaced an earlier answer to the same message

    @property
    def finish_reason(self) -> str:
        return "interrupted" if self.interrupted else (self.stats.finish_reason or "unknown")

    def as_dict(self) -> dict:
        return {
            "user": self.user,
            "answer": self.answer,
            "finish_reason": self.finish_reason,
            "regenerated": self.regenerated,
            "settings": self.settings,
            "stats": self.stats.as_dict(),
        }


class PlainBaseline:
    """The session's own measurement of the target decoding alone.

    How: after an answer finishes, the target decodes `tokens_per_turn` more tokens on its
    own (no drafter, one target pass per token, end-of-sequence ignored, the text thrown
    away), continuing from the end of that answer. It shares the target's KV cache, so a
    slice costs exactly `tokens_per_turn` target passes and no prefill, and it runs at the
    context length the conversation has reached, so the plain and speculative tokens/s
    compare like with like. The next turn re-uses the cached conversation as before (the
    slice's tokens are simply rolled back).

    Why bounded: every slice is time the user waits for the prompt. At most
    `budget` tokens are measured per session (64 by default: the first 8 finished
    answers), which is enough to average out the noise of single passes; after that the
    session costs nothing extra. Interrupted answers are not followed by a slice.

    tokens/s is generated tokens over decode time (prefill excluded), the same definition
    GenerationStats uses for the speculative answers, so their ratio is the speed-up.
    """

    def __init__(self, tokens_per_turn: int = DEFAULT_BASELINE_TOKENS, budget: int = DEFAULT_BASELINE_BUDGET) -> None:
        if tokens_per_turn < 0 or budget < 0:
            raise ValueError("baseline sizes must be >= 0")
        self.tokens_per_turn = tokens_per_turn
        self.budget = budget
        self.stats = GenerationStats()
        self.slices = 0

    @property
    def remaining(self) -> int:
        return max(0, self.budget - self.stats.new_tokens)

    @property
    def tokens_per_second(self) -> float | None:
        return self.stats.tokens_per_second

    def method(self) -> str:
        if self.budget == 0 or self.tokens_per_turn == 0:
            return "not measured (the baseline is turned off)"
        return (
            f"plain target decoding (no drafter) of {self.tokens_per_turn} tokens after each finished"
            f" answer, up to {self.budget} tokens per session; measured so far: {self.stats.new_tokens}"
            f" tokens in {self.slices} slice{'s' if self.slices != 1 else ''}"
        )

    def as_dict(self) -> dict:
        return {
            "method": self.method(),
            "tokens_per_turn": self.tokens_per_turn,
            "budget": self.budget,
            "slices": self.slices,
            "tokens": self.stats.new_tokens,
            "decode_seconds": round(self.stats.decode_seconds, 4),
            "tokens_per_second": None if self.tokens_per_second is None else round(self.tokens_per_second, 3),
        }


@dataclass(frozen=True)
class SessionReport:
    """The figures /stats and the end of a session show."""

    answers: int
    interrupted: int
    tokens: int
    steps: int
    acceptance: float | None
    acceptance_by_position: list[float]
    tokens_per_step: float | None
    predicted_tokens_per_step: float | None
    mean_draft_length: float | None
    tokens_per_second: float | None
    mean_first_token_seconds: float | None
    baseline_tokens_per_second: float | None
    baseline_method: str
    speedup: float | None
    has_drafter: bool

    def as_dict(self) -> dict:
        return asdict(self)


class Answer(Iterator[Event]):
    """The events of one answer. `close()` ends it where it is (the REPL's Ctrl-C) and
    returns the token events the engine held back until then (an incomplete multi-byte
    character): they belong to the answer and are shown like the others."""

    def __init__(self) -> None:
        self.events: abc.Generator[Event, None, None] | None = None
        self.tail: list[TokenEvent] = []

    def __iter__(self) -> Answer:
        return self

    def _generator(self) -> abc.Generator[Event, None, None]:
        assert self.events is not None, "ChatSession._answer gives an answer its events"
        return self.events

    def __next__(self) -> Event:
        return next(self._generator())

    def close(self) -> list[TokenEvent]:
        self._generator().close()
        return self.tail


class ChatSession:
    """The state of one `specgen chat`.

    `ask(text)` and `regenerate()` check what they can at once (raising ChatError before
    anything changes) and return an iterator of the decoder's events for the answer. The
    answer joins the conversation when the iterator ends, also when it ends early: an
    exception inside it (Ctrl-C) or the caller closing it keeps the text said so far, marked
    interrupted. An answer interrupted before it said anything is dropped together with
    its question (a /regen interrupted that early keeps the previous answer).
    """

    def __init__(
        self,
        generator: Speculator,
        settings: ChatSettings | None = None,
        system: str | None = None,
        *,
        baseline_tokens: int = DEFAULT_BASELINE_TOKENS,
        baseline_budget: int = DEFAULT_BASELINE_BUDGET,
        model_info: dict | None = None,
    ) -> None:
        self.generator = generator
        self.settings = settings or ChatSettings()
        self.system = system or None
        self.messages: list[dict[str, str]] = []  # the conversation, without the system prompt
        self.turns: list[Turn] = []  # every answer of the session, also those /clear forgot
        self.stats = GenerationStats()  # all answers together
        self.baseline = PlainBaseline(baseline_tokens, baseline_budget)
        self.model_info = dict(model_info or {})
        self.started = time.time()
        self._generations = 0
        self._busy = False

    # ------------------------------------------------------------------ conversation

    @property
    def has_drafter(self) -> bool:
        return self.generator.drafter is not None

    def conversation(self) -> list[dict[str, str]]:
        """The messages the template sees: the system prompt (if any), then the turns."""
        return self._with_system(self.messages)

    def _with_system(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [dict(m) for m in messages]

    def clear(self) -> None:
        """Forget the conversation; the system prompt and the statistics stay."""
        self.messages.clear()

    def set_system(self, text: str) -> None:
        self.system = text.strip() or None

    def set(self, name: str, raw: str) -> str:
        """Change one setting from text; returns its canonical name. Raises SettingError."""
        name, self.settings = self.settings.changed(name, raw)
        return name

    def prompt_ids(self, messages: list[Message] | None = None) -> list[int]:
        prompt = Prompt.conversation(self.conversation() if messages is None else messages)
        try:
            return self.generator.encode(prompt)
        except ContextOverflowError as error:
            raise ChatError(
                f"the conversation is {error.prompt_tokens} tokens and the model's context holds {error.context};"
                " /clear starts a new one"
            ) from None
        except PromptError as error:
            raise ChatError(str(error)) from None

    # ------------------------------------------------------------------ answering

    def ask(self, text: str) -> Answer:
        """Return the events of the answer to `text`. The message joins the conversation
        when the iterator starts; nothing changes if it is never started."""
        if not text.strip():
            raise ChatError("the message is empty")
        self._check_idle()
        user = {"role": "user", "content": text}
        prompt_ids = self.prompt_ids(self.conversation() + [user])
        return self._answer(prompt_ids, text, regenerated=False)

    def regenerate(self) -> Answer:
        """Return the events of a new answer to the last user message; the last answer
        leaves the conversation when the iterator starts."""
        self._check_idle()
        messages = self.messages
        if messages and messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        if not messages or messages[-1]["role"] != "user":
            raise ChatError("there is no answer to regenerate yet")
        prompt_ids = self.prompt_ids(self._with_system(messages))
        return self._answer(prompt_ids, messages[-1]["content"], regenerated=True)

    def _check_idle(self) -> None:
        if self._busy:
            raise ChatError("an answer is still being generated")

    def _answer(self, prompt_ids: list[int], user: str, regenerated: bool) -> Answer:
        answer = Answer()
        answer.events = self._answer_events(prompt_ids, user, regenerated, answer)
        return answer

    def _answer_events(
        self, prompt_ids: list[int], user: str, regenerated: bool, answer: Answer
    ) -> abc.Generator[Event, None, None]:
        self._check_idle()
        self._busy = True
        previous = None
        if regenerated:
            if self.messages and self.messages[-1]["role"] == "assistant":
                previous = self.messages.pop()
        else:
            self.messages.append({"role": "user", "content": user})
        turn = Turn(user=user, settings=self.settings.as_dict(), regenerated=regenerated)
        generation: Generation | None = None
        try:
            generation = self.generator.stream(
                prompt_ids, self.settings.sampling.nth(self._generations), self.settings.spec
            )
            self._generations += 1
            turn.stats = generation.stats
            for response in generation:
                self.stats.observe(response.event)
                yield response.event
        finally:
            if generation is not None and not generation.finished:
                answer.tail = generation.close()
                for event in answer.tail:
                    self.stats.observe(event)
            if generation is not None:
                turn.answer = generation.text
            turn.interrupted = generation is None or not generation.finished
            self._settle(turn, previous)

    def _settle(self, turn: Turn, previous: dict | None) -> None:
        self._busy = False
        self.turns.append(turn)
        if turn.answer or not turn.interrupted:
            self.messages.append({"role": "assistant", "content": turn.answer})
        elif previous is not None:
            self.messages.append(previous)  # a /regen stopped before its first word
        else:
            self.messages.pop()  # the question goes too: the conversation is as before

    @property
    def last_turn(self) -> Turn | None:
        return self.turns[-1] if self.turns else None

    # ------------------------------------------------------------------ baseline

    def warm_up(self) -> None:
        """One short unrecorded speculative run (one full step: k drafted tokens and a
        verification pass over k + 1) and two plain target passes, on the conversation so
        far plus a placeholder message. One-time costs of the first passes (allocations,
        kernel set-up) then count against neither the first answer nor the baseline, and
        the template's head (system prompt included) is in the cache for the first turn.
        Nothing is recorded; the conversation is unchanged."""
        ids = self.prompt_ids(self.conversation() + [{"role": "user", "content": "Hi"}])
        greedy = SamplingConfig()
        k = self.settings.spec.k if self.has_drafter else 0
        if not isinstance(k, int):
            k = 4  # the adaptive policy's first step drafts this many
        self.generator.stream(ids, greedy, SpecConfig(k=k, max_new_tokens=k + 1), learn=False).run()
        if self.has_drafter:
            self.generator.stream(ids, greedy, SpecConfig(k=0, max_new_tokens=2), plain=True, stop_at_eos=False).run()

    def wants_baseline(self) -> bool:
        turn = self.last_turn
        return (
            self.has_drafter
            and self.baseline.tokens_per_turn > 0
            and self.baseline.remaining > 0
            and turn is not None
            and not turn.interrupted
            and len(self.generator.target.cached_tokens) > 0
        )

    def measure_baseline(self) -> int:
        """Run one baseline slice (see PlainBaseline) if one is due; call it after an
        answer finished. Returns the tokens measured (0 when none was due). A slice cut
        short by an exception (Ctrl-C) is not counted; the exception propagates."""
        if not self.wants_baseline():
            return 0
        target = self.generator.target
        context = list(target.cached_tokens)
        tokens = min(self.baseline.tokens_per_turn, self.baseline.remaining)
        if target.max_length is not None:
            tokens = min(tokens, target.max_length - len(context) - 1)
        if tokens < 1:
            return 0
        spec = SpecConfig(k=0, max_new_tokens=tokens)
        measured = self.generator.stream(context, self.settings.sampling, spec, plain=True, stop_at_eos=False).run()
        self.baseline.stats.add(measured.stats)
        self.baseline.slices += 1
        return measured.stats.new_tokens

    # ------------------------------------------------------------------ figures

    def report(self) -> SessionReport:
        stats = self.stats
        first = [t.stats.first_token_seconds for t in self.turns if t.stats.first_token_seconds is not None]
        speculative = stats.tokens_per_second
        plain = self.baseline.tokens_per_second
        return SessionReport(
            answers=len(self.turns),
            interrupted=sum(t.interrupted for t in self.turns),
            tokens=stats.new_tokens,
            steps=stats.steps,
            acceptance=stats.acceptance_rate,
            acceptance_by_position=stats.acceptance_by_position,
            tokens_per_step=stats.tokens_per_step,
            predicted_tokens_per_step=stats.predicted_tokens_per_step,
            mean_draft_length=stats.mean_draft_length,
            tokens_per_second=speculative,
            mean_first_token_seconds=sum(first) / len(first) if first else None,
            baseline_tokens_per_second=plain,
            baseline_method=(
                self.baseline.method()
                if self.has_drafter
                else "none needed: without a drafter every answer is plain target decoding"
            ),
            speedup=speedup(speculative, plain) if self.has_drafter else None,
            has_drafter=self.has_drafter,
        )

    def as_dict(self) -> dict:
        """Everything /save writes: the conversation, every answer with its figures, the
        session's figures, the baseline and how it was measured, and the settings."""
        report = self.report()
        return {
            "format": SAVE_FORMAT,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.started)),
            "saved": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "model": self.model_info,
            "settings": self.settings.as_dict(),
            "system": self.system,
            "messages": self.conversation(),
            "turns": [t.as_dict() for t in self.turns],
            "stats": {
                **{k: v for k, v in self.stats.as_dict().items() if k != "time_to_first_token_seconds"},
                "answers": report.answers,
                "interrupted_answers": report.interrupted,
                "mean_time_to_first_token_seconds": None
                if report.mean_first_token_seconds is None
                else round(report.mean_first_token_seconds, 4),
            },
            "baseline": self.baseline.as_dict() if self.has_drafter else None,
            "speedup": None if report.speedup is None else round(report.speedup, 3),
        }
