"""Renderers for pipes and scripts: plain streamed text, or one JSON object."""

from __future__ import annotations

import json
from typing import TextIO

from speccli.engine.events import Event, TokenEvent
from speccli.stats import GenerationStats


class PlainTextRenderer:
    """Writes each token's text as it arrives, flushing so pipes see it at once."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def on_event(self, event: Event) -> None:
        if isinstance(event, TokenEvent) and event.text:
            self.stream.write(event.text)
            self.stream.flush()


class TokenRecorder:
    """Keeps every emitted token for the JSON output."""

    def __init__(self) -> None:
        self.tokens: list[TokenEvent] = []

    def on_event(self, event: Event) -> None:
        if isinstance(event, TokenEvent):
            self.tokens.append(event)

    def as_dict(self) -> dict:
        return {
            "text": "".join(t.text for t in self.tokens),
            "token_ids": [t.token_id for t in self.tokens],
            "tokens": [
                {
                    "id": t.token_id,
                    "text": t.text,
                    "provenance": t.provenance.value,
                    "step": t.step,
                    "draft_position": t.draft_position,
                }
                for t in self.tokens
            ],
        }


def dump_json(payload: dict, stream: TextIO) -> None:
    stream.write(json.dumps(payload, ensure_ascii=False) + "\n")
    stream.flush()


def fmt_optional(value: float | None, spec: str, missing: str = "n/a") -> str:
    """A figure that may not exist yet (no steps, nothing drafted)."""
    return missing if value is None else format(value, spec)



def stats_summary(stats: GenerationStats) -> str:
    """A short block for stderr after a generation."""
    acceptance = stats.acceptance_rate
    lines = [
        f"tokens: {stats.new_tokens} in {stats.steps} steps"
        f" | {fmt_optional(stats.tokens_per_second, '.2f')} tok/s"
        f" | acceptance {fmt_optional(None if acceptance is None else 100 * acceptance, '.1f')}%"
        f" | tokens/step {fmt_optional(stats.tokens_per_step, '.2f')}"
        f" (predicted {fmt_optional(stats.predicted_tokens_per_step, '.2f')})"
        f" | first token {fmt_optional(stats.first_token_seconds, '.2f')} s",
    ]
    if stats.acceptance_by_position:
        by_position = " ".join(f"{100 * rate:.0f}%" for rate in stats.acceptance_by_position)
        lines.append(f"acceptance by draft position: {by_position}")
    lines.append(
        f"time: prefill {stats.prefill_seconds:.2f} s, draft {stats.draft_seconds:.2f} s,"
        f" verify {stats.verify_seconds:.2f} s; finished by {stats.finish_reason or 'interrupt'}"
    )
    return "\n".join(lines)
