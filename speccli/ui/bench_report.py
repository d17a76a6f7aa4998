"""Bench results as a rich table, JSON, CSV, Markdown, or a PNG plot. Nothing here runs a model."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from speccli.bench.results import BenchResults, BenchSummary
from speccli.errors import UsageError
from speccli.ui.consoles import PipeAwareConsole

FORMATS = ("table", "json", "csv", "md")

CSV_COLUMNS = (
    "prompt",
    "category",
    "k",
    "repeat",
    "prompt_tokens",
    "plain_first",
    "plain_tokens",
    "plain_decode_seconds",
    "plain_tokens_per_second",
    "spec_tokens",
    "spec_decode_seconds",
    "spec_tokens_per_second",
    "speedup",
    "end_to_end_speedup",
    "steps",
    "drafted",
    "accepted",
    "acceptance_rate",
    "tokens_per_step",
    "predicted_tokens_per_step",
    "mean_pass_size",
    "tree_steps",
    "steps_by_method",
    "acceptance_by_position",
    "identical",
    "check",
    "mismatch_position",
    "divergence_gap",
    "error",
)

SUMMARY_COLUMNS = (
    "prompt",
    "category",
    "k",
    "plain tok/s",
    "spec tok/s",
    "speed-up",
    "range",
    "acceptance",
    "tokens/step",
    "predicted",
    "pass size",
    "acceptance by position",
    "errors",
)

ALL_PROMPTS = "all prompts"


class ReportError(UsageError):
    """A report cannot be produced (e.g. matplotlib is missing for the plot)."""


# --------------------------------------------------------------------------- cells


def _num(value: float | None, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _positions(rates: Sequence[float]) -> str:
    return " ".join(f"{100 * r:.0f}" for r in rates) if rates else "-"


def _speedup(s: BenchSummary) -> str:
    return "-" if s.speedup is None else f"{s.speedup.median:.2f}x"


def _range(s: BenchSummary) -> str:
    if s.speedup is None or s.speedup.n < 2:
        return "-"
    return f"{s.speedup.min:.2f}-{s.speedup.max:.2f}"


def _errors(s: BenchSummary) -> str:
    """Mismatches and failed runs; near-ties are shown beside them but are not errors."""
    parts = []
    if s.near_ties:
        parts.append(f"({s.near_ties} near-tie" + ("s)" if s.near_ties > 1 else ")"))
    if s.mismatches:
        parts.append(f"{s.mismatches} mismatch" + ("es" if s.mismatches > 1 else ""))
    if s.failures:
        parts.append(f"{s.failures} failed")
    return ", ".join(parts) or "0"


def summary_cells(s: BenchSummary) -> list[str]:
    """The cells of one summary line, in SUMMARY_COLUMNS order."""
    return [
        s.prompt if s.prompt is not None else (ALL_PROMPTS if s.category is None else f"all {s.category}"),
        s.category or "-",
        "all" if s.k is None else str(s.k),
        _num(s.plain_tokens_per_second, ".2f"),
        _num(s.spec_tokens_per_second, ".2f"),
        _speedup(s),
        _range(s),
        _pct(s.acceptance_rate),
        _num(s.tokens_per_step, ".2f"),
        _num(s.predicted_tokens_per_step, ".2f"),
        _num(s.mean_pass_size, ".1f"),
        _positions(s.acceptance_by_position),
        _errors(s),
    ]


def _totals(results: BenchResults) -> list[BenchSummary]:
    """Per-k summaries over every prompt, the overall one when there are several k, then
    one per category when there are several categories."""
    by_k = results.by_k
    return by_k + ([results.overall] if len(by_k) > 1 else []) + results.by_category


def headline(results: BenchResults) -> str:
    """One line for stderr or a caption: the overall median speed-up and its spread."""
    o = results.overall
    if o.speedup is None:
        return "no completed runs"
    sp = o.speedup
    spread = f", stdev {sp.stdev:.2f}" if sp.stdev is not None else ""
    line = (
        f"speed-up: median {sp.median:.2f}x, mean {sp.mean:.2f}x (min {sp.min:.2f}x, max {sp.max:.2f}x{spread})"
        f" over {sp.n} runs; plain {_num(o.plain_tokens_per_second, '.2f')} tok/s,"
        f" speculative {_num(o.spec_tokens_per_second, '.2f')} tok/s"
    )
    checked = o.identical + o.near_ties + o.mismatches
    if checked:
        line += f"; greedy: {o.identical} identical, {o.near_ties} near-ties, {o.mismatches} mismatches"
    if o.errors:
        line += f"; {o.errors} error rows"
    if not results.complete:
        line += " (interrupted: partial results)"
    return line


def error_lines(results: BenchResults) -> list[str]:
    return [f"{r.prompt} k={r.k} repeat {r.repeat + 1}: {r.error}" for r in results.errors]


def near_tie_lines(results: BenchResults) -> list[str]:
    """One line per greedy row whose outputs part at a near-tie (not an error)."""
    return [
        f"{r.prompt} k={r.k} repeat {r.repeat + 1}: {r.divergence.describe()}"
        for r in results.rows
        if r.divergence is not None and r.divergence.near_tie  # r.near_tie
    ]


# --------------------------------------------------------------------------- formats


def _text_cells(summary: BenchSummary) -> list[Text]:
    # Prompt names and categories are the user's: "[...]" in them is text, not Rich markup.
    return [Text(cell) for cell in summary_cells(summary)]


def print_table(results: BenchResults, console: Console) -> None:
    """A rich table per (prompt, k), then the per-k totals, then any near-ties and errors."""
    table = Table(title="speculative vs plain decoding", caption=headline(results), title_justify="left")
    for name in SUMMARY_COLUMNS:
        numeric = name not in ("prompt", "category", "acceptance by position", "errors")
        table.add_column(name, justify="right" if numeric else "left", no_wrap=name == "prompt")
    for s in results.by_prompt:
        style = "red" if s.errors else None
        table.add_row(*_text_cells(s), style=style)
    table.add_section()
    for s in _totals(results):
        table.add_row(*_text_cells(s), style="bold red" if s.errors else "bold")
    console.print(table)
    for line in near_tie_lines(results):
        console.print(Text(f"near-tie: {line}", style="yellow"))
    for line in error_lines(results):
        console.print(Text(f"error: {line}", style="red"))


def table_text(results: BenchResults, width: int = 160) -> str:
    """The rich table as plain text (for --output FILE with the table format)."""
    buffer = io.StringIO()
    print_table(results, Console(file=buffer, width=width, color_system=None, force_terminal=False))
    return buffer.getvalue()


def to_json(results: BenchResults, tokens: bool = False) -> str:
    return json.dumps(results.as_dict(tokens), indent=2, ensure_ascii=False) + "\n"


def _csv_value(value) -> str | int | float:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return value


def to_csv(results: BenchResults) -> str:
    """One line per side-by-side pair (prompt, k, repeat), with CSV_COLUMNS as the header."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for row in results.rows:
        plain, spec = row.plain, row.spec
        speedup, e2e = row.speedup, row.end_to_end_speedup
        st = spec.stats if spec is not None else None
        values = {
            "prompt": row.prompt,
            "category": row.category,
            "k": row.k,
            "repeat": row.repeat,
            "prompt_tokens": row.prompt_tokens,
            "plain_first": row.plain_first,
            "plain_tokens": plain.new_tokens if plain else None,
            "plain_decode_seconds": round(plain.decode_seconds, 6) if plain else None,
            "plain_tokens_per_second": _r(plain.tokens_per_second if plain else None, 3),
            "spec_tokens": spec.new_tokens if spec else None,
            "spec_decode_seconds": round(spec.decode_seconds, 6) if spec else None,
            "spec_tokens_per_second": _r(spec.tokens_per_second if spec else None, 3),
            "speedup": _r(speedup, 4),
            "end_to_end_speedup": _r(e2e, 4),
            "steps": st.steps if st else None,
            "drafted": st.drafted if st else None,
            "accepted": st.accepted if st else None,
            "acceptance_rate": _r(st.acceptance_rate if st else None, 4),
            "tokens_per_step": _r(st.tokens_per_step if st else None, 4),
            "predicted_tokens_per_step": _r(st.predicted_tokens_per_step if st else None, 4),
            "mean_pass_size": _r(st.mean_pass_size if st else None, 4),
            "tree_steps": st.tree_steps if st else None,
            "steps_by_method": " ".join(f"{m.replace(' ', '-')}:{n}" for m, n in st.methods.most_common())
            if st
            else None,
            "acceptance_by_position": " ".join(f"{x:.4f}" for x in st.acceptance_by_position) if st else None,
            "identical": row.identical,
            "check": row.check,
            "mismatch_position": row.mismatch_position,
            "divergence_gap": None if row.divergence is None else _r(row.divergence.gap, 6),
            "error": row.error,
        }
        writer.writerow([_csv_value(values[c]) for c in CSV_COLUMNS])
    return buffer.getvalue()


def _r(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _md_escape(cell: str) -> str:
    return cell.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def to_markdown(results: BenchResults) -> str:
    """A Markdown table per (prompt, k), the per-k totals in bold, the headline, near-ties and errors."""
    lines = [
        "| " + " | ".join(SUMMARY_COLUMNS) + " |",
        "|"
        + "|".join(
            "---" if c in ("prompt", "category", "acceptance by position", "errors") else "---:"
            for c in SUMMARY_COLUMNS
        )
        + "|",
    ]
    for s in results.by_prompt:
        lines.append("| " + " | ".join(_md_escape(c) for c in summary_cells(s)) + " |")
    for s in _totals(results):
        lines.append("| " + " | ".join(f"**{_md_escape(c)}**" for c in summary_cells(s)) + " |")
    lines += ["", headline(results)]
    near_ties = near_tie_lines(results)
    if near_ties:
        lines += ["", "Near-ties (rounding, not errors):", ""] + [f"- {_md_escape(e)}" for e in near_ties]
    errors = error_lines(results)
    if errors:
        lines += ["", "Errors:", ""] + [f"- {_md_escape(e)}" for e in errors]
    return "\n".join(lines) + "\n"


def render(results: BenchResults, fmt: str, width: int = 160) -> str:
    """Any format as text: table (plain, no colour), json, csv or md."""
    if fmt == "table":
        return table_text(results, width)
    if fmt == "json":
        return to_json(results)
    if fmt == "csv":
        return to_csv(results)
    if fmt == "md":
        return to_markdown(results)
    raise ReportError(f"unknown report format {fmt!r}", f"choose one of {', '.join(FORMATS)}")


# --------------------------------------------------------------------------- plot


def plot(results: BenchResults, path: Path) -> Path:
    """A PNG with two panels: speed-up (median, min-max whiskers) and acceptance rate,
    per prompt, one bar per k. Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        raise ReportError("the plot needs matplotlib, which is not installed", "pip install matplotlib") from None

    path = Path(path)
    summaries = results.by_prompt
    prompts = results.prompts
    ks = [k for k in results.settings.ks if any(s.k == k for s in summaries)]
    cell = {(s.prompt, s.k): s for s in summaries}
    totals = {s.k: s for s in results.by_k}
    labels = prompts + [ALL_PROMPTS]

    width = 0.8 / max(1, len(ks))
    fig_width = max(6.0, 0.9 * len(labels) * max(1, len(ks)) ** 0.5 + 2)
    fig, (ax_speed, ax_accept) = plt.subplots(2, 1, figsize=(fig_width, 7.5), sharex=True)
    for i, k in enumerate(ks):
        medians, low, high, accept = [], [], [], []
        for label in labels:
            s = totals.get(k) if label == ALL_PROMPTS else cell.get((label, k))
            sp = None if s is None else s.speedup
            m = float("nan") if sp is None else sp.median
            medians.append(m)
            low.append(0.0 if sp is None else m - sp.min)
            high.append(0.0 if sp is None else sp.max - m)
            rate = None if s is None else s.acceptance_rate
            accept.append(float("nan") if rate is None else 100 * rate)
        xs = [j + (i - (len(ks) - 1) / 2) * width for j in range(len(labels))]
        ax_speed.bar(xs, medians, width, yerr=[low, high], capsize=2, label=f"k={k}")
        ax_accept.bar(xs, accept, width, label=f"k={k}")
    ax_speed.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax_speed.set_ylabel("speed-up (spec / plain tok/s)")
    ax_speed.set_title("speculative vs plain decoding")
    ax_speed.legend(fontsize="small")
    ax_accept.set_ylabel("acceptance rate (%)")
    ax_accept.set_ylim(0, 100)
    ax_accept.set_xticks(range(len(labels)))
    ax_accept.set_xticklabels(labels, rotation=45, ha="right", fontsize="small")
    fig.tight_layout()
    try:
        fig.savefig(path, format="png", dpi=120)
    except OSError as error:
        raise ReportError(
            f"cannot write the plot to {path}: {error.strerror or error}", "check the folder exists and is writable"
        ) from None
    finally:
        plt.close(fig)
    return path


__all__ = [
    "CSV_COLUMNS",
    "FORMATS",
    "ReportError",
    "SUMMARY_COLUMNS",
    "error_lines",
    "headline",
    "near_tie_lines",
    "plot",
    "print_table",
    "render",
    "summary_cells",
    "table_text",
    "to_csv",
    "to_json",
    "to_markdown",
]


def write(results: BenchResults, fmt: str, output: str | None = None) -> None:
    """The report to the file `output`, else to stdout: a Rich table on a terminal, the
    format's text otherwise."""
    import sys

    if output:
        with open(output, "w", encoding="utf-8") as handle:
            handle.write(render(results, fmt))
    elif fmt == "table" and sys.stdout.isatty():
        print_table(results, PipeAwareConsole())
    else:
        sys.stdout.write(render(results, fmt))
        sys.stdout.flush()
