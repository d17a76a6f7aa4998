"""`specgen models`: the aliases as a table for people, or JSON for scripts."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TextIO

from speccli.models.formats.converted import ConvertedEntry
from speccli.models.pairs.drafts import HEAD_LAYOUTS, DraftOption, heads_for
from speccli.models.names.registry import DEFAULT_DRAFT, DEFAULT_TARGET, ModelListing, format_size

FOOTER = (
    "Weights: on a GPU, from the model's config where it is on this machine (else `specgen plan --target ALIAS`). "
    "Also accepted: a Hugging Face hub id (owner/name), a local model folder, a .gguf file,"
    " and for --draft: `ngram` (prompt lookup), `suffix` (suffix drafting), `lookahead` (lookahead decoding),"
    " `medusa` or `eagle` (heads trained with `specgen train`; see `specgen heads`), `eagle3:`/`eagle:`/`medusa:` with"
    " a Hub id or folder (published heads; `specgen models --drafts-for TARGET` lists those registered) or `none`."
)


def published_heads(alias: str) -> list[str]:
    """The published heads registered for an alias, as --draft takes them."""
    return [head.draft for head in heads_for(alias)]


def print_json(listings: list[ModelListing], stream: TextIO | None = None) -> None:
    rows = [{**asdict(item), "published_heads": published_heads(item.alias)} for item in listings]
    print(json.dumps(rows, ensure_ascii=False, indent=2), file=stream or sys.stdout)


def print_table(listings: list[ModelListing], stream: TextIO | None = None) -> None:
    from speccli.ui.consoles import PipeAwareConsole
    from rich.table import Table

    table = Table(title="specgen models", title_justify="left")
    for column in (
        "alias",
        "family",
        "params",
        "resolves to",
        "available",
        "size",
        "weights bf16 / 8-bit / 4-bit",
        "published heads",
    ):
        table.add_column(column, no_wrap=column != "resolves to")
    for item in listings:
        default = {DEFAULT_TARGET: " (default target)", DEFAULT_DRAFT: " (default draft)"}.get(item.alias, "")
        weights = " / ".join(format_size(item.weights[f]) for f in ("bf16", "8bit", "4bit")) if item.weights else "-"
        layouts = sorted({head.layout for head in heads_for(item.alias)}, key=HEAD_LAYOUTS.index)
        table.add_row(
            item.alias + default,
            item.family,
            item.params,
            item.resolves_to,
            item.availability,
            format_size(item.size_bytes),
            weights,
            ", ".join(layouts) or "-",
        )
    stream = stream or sys.stdout
    console = PipeAwareConsole(file=stream, width=None if stream.isatty() else 200)
    console.print(table)
    console.print(FOOTER)


def print_heads_json(listings, stream: TextIO | None = None) -> None:
    print(json.dumps([asdict(item) for item in listings], ensure_ascii=False, indent=2), file=stream or sys.stdout)


def print_heads_table(listings, stream: TextIO | None = None) -> None:
    from speccli.ui.consoles import PipeAwareConsole
    from rich.table import Table
    from rich.text import Text

    stream = stream or sys.stdout
    console = PipeAwareConsole(file=stream, width=None if stream.isatty() else 200)
    if not listings:
        console.print("no heads trained yet: specgen train medusa|eagle --target MODEL")
        return
    table = Table(title="specgen heads", title_justify="left")
    for column in ("kind", "target", "size", "tokens", "vocab", "held-out top-1", "trained", "file"):
        table.add_column(column, no_wrap=column != "file")
    for item in listings:
        accuracy = ", ".join(f"{100 * a:.1f}%" for a in item.accuracy) or "-"
        cells = (
            item.kind,
            item.target,
            format_size(item.size_bytes),
            str(item.tokens or "-"),
            str(item.vocab or "-"),
            accuracy,
            item.trained or "-",
            item.path,
        )
        # Targets and paths are the user's: "[...]" in them is text, not Rich markup.
        table.add_row(*(Text(cell) for cell in cells))
    console.print(table)


def print_converted_json(entries: list[ConvertedEntry], stream: TextIO | None = None) -> None:
    print(json.dumps([entry.as_dict() for entry in entries], indent=2), file=stream or sys.stdout)


def print_converted_table(entries: list[ConvertedEntry], folder: Path, stream: TextIO | None = None) -> None:
    from speccli.ui.consoles import PipeAwareConsole
    from rich.table import Table

    stream = stream or sys.stdout
    console = PipeAwareConsole(file=stream, width=None if stream.isatty() else 200)
    if not entries:
        console.print(f"No converted weights kept in {folder}: a GGUF's first load through transformers keeps them.")
        return
    total = sum(entry.size_bytes for entry in entries)
    table = Table(title=f"converted weights in {folder} ({format_size(total)})", title_justify="left")
    for column in ("source", "dtype", "size", "converted"):
        table.add_column(column, no_wrap=True)
    for entry in entries:
        table.add_row(entry.source, entry.dtype, format_size(entry.size_bytes), entry.created)
    console.print(table)
    console.print("Remove them with `specgen models --remove-converted NAME` (or `all`); `--no-cache` skips them.")


def print_drafts_json(options: list[DraftOption], stream: TextIO | None = None) -> None:
    print(json.dumps([asdict(o) for o in options], ensure_ascii=False, indent=2), file=stream or sys.stdout)


def print_drafts_table(
    target: str, options: list[DraftOption], reason: str, reason_cuda: str, stream: TextIO | None = None
) -> None:
    from rich.table import Table

    from speccli.ui.consoles import PipeAwareConsole

    table = Table(title=f"drafts for {target}", title_justify="left")
    for column in ("--draft", "kind", "what", "auto"):
        table.add_column(column, no_wrap=column != "what")
    for option in options:
        auto = " / ".join(where for where, chosen in (("CPU", option.auto), ("CUDA", option.auto_cuda)) if chosen)
        table.add_row(option.name, option.kind, option.about, f"<- auto ({auto})" if auto else "")
    stream = stream or sys.stdout
    console = PipeAwareConsole(file=stream, width=None if stream.isatty() else 200)
    console.print(table)
    if reason == reason_cuda:
        console.print(f"--draft auto: {reason}.", highlight=False)
    else:
        console.print(f"--draft auto on the CPU: {reason}.\n--draft auto on CUDA: {reason_cuda}.", highlight=False)
