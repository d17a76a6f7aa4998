"""The live renderer: colours by provenance, plain text without colour, and the exact
wording of the per-answer line and the session report."""

from __future__ import annotations

import io

import pytest

from speccli.chat import SessionReport
from speccli.events import FinishEvent, FinishReason, Provenance, StepEvent, TokenEvent
from speccli.stats import GenerationStats
from speccli.ui.live import (
    LEGEND,
    Printer,
    TokenStream,
    answer_line,
    colour_enabled,
    legend_text,
    session_report,
)


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def tokens(*pieces: tuple[str, Provenance]) -> list[TokenEvent]:
    return [TokenEvent(i, text, prov, 1, i) for i, (text, prov) in enumerate(pieces)]


EVENTS = tokens(
    ("Hel", Provenance.ACCEPTED),
    ("lo", Provenance.RESAMPLED),
    (" wor", Provenance.BONUS),
    ("ld", Provenance.TARGET),
    ("", Provenance.ACCEPTED),
)


def test_colour_only_on_a_terminal_without_no_color(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert colour_enabled(FakeTTY()) is True
    assert colour_enabled(io.StringIO()) is False
    assert colour_enabled(FakeTTY(), requested=False) is False
    monkeypatch.setenv("NO_COLOR", "1")
    assert colour_enabled(FakeTTY()) is False
    monkeypatch.setenv("NO_COLOR", "")  # the convention: only a non-empty value counts
    assert colour_enabled(FakeTTY()) is True


def test_plain_stream_is_the_text_and_nothing_else():
    out = io.StringIO()
    stream = TokenStream(out, colour=False)
    stream.begin()
    for event in EVENTS:
        stream.on_event(event)
    stream.end()
    assert out.getvalue() == "Hello world\n"


def test_coloured_stream_styles_each_token_by_provenance(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    out = FakeTTY()
    stream = TokenStream(out, colour=True)
    stream.begin()
    for event in EVENTS:
        stream.on_event(event)
    stream.end()
    text = out.getvalue()
    assert "\x1b[32mHel\x1b[0m" in text  # accepted: green
    assert "\x1b[33mlo\x1b[0m" in text  # resampled: yellow
    assert "\x1b[36m wor\x1b[0m" in text  # bonus: cyan
    assert "ld" in text and "\x1b[32mld" not in text  # target: the terminal's colour
    assert text.endswith("\n")
    stripped = text.replace("\x1b[32m", "").replace("\x1b[33m", "").replace("\x1b[36m", "").replace("\x1b[0m", "")
    assert stripped == "Hello world\n"


def test_escape_codes_from_the_model_are_shown_not_obeyed():
    out = FakeTTY()
    stream = TokenStream(out, colour=True)
    stream.on_event(TokenEvent(5, "\x1b[2Jboom", Provenance.ACCEPTED, 1, 0))
    assert "\x1b[2J" not in out.getvalue()
    assert "\u241b[2Jboom" in out.getvalue()


def test_end_adds_a_newline_only_when_needed():
    out = io.StringIO()
    stream = TokenStream(out, colour=False)
    stream.on_event(TokenEvent(5, "done\n", Provenance.TARGET, 1, 0))
    stream.end()
    assert out.getvalue() == "done\n"


def test_legend_names_every_provenance_and_colour():
    assert LEGEND == (
        "Token colours: green = drafted and accepted by the target; yellow = the target's own choice"
        " after it rejected a drafted token; cyan = bonus token from the target after it accepted every"
        " drafted token; uncoloured = plain target token (nothing was drafted)."
    )
    assert legend_text().plain == LEGEND


def test_printer_plain_and_styled():
    plain = io.StringIO()
    Printer(plain, colour=False).line("42 tokens", "dim")
    assert plain.getvalue() == "42 tokens\n"
    styled = FakeTTY()
    Printer(styled, colour=True).line("42 tokens", "dim")
    assert styled.getvalue() == "\x1b[2m42 tokens\x1b[0m\n"


def made_stats() -> GenerationStats:
    stats = GenerationStats(first_token_seconds=0.125)
    for step, (drafted, accepted) in enumerate([(4, 4), (4, 1), (4, 2)], start=1):
        for position in range(accepted + 1):
            stats.observe(TokenEvent(7, "x", Provenance.ACCEPTED, step, position))
        stats.observe(StepEvent(step, drafted, accepted, draft_seconds=0.05, verify_seconds=0.05))
    stats.observe(FinishEvent(FinishReason.LENGTH, 10, 3, 0.4))
    return stats


def test_answer_line_exact():
    stats = made_stats()  # 10 tokens in 3 steps, 7 of 12 drafts accepted, 0.3 s decoding
    assert answer_line(stats) == ("10 tokens | 33.3 tok/s | acceptance 58.3% | 3.33 tokens/step | first token 0.12 s")
    assert answer_line(stats, interrupted=True, has_drafter=False) == (
        "interrupted | 10 tokens | 33.3 tok/s | first token 0.12 s"
    )
    assert answer_line(GenerationStats()) == (
        "0 tokens | n/a tok/s | acceptance n/a | n/a tokens/step | first token n/a s"
    )


def test_stats_summary_says_why_acceptance_is_missing():
    from speccli.ui.plain import stats_summary

    assert "| acceptance 58.3% |" in stats_summary(made_stats())
    assert "| acceptance n/a (nothing drafted) |" in stats_summary(GenerationStats())


def report(**changes) -> SessionReport:
    values = dict(
        answers=3,
        interrupted=1,
        tokens=120,
        steps=40,
        acceptance=0.75,
        acceptance_by_position=[0.9, 0.8, 0.7, 0.6],
        tokens_per_step=3.0,
        predicted_tokens_per_step=3.05,
        mean_draft_length=4.0,
        tokens_per_second=30.0,
        mean_first_token_seconds=0.2,
        baseline_tokens_per_second=12.0,
        baseline_method="plain target decoding (no drafter) of 8 tokens after each finished answer,"
        " up to 64 tokens per session; measured so far: 16 tokens in 2 slices",
        speedup=2.5,
        has_drafter=True,
    )
    values.update(changes)
    return SessionReport(**values)


def test_session_report_exact():
    assert session_report(report()) == "\n".join(
        [
            "session: 3 answers (1 interrupted), 120 tokens generated in 40 steps",
            "acceptance: 75.0% of drafted tokens; by draft position: 1: 90%  2: 80%  3: 70%  4: 60%",
            "tokens per step: 3.00 measured, 3.05 predicted by (1 - a^(k+1)) / (1 - a)"
            " with a = 0.750, k = 4.00 (mean draft length)",
            "speed: 30.0 tok/s (decode time, prefill excluded); first token after 0.20 s on average",
            "speed-up: 2.50x over the target alone (12.0 tok/s measured in this session)",
            "baseline: plain target decoding (no drafter) of 8 tokens after each finished answer,"
            " up to 64 tokens per session; measured so far: 16 tokens in 2 slices",
        ]
    )


@pytest.mark.parametrize(
    "changes, expected",
    [
        (
            dict(speedup=None, baseline_tokens_per_second=None),
            "speed-up: not measured yet (the target alone is timed after each finished answer)",
        ),
        (
            dict(has_drafter=False, speedup=None, acceptance=None, acceptance_by_position=[]),
            "acceptance: n/a (no drafter: plain target decoding)",
        ),
    ],
)
def test_session_report_without_figures(changes, expected):
    text = session_report(report(**changes))
    assert expected in text.splitlines()


def test_empty_session_report():
    text = session_report(
        report(
            answers=0,
            interrupted=0,
            tokens=0,
            steps=0,
            acceptance=None,
            acceptance_by_position=[],
            tokens_per_step=None,
            predicted_tokens_per_step=None,
            mean_draft_length=None,
            tokens_per_second=None,
            mean_first_token_seconds=None,
            baseline_tokens_per_second=None,
            speedup=None,
        )
    )
    assert text.splitlines()[:4] == [
        "session: 0 answers, 0 tokens generated in 0 steps",
        "acceptance: n/a of drafted tokens",
        "tokens per step: n/a measured, n/a predicted by (1 - a^(k+1)) / (1 - a)",
        "speed: n/a tok/s (decode time, prefill excluded); first token after n/a s on average",
    ]
