"""OpenAI's response objects (whole, and as stream chunks) for chat and text completions,
with a `specgen` object of the generation's figures: what `generate --json` reports."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from speccli.config import SamplingConfig, SpecConfig
from speccli.events import TokenEvent
from speccli.serve.schema import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChunkChoice,
    Delta,
    ModelCard,
    TextChoice,
    TextCompletion,
    Usage,
)
from speccli.ui.plain import generation_settings, models_line, token_record

if TYPE_CHECKING:  # pragma: no cover
    from speccli.api import Generation, Speculator
    from speccli.pipeline import Pipeline

# specgen's finish reasons in OpenAI's words: an end-of-sequence token and a stop string are
# both "stop"; the token limit and a full context are both "length".
FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "length": "length", "context": "length"}


@dataclass(frozen=True)
class Served:
    """What the server serves: the name clients ask for, and the loaded pair."""

    name: str
    pipeline: Pipeline
    speculator: Speculator
    created: int

    def model_card(self) -> ModelCard:
        info = self.pipeline.model_info()
        return ModelCard(
            id=self.name,
            created=self.created,
            specgen={
                **info,
                "models": models_line(self.pipeline),
                "context": self.speculator.target.max_length,
            },
        )


def usage(prompt_tokens: int, generation: Generation) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(generation.tokens),
        "total_tokens": prompt_tokens + len(generation.tokens),
        "prompt_tokens_details": {"cached_tokens": generation.stats.reused_tokens},
    }


def estimated_speedup(served: Served, generation: Generation) -> float | None:
    """This generation's tokens/s over the plain target's, estimated from the measured cost of
    a one-token pass (the calibration `k auto` runs on); None without a drafter or costs."""
    costs = served.speculator.decoder.costs
    stats = generation.stats
    if served.speculator.drafter is None or costs is None or not costs.verify_seconds:
        return None
    if stats.new_tokens == 0 or stats.decode_seconds <= 0:
        return None
    return round(costs.interpolated(1) * stats.new_tokens / stats.decode_seconds, 3)


def figures(
    served: Served, generation: Generation, sampling: SamplingConfig, spec: SpecConfig, with_tokens: bool
) -> dict:
    """The `specgen` object of a finished response: what speculation did, and everything
    `generate --json` prints but the text and tokens (those too, with `with_tokens`)."""
    stats = generation.stats.as_dict()
    info = served.pipeline.model_info()
    payload = {
        "drafter": served.pipeline.drafter_name,
        **{name: stats[name] for name in ("drafted", "accepted", "acceptance_rate", "tokens_per_step")},
        "estimated_speedup": estimated_speedup(served, generation),
        "finish_reason": generation.finish_reason,
        "target": info["target"],
        "draft": info["draft"],
        "models": models_line(served.pipeline),
        "settings": generation_settings(served.pipeline, sampling, spec),
        "stats": stats,
    }
    if with_tokens:
        payload["tokens"] = [token_record(t) for t in generation.tokens]
    return payload


def finish_reason(generation: Generation) -> str:
    return FINISH_REASONS.get(generation.finish_reason, "stop")


class Reply:
    """The objects of one response: a chat completion or a text completion, whole or as chunks
    (speccli.serve.schema's typed models, dumped for the wire)."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model

    def _head(self) -> dict:
        return {"id": self.id, "created": self.created, "model": self.model}

    def whole(self, generation: Generation, usage_: dict, specgen: dict) -> dict:
        finish = finish_reason(generation)
        if self.chat:
            choice = ChatChoice(message=AssistantMessage(content=generation.text), finish_reason=finish)
            answer: ChatCompletion | TextCompletion = ChatCompletion(
                **self._head(), choices=[choice], usage=Usage(**usage_), specgen=specgen
            )
        else:
            answer = TextCompletion(
                **self._head(),
                choices=[TextChoice(text=generation.text, finish_reason=finish)],
                usage=Usage(**usage_),
                specgen=specgen,
            )
        return answer.model_dump()

    def _chunk(
        self, text: str | None, finish: str | None = None, role: bool = False, specgen: dict | None = None
    ) -> dict:
        if self.chat:
            delta = Delta(role="assistant" if role else None, content=text)
            chunk: ChatCompletionChunk | TextCompletion = ChatCompletionChunk(
                **self._head(), choices=[ChunkChoice(delta=delta, finish_reason=finish)], specgen=specgen
            )
        else:
            chunk = TextCompletion(
                **self._head(), choices=[TextChoice(text=text or "", finish_reason=finish)], specgen=specgen
            )
        payload = _without_null_specgen(chunk.model_dump())
        for choice in payload["choices"]:
            if "delta" in choice:  # as OpenAI's: a delta holds only what it changes
                choice["delta"] = {key: value for key, value in choice["delta"].items() if value is not None}
        return payload

    def first_chunk(self) -> dict | None:
        """A chat stream opens with the assistant's role (and empty content), as OpenAI's does."""
        return self._chunk("", role=True) if self.chat else None

    def token_chunk(self, token: TokenEvent, with_tokens: bool) -> dict:
        return self._chunk(token.text, specgen={"tokens": [token_record(token)]} if with_tokens else None)

    def finish_chunk(self, generation: Generation, specgen: dict) -> dict:
        return self._chunk(None, finish_reason(generation), specgen=specgen)

    def usage_chunk(self, usage_: dict) -> dict:
        chunk = ChatCompletionChunk if self.chat else TextCompletion
        return _without_null_specgen(chunk(**self._head(), choices=[], usage=Usage(**usage_)).model_dump())


def _without_null_specgen(payload: dict) -> dict:
    if payload.get("specgen") is None:
        payload.pop("specgen", None)
    return payload
