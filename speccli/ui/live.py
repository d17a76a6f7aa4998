"""Streaming an answer to a terminal with each token coloured by where it came from, the
one line of figures after each answer, and the session report.

Colour only when stdout is a terminal and NO_COLOR is unset (or empty), unless the caller
decides otherwise; without colour the text is written as it is, with no escape codes.
Formatting (answer_line, session_report) returns plain strings so it can be tested exactly.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, TextIO

from speccli.events import Event, Provenance, TokenEvent
from speccli.stats import GenerationStats
from speccli.ui.plain import fmt_optional

if TYPE_CHECKING:  # pragma: no cover
    from speccli.chat import SessionReport

# Rich style names per provenance ("" = the terminal's own colour).
STYLES: dict[Provenance, str] = {
    Provenance.ACCEPTED: "green",
    Provenance.RESAMPLED: "yellow",
    Provenance.BONUS: "cyan",
    Provenance.TARGET: "",
}

LEGEND_ITEMS: tuple[tuple[Provenance, str, str], ...] = (
    (Provenance.ACCEPTED, "green", "drafted and accepted by the target"),
    (Provenance.RESAMPLED, "yellow", "the target's own choice after it rejected a drafted token"),
    (Provenance.BONUS, "cyan", "bonus token from the target after it accepted every drafted token"),
    (Provenance.TARGET, "uncoloured", "plain target token (nothing was drafted)"),
)

LEGEND = "Token colours: " + "; ".join(f"{colour} = {meaning}" for _, colour, meaning in LEGEND_ITEMS) + "."

STATS_STYLE = "dim"
ERROR_STYLE = "red"

FORMULA = "(1 - a^(k+1)) / (1 - a)"


def colour_enabled(stream: TextIO, requested: bool | None = None) -> bool:
    """Whether to colour what goes to `stream`: `requested` if given (--color/--no-color),
    else only on a terminal and only when NO_COLOR is unset or empty."""
    if requested is not None:
        return requested
    if os.environ.get("NO_COLOR"):
        return False
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (ValueError, OSError):  # a closed or odd stream
        return False


def _console(stream: TextIO):
    from speccli.ui.consoles import PipeAwareConsole

    return PipeAwareConsole(
        file=stream,
        force_terminal=True,
        highlight=False,
        markup=False,
        emoji=False,
        soft_wrap=True,  # the terminal wraps; Rich must not insert newlines of its own
    )


def _safe(text: str) -> str:
    """Model output must not drive the terminal: show ESC as a visible character."""
    return text.replace("\x1b", "\u241b")


def legend_text():
    """The legend as Rich Text, each colour name in its colour."""
    from rich.text import Text

    text = Text("Token colours: ")
    for index, (provenance, colour, meaning) in enumerate(LEGEND_ITEMS):
        if index:
            text.append("; ")
        text.append(colour, style=STYLES[provenance] or None)
        text.append(f" = {meaning}")
    text.append(".")
    return text


class Printer:
    """Lines of text for one stream (stderr: notes, figures, errors), styled when colour is on."""

    def __init__(self, stream: TextIO, colour: bool) -> None:
        self.stream = stream
        self.colour = colour
        self._console = _console(stream) if colour else None

    def line(self, text: str = "", style: str | None = None) -> None:
        if self._console is not None:
            from rich.text import Text

            self._console.print(Text(text, style=style or ""))
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def legend(self) -> None:
        if self._console is not None:
            self._console.print(legend_text())
        else:
            self.line(LEGEND)


class TokenStream:
    """Writes an answer token by token as the events arrive; coloured by provenance when
    colour is on (Rich styled Text segments), plain text otherwise."""

    def __init__(self, stream: TextIO, colour: bool) -> None:
        self.stream = stream
        self.colour = colour
        self._console = _console(stream) if colour else None
        self._last = "\n"

    def begin(self) -> None:
        self._last = "\n"

    def on_event(self, event: Event) -> None:
        if not isinstance(event, TokenEvent) or not event.text:
            return
        if self._console is not None:
            from rich.text import Text

            self._console.print(Text(_safe(event.text), style=STYLES[event.provenance]), end="")
        else:
            self.stream.write(event.text)
            self.stream.flush()
        self._last = event.text[-1]

    def end(self) -> None:
        """Finish the answer's line (and undo any style an interrupt left open)."""
        closing = ("\x1b[0m" if self.colour else "") + ("" if self._last == "\n" else "\n")
        if closing:
            self.stream.write(closing)
            self.stream.flush()
        self._last = "\n"


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def answer_line(stats: GenerationStats, interrupted: bool = False, has_drafter: bool = True) -> str:
    """One line after each answer: tokens, tokens/s, acceptance, tokens per step, time to
    first token."""
    parts = ["interrupted"] if interrupted else []
    parts += [f"{stats.new_tokens} tokens", f"{fmt_optional(stats.tokens_per_second, '.1f')} tok/s"]
    if has_drafter:
        parts += [
            f"acceptance {_percent(stats.acceptance_rate)}",
            f"{fmt_optional(stats.tokens_per_step, '.2f')} tokens/step",
        ]
        if stats.tree_steps:
            parts.append(f"{fmt_optional(stats.mean_pass_size, '.1f')} tokens/pass (trees)")
        if len(stats.methods) > 1:
            parts.append(", ".join(f"{name} {count}" for name, count in stats.methods.most_common()))
    parts.append(f"first token {fmt_optional(stats.first_token_seconds, '.2f')} s")
    return " | ".join(parts)


def session_report(report: "SessionReport") -> str:
    """The session's figures: what /stats and the end of a session show."""
    answers = f"{report.answers} answer{'s' if report.answers != 1 else ''}"
    if report.interrupted:
        answers += f" ({report.interrupted} interrupted)"
    lines = [f"session: {answers}, {report.tokens} tokens generated in {report.steps} steps"]
    if report.has_drafter:
        acceptance = f"acceptance: {_percent(report.acceptance)} of drafted tokens"
        if report.acceptance_by_position:
            by_position = "  ".join(
                f"{i}: {100 * rate:.0f}%" for i, rate in enumerate(report.acceptance_by_position, start=1)
            )
            acceptance += f"; by draft position: {by_position}"
        lines.append(acceptance)
        predicted = f"{fmt_optional(report.predicted_tokens_per_step, '.2f')} predicted by {FORMULA}"
        if report.acceptance is not None and report.mean_draft_length is not None:
            predicted += f" with a = {report.acceptance:.3f}, k = {report.mean_draft_length:.2f} (mean draft length)"
        lines.append(f"tokens per step: {fmt_optional(report.tokens_per_step, '.2f')} measured, {predicted}")
    else:
        lines.append("acceptance: n/a (no drafter: plain target decoding)")
    lines.append(
        f"speed: {fmt_optional(report.tokens_per_second, '.1f')} tok/s (decode time, prefill excluded);"
        f" first token after {fmt_optional(report.mean_first_token_seconds, '.2f')} s on average"
    )
    if report.speedup is not None:
        lines.append(
            f"speed-up: {report.speedup:.2f}x over the target alone"
            f" ({report.baseline_tokens_per_second:.1f} tok/s measured in this session)"
        )
    elif report.has_drafter:
        lines.append("speed-up: not measured yet (the target alone is timed after each finished answer)")
    else:
        lines.append("speed-up: n/a (no drafter)")
    lines.append(f"baseline: {report.baseline_method}")
    return "\n".join(lines)
