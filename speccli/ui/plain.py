"""`generate` for pipes and scripts: the prompt read from stdin and the argument, the text
streamed as it comes or one JSON object, statistics on stderr."""

from __future__ import annotations

import json
import sys
from typing import TextIO

from typing import TYPE_CHECKING

from speccli.config import SamplingConfig, SpecConfig
from speccli.events import Event, TokenEvent
from speccli.stats import GenerationStats

from speccli.errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    from speccli.api import Generation
    from speccli.pipeline import Pipeline


class PlainTextRenderer:
    """Writes each token's text as it arrives, flushing so pipes see it at once."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def on_event(self, event: Event) -> None:
        if isinstance(event, TokenEvent) and event.text:
            self.stream.write(event.text)
            self.stream.flush()


def generation_json(generation: Generation, pipeline: Pipeline, sampling: SamplingConfig, spec: SpecConfig) -> dict:
    """`generate --json`: the text, every token with its provenance, what ran, the figures."""
    info = pipeline.model_info()
    return {
        "text": generation.text,
        "token_ids": generation.token_ids,
        "tokens": [
            {
                "id": t.token_id,
                "text": t.text,
                "provenance": t.provenance.value,
                "step": t.step,
                "draft_position": t.draft_position,
            }
            for t in generation.tokens
        ],
        "finish_reason": generation.finish_reason,
        "target": info["target"],
        "draft": info["draft"],
        "settings": {
            "k": spec.k, "max_new_tokens": spec.max_new_tokens, "temperature": sampling.temperature,
            "top_k": sampling.top_k, "top_p": sampling.top_p, "seed": sampling.seed,
            "dtype": info["dtype"], "device": info["device"], "quant": info["quant"],
            "draft_quant": pipeline.draft.quant if pipeline.draft else None,
            "linear": info["linear"],
            "backend": info["backend"],
        },
        "stats": generation.stats.as_dict(),
    }


def dump_json(payload: dict, stream: TextIO) -> None:
    stream.write(json.dumps(payload, ensure_ascii=False) + "\n")
    stream.flush()


def fmt_optional(value: float | None, spec: str, missing: str = "n/a") -> str:
    """A figure that may not exist yet (no steps, nothing drafted)."""
    return missing if value is None else format(value, spec)



def stats_summary(stats: GenerationStats) -> str:
    """A short block for stderr after a generation."""
    rate = stats.acceptance_rate
    acceptance = "n/a (nothing drafted)" if rate is None else f"{100 * rate:.1f}%"
    lines = [
        f"tokens: {stats.new_tokens} in {stats.steps} steps"
        f" | {fmt_optional(stats.tokens_per_second, '.2f')} tok/s"
        f" | acceptance {acceptance}"
        f" | tokens/step {fmt_optional(stats.tokens_per_step, '.2f')}"
        f" (predicted {fmt_optional(stats.predicted_tokens_per_step, '.2f')})"
        f" | first token {fmt_optional(stats.first_token_seconds, '.2f')} s",
    ]
    if stats.acceptance_by_position:
        by_position = " ".join(f"{100 * rate:.0f}%" for rate in stats.acceptance_by_position)
        lines.append(f"acceptance by draft position: {by_position}")
    if stats.tree_steps:
        lines.append(
            f"trees: {stats.tree_steps} of {stats.steps} steps verified a tree;"
            f" {fmt_optional(stats.mean_pass_size, '.1f')} tokens per target pass,"
            f" accepted path {stats.accepted / stats.steps:.2f} tokens on average"
        )
    lines.append(
        f"time: prefill {stats.prefill_seconds:.2f} s, draft {stats.draft_seconds:.2f} s,"
        f" verify {stats.verify_seconds:.2f} s; finished by {stats.finish_reason or 'interrupt'}"
    )
    return "\n".join(lines)


def read_prompt(argument: str | None) -> str:
    """The prompt is piped stdin (if any) followed by the argument."""
    parts: list[str] = []
    if not sys.stdin.isatty():
        data = sys.stdin.buffer.read()
        try:
            piped = data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise UsageError(
                f"standard input is not valid UTF-8 (byte {error.start})",
                "convert it first, e.g. iconv -t UTF-8",
            ) from None
        if piped.strip():
            parts.append(piped.rstrip("\n"))
    if argument is not None and argument.strip():
        parts.append(argument)
    prompt = "\n".join(parts)
    if not prompt.strip():
        raise UsageError("the prompt is empty", 'pass it as an argument or pipe it in: echo "..." | specgen generate')
    return prompt


def print_generation(
    pipeline: Pipeline, generation: Generation, sampling: SamplingConfig, spec: SpecConfig, as_json: bool, show_stats: bool
) -> bool:
    """Stream one generation to stdout: its text, or (as_json) one JSON object at the end;
    statistics to stderr. On Ctrl-C what was generated stays printed (or goes into the JSON,
    marked interrupted) and "interrupted" goes to stderr. Returns whether it finished."""
    renderer = None if as_json else PlainTextRenderer(sys.stdout)
    try:
        for response in generation:
            if renderer is not None:
                renderer.on_event(response.event)
    except KeyboardInterrupt:
        for event in generation.close():  # held back until now, e.g. an incomplete character
            if renderer is not None:
                renderer.on_event(event)
    if as_json:
        dump_json(generation_json(generation, pipeline, sampling, spec), sys.stdout)
    elif sys.stdout.isatty():
        sys.stdout.write("\n")
        sys.stdout.flush()
    if show_stats:
        models = f"target {pipeline.target.describe()}"
        models += f"; draft {pipeline.draft.describe()}" if pipeline.draft else f"; drafter {pipeline.drafter_name}"
        print(models, file=sys.stderr)
        print(stats_summary(generation.stats), file=sys.stderr)
    if not generation.finished:
        print("interrupted", file=sys.stderr)
    return generation.finished
