"""`generate` for pipes and scripts: the prompt read from stdin and the argument, the text
streamed as it comes or one JSON object, statistics on stderr."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Generator, Iterator, Protocol, TextIO

from speccli.config import SamplingConfig, SpecConfig
from speccli.events import Event, TokenEvent
from speccli.stats import GenerationStats

from speccli.errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    from speccli.api import Generation
    from speccli.pipeline import Pipeline


class RemoteAnswer(Protocol):
    """A generation streamed from a server (speccli.serve.client.RemoteGeneration): its text
    pieces as they arrive, then what the server reported of it."""

    pieces: Generator[str, None, None]
    text: list[str]
    tokens: list[dict]
    figures: dict | None  # the server's figures: present once the answer finished

    @property
    def finished(self) -> bool: ...

    @property
    def finish_reason(self) -> str: ...

    def __iter__(self) -> Iterator[str]: ...


class PlainTextRenderer:
    """Writes each token's text as it arrives, flushing so pipes see it at once."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def on_event(self, event: Event) -> None:
        if isinstance(event, TokenEvent) and event.text:
            self.stream.write(event.text)
            self.stream.flush()


def token_record(token: TokenEvent) -> dict:
    """One emitted token as `--json` and the server's `specgen.tokens` show it."""
    return {
        "id": token.token_id,
        "text": token.text,
        "provenance": token.provenance.value,
        "step": token.step,
        "draft_position": token.draft_position,
    }


def generation_settings(pipeline: Pipeline, sampling: SamplingConfig, spec: SpecConfig) -> dict:
    """What a generation ran with: its settings and where the models ran."""
    info = pipeline.model_info()
    return {
        "drafter": info["drafter"],
        "k": spec.k,
        "tree": "auto" if spec.tree is None else spec.tree,
        "max_new_tokens": spec.max_new_tokens,
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "seed": sampling.seed,
        "dtype": info["dtype"],
        "device": info["device"],
        "quant": info["quant"],
        "draft_quant": pipeline.draft.quant if pipeline.draft else None,
        "linear": info["linear"],
        "backend": info["backend"],
    }


def generation_record(
    text: str,
    tokens: list[dict],
    finish_reason: str,
    target: str | None,
    draft: str | None,
    settings: dict | None,
    stats: dict | None,
) -> dict:
    """`generate --json`'s object, from its parts: built here for a local generation and by
    `generate --server` from what the server sent, so both print the same shape."""
    return {
        "text": text,
        "token_ids": [t["id"] for t in tokens],
        "tokens": tokens,
        "finish_reason": finish_reason,
        "target": target,
        "draft": draft,
        "settings": settings,
        "stats": stats,
    }


def generation_json(generation: Generation, pipeline: Pipeline, sampling: SamplingConfig, spec: SpecConfig) -> dict:
    """`generate --json`: the text, every token with its provenance, what ran, the figures."""
    info = pipeline.model_info()
    return generation_record(
        generation.text,
        [token_record(t) for t in generation.tokens],
        generation.finish_reason,
        info["target"],
        info["draft"],
        generation_settings(pipeline, sampling, spec),
        generation.stats.as_dict(),
    )


def models_line(pipeline: Pipeline) -> str:
    """What `--stats` says ran: the target, and the draft model or the drafter."""
    line = f"target {pipeline.target.describe()}"
    return line + (f"; draft {pipeline.draft.describe()}" if pipeline.draft else f"; drafter {pipeline.drafter_name}")


def dump_json(payload: dict, stream: TextIO) -> None:
    stream.write(json.dumps(payload, ensure_ascii=False) + "\n")
    stream.flush()


def fmt_optional(value: float | None, spec: str, missing: str = "n/a") -> str:
    """A figure that may not exist yet (no steps, nothing drafted)."""
    return missing if value is None else format(value, spec)


def stats_summary(stats: GenerationStats) -> str:
    """A short block for stderr after a generation."""
    return figures_summary(stats.as_dict())


def figures_summary(figures: dict) -> str:
    """`stats_summary` from a generation's figures as `GenerationStats.as_dict` gives them
    (which is what a server sends back)."""
    rate = figures["acceptance_rate"]
    acceptance = "n/a (nothing drafted)" if rate is None else f"{100 * rate:.1f}%"
    lines = [
        f"tokens: {figures['new_tokens']} in {figures['steps']} steps"
        f" | {fmt_optional(figures['tokens_per_second'], '.2f')} tok/s"
        f" | acceptance {acceptance}"
        f" | tokens/step {fmt_optional(figures['tokens_per_step'], '.2f')}"
        f" (predicted {fmt_optional(figures['predicted_tokens_per_step'], '.2f')})"
        f" | first token {fmt_optional(figures['time_to_first_token_seconds'], '.2f')} s",
    ]
    if figures["acceptance_by_position"]:
        by_position = " ".join(f"{100 * rate:.0f}%" for rate in figures["acceptance_by_position"])
        lines.append(f"acceptance by draft position: {by_position}")
    methods = figures.get("steps_by_method") or {}
    if len(methods) > 1:
        lines.append("steps by method: " + ", ".join(f"{name} {count}" for name, count in methods.items()))
    if figures["tree_steps"]:
        lines.append(
            f"trees: {figures['tree_steps']} of {figures['steps']} steps verified a tree;"
            f" {fmt_optional(figures['mean_pass_size'], '.1f')} tokens per target pass,"
            f" accepted path {figures['accepted'] / figures['steps']:.2f} tokens on average"
        )
    lines.append(
        f"time: prefill {figures['prefill_seconds']:.2f} s, draft {figures['draft_seconds']:.2f} s,"
        f" verify {figures['verify_seconds']:.2f} s; finished by {figures['finish_reason'] or 'interrupt'}"
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
    pipeline: Pipeline,
    generation: Generation,
    sampling: SamplingConfig,
    spec: SpecConfig,
    as_json: bool,
    show_stats: bool,
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
        print(models_line(pipeline), file=sys.stderr)
        print(stats_summary(generation.stats), file=sys.stderr)
    if not generation.finished:
        print("interrupted", file=sys.stderr)
    return generation.finished


def print_remote_generation(remote: RemoteAnswer, as_json: bool, show_stats: bool) -> bool:
    """`generate --server`: what `print_generation` prints for a local generation, from the
    server's stream (the text as it comes, or the same JSON object; the same statistics). On
    Ctrl-C the connection closes, which stops the server's generation within one step."""
    try:
        for piece in remote:
            if not as_json:
                sys.stdout.write(piece)
                sys.stdout.flush()
    except KeyboardInterrupt:
        remote.pieces.close()
    figures = remote.figures
    if as_json:
        text = "".join(remote.text)
        if figures is None:
            record = generation_record(text, remote.tokens, remote.finish_reason, None, None, None, None)
        else:
            record = generation_record(
                text,
                remote.tokens,
                figures["finish_reason"],
                figures["target"],
                figures["draft"],
                figures["settings"],
                figures["stats"],
            )
        dump_json(record, sys.stdout)
    elif sys.stdout.isatty():
        sys.stdout.write("\n")
        sys.stdout.flush()
    if show_stats and figures is not None:
        print(figures["models"], file=sys.stderr)
        print(figures_summary(figures["stats"]), file=sys.stderr)
    if not remote.finished:
        print("interrupted", file=sys.stderr)
    return remote.finished
