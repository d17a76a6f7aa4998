"""Benchmark prompt files (.txt, one prompt per line; .jsonl, one JSON object per line)
and the --k list: read, checked, and refused with one line and a hint."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speccli.config import parse_draft_length
from speccli.errors import UsageError
from speccli.prompts import NoChatTemplateError, Prompt, encode_prompt

PROMPT_SUFFIXES = (".txt", ".jsonl")
JSONL_EXAMPLE = '{"prompt": "def fib(n):"} or {"messages": [{"role": "user", "content": "Hi"}]}'
JSONL_HINT = f"each line of a .jsonl prompt file is one JSON object, e.g. {JSONL_EXAMPLE}"


class BenchInputError(UsageError):
    """A prompt file or bench option a user got wrong: a message and a hint."""


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark prompt: raw text, or chat messages sent through the chat template."""

    name: str
    text: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    category: str | None = None

    def __post_init__(self) -> None:
        if (self.text is None) == (self.messages is None):
            raise ValueError("a BenchPrompt needs exactly one of text and messages")

    @property
    def is_chat(self) -> bool:
        return self.messages is not None

    def request(self, chat: bool = False, system: str | None = None) -> Prompt:
        """What the generation layer encodes: the messages, or the text (as one user turn
        when `chat`), with `system` first when the messages hold no system message."""
        if self.messages is not None:
            return Prompt.conversation(self.messages, system)
        assert self.text is not None  # __post_init__: exactly one of text and messages
        return Prompt.of(self.text, chat, system)

    def as_dict(self) -> dict:
        out: dict[str, Any] = {"name": self.name, "category": self.category}
        if self.messages is not None:
            out["messages"] = [dict(m) for m in self.messages]
        else:
            out["prompt"] = self.text
        return out


def load_prompts(path: Path) -> list[BenchPrompt]:
    """Read a prompt set.

    .txt: one prompt per non-empty line (lines of only whitespace are skipped; the line
    is kept as written, without its line break).
    .jsonl: one JSON object per non-empty line, {"prompt": "..."} or {"messages": [...]},
    with optional "name" and "category" strings; other keys are ignored.
    A prompt without a name is called `<file stem>:<line number>`. Raises BenchInputError.
    """
    path = Path(path)
    if not path.exists():
        raise BenchInputError(
            f"prompt file not found: {path}",
            "give a .txt file (one prompt per line) or a .jsonl file (one JSON object per line)",
        )
    if path.is_dir():
        raise BenchInputError(f"prompt file is a directory: {path}", "give a .txt or .jsonl file")
    suffix = path.suffix.lower()
    if suffix not in PROMPT_SUFFIXES:
        raise BenchInputError(
            f"unsupported prompt file type {path.suffix or '(none)'!r}: {path}",
            "use .txt (one prompt per line) or .jsonl (one JSON object per line)",
        )
    try:
        data = path.read_bytes()
    except OSError as error:
        raise BenchInputError(
            f"cannot read prompt file {path}: {error.strerror or error}", "check the file's permissions"
        ) from None
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    lines: list[tuple[int, str]] = []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise BenchInputError(
                f"{path}: line {number} is not valid UTF-8 (byte {error.start + 1} of the line)",
                "save the prompt file as UTF-8",
            ) from None
        line = line.removesuffix("\r")
        if line.strip():
            lines.append((number, line))
    if not lines:
        raise BenchInputError(f"no prompts in {path}", "the file is empty or holds only blank lines")

    prompts: list[BenchPrompt] = []
    if suffix == ".txt":
        prompts = [BenchPrompt(name=f"{path.stem}:{n}", text=line) for n, line in lines]
    else:
        prompts = [_parse_jsonl_line(path, n, line) for n, line in lines]

    first_line: dict[str, int] = {}
    for (number, _), prompt in zip(lines, prompts):
        if prompt.name in first_line:
            raise BenchInputError(
                f"{path}: line {number}: duplicate prompt name {prompt.name!r}"
                f" (first on line {first_line[prompt.name]})",
                'give each prompt its own "name"',
            )
        first_line[prompt.name] = number
    return prompts


def _parse_jsonl_line(path: Path, number: int, line: str) -> BenchPrompt:
    where = f"{path}: line {number}"
    try:
        item = json.loads(line)
    except json.JSONDecodeError as error:
        raise BenchInputError(f"{where} is not valid JSON: {error.msg} (column {error.colno})", JSONL_HINT) from None
    if not isinstance(item, dict):
        raise BenchInputError(f"{where} must be a JSON object, not {_json_type(item)}", JSONL_HINT)
    has_prompt, has_messages = "prompt" in item, "messages" in item
    if not has_prompt and not has_messages:
        raise BenchInputError(f'{where} has neither "prompt" nor "messages"', JSONL_HINT)
    if has_prompt and has_messages:
        raise BenchInputError(f'{where} has both "prompt" and "messages"; give one', JSONL_HINT)
    for key in ("name", "category"):
        if key in item and not (isinstance(item[key], str) and item[key].strip()):
            raise BenchInputError(f'{where}: "{key}" must be a non-empty string', JSONL_HINT)
    name = item.get("name", f"{path.stem}:{number}")
    category = item.get("category")
    if has_prompt:
        text = item["prompt"]
        if not isinstance(text, str) or not text:
            raise BenchInputError(f'{where}: "prompt" must be a non-empty string', JSONL_HINT)
        return BenchPrompt(name=name, text=text, category=category)
    messages = item["messages"]
    valid = (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    )
    if not valid:
        raise BenchInputError(
            f'{where}: "messages" must be a non-empty list of {{"role": "...", "content": "..."}} objects',
            JSONL_HINT,
        )
    return BenchPrompt(
        name=name,
        messages=tuple({"role": m["role"], "content": m["content"]} for m in messages),
        category=category,
    )


def _json_type(value: Any) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return "null"


def parse_k_list(value: str) -> list[int | str]:
    """'1,2,4,auto' -> [1, 2, 4, 'auto']: draft lengths >= 1 or auto, duplicates dropped,
    order kept."""
    ks: list[int | str] = []
    for part in value.split(","):
        part = part.strip()
        try:
            k = parse_draft_length(part)
        except ValueError:
            raise BenchInputError(
                f"bad draft length {part!r} in --k {value!r}",
                "give whole numbers >= 1 or auto separated by commas, e.g. --k 1,2,4,auto",
            ) from None
        if k not in ks:
            ks.append(k)
    return ks


def encode_bench_prompt(tokenizer, prompt: BenchPrompt, chat: bool = False, system: str | None = None) -> list[int]:
    """Token ids for a prompt. Messages always go through the chat template; text does
    when `chat` is set (as one user turn, after `system` if given)."""
    try:
        return encode_prompt(tokenizer, prompt.request(chat, system))
    except NoChatTemplateError:
        raise BenchInputError(
            f"prompt {prompt.name!r} needs a chat template and this model has none",
            'use a model with a chat template, or prompts given as plain "prompt" text',
        ) from None
