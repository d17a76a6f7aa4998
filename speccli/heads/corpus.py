"""Text to train heads on, as token segments of one length.

With no data named, a default corpus that needs no network: the Python standard library's
own sources, and chat turns made from them (a user asking for a documented stdlib function,
the assistant answering with its source, rendered with the target's chat template) so the
heads also see the chat format they draft in. Labels are the target's own predictions
(speccli.heads.features), so the text need not be what the target would say.

Named data: files or folders of text or code (read as text), and .jsonl files whose lines
hold "messages" (a chat), "prompt"/"response", "instruction"/"output" or "text".
"""

from __future__ import annotations

import ast
import hashlib
import itertools
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from speccli.errors import UsageError

SEGMENT_TOKENS = 256
HELD_OUT_EVERY = 20  # every 20th segment is held out for accuracy
TEXT_SUFFIXES = {
    ".py",
    ".txt",
    ".md",
    ".rst",
    ".c",
    ".h",
    ".cc",
    ".cpp",
    ".hpp",
    ".js",
    ".ts",
    ".go",
    ".rs",
    ".java",
    ".sh",
    ".toml",
    ".yaml",
    ".yml",
    ".html",
    ".css",
    ".json",
    ".sql",
    ".rb",
    ".kt",
    ".swift",
}
# One chat turn per this many source files in the default corpus.
FILES_PER_CHAT = 2


@dataclass(frozen=True)
class Corpus:
    """Segments of SEGMENT_TOKENS token ids, and where they came from."""

    segments: list[list[int]]
    description: str  # for the heads' metadata and the feature cache's key

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.segments)

    def split(self) -> tuple[list[int], list[int]]:
        """Indices of the training and held-out segments."""
        held = [i for i in range(len(self.segments)) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
        if not held and len(self.segments) > 1:
            held = [len(self.segments) - 1]  # a little text: still measure on one unseen segment
        held_set = set(held)
        return [i for i in range(len(self.segments)) if i not in held_set], held


def _stable_order(paths: Iterable[Path]) -> list[Path]:
    """The same shuffled order on every machine (by a hash of the relative name)."""
    return sorted(paths, key=lambda p: hashlib.sha256(p.as_posix().encode()).hexdigest())


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts]
    by_name = {p.relative_to(root): p for p in files}
    return [by_name[rel] for rel in _stable_order(by_name)]


def read_text_file(path: Path) -> str | None:
    """The file's text (UTF-8); None where it cannot be read as such."""
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def documented_functions(source: str, limit: int | None = None) -> list[tuple[str, str]]:
    """(request, answer) pairs from a module, the first `limit` of them (default: all): a
    function's signature and docstring as the request, its source as the answer."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    pairs = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc:
            continue
        code = ast.get_source_segment(source, node)  # splits the whole source again: only where needed
        if not code or len(code) > 3000:
            continue
        summary = doc.strip().split("\n\n")[0].replace("\n", " ")
        pairs.append((f"Write a Python function `{node.name}` that does this: {summary}", f"```python\n{code}\n```"))
        if limit is not None and len(pairs) >= limit:
            break
    return pairs


class Tokens:
    """A tokenizer's encoding for plain text and for chats."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.has_template = bool(getattr(tokenizer, "chat_template", None))

    def text(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        if not self.has_template:
            return self.text("\n\n".join(f"{m['role']}: {m['content']}" for m in messages))
        ids = self.tokenizer.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=False)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)


def _jsonl_items(path: Path, tokens: Tokens) -> Iterator[list[int]]:
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError:
            raise UsageError(
                f"{path}:{number} is not JSON", hint="each line of a .jsonl file holds one JSON object"
            ) from None
        if not isinstance(item, dict):
            continue
        if isinstance(item.get("messages"), list):
            yield tokens.chat(item["messages"])
        elif "prompt" in item and "response" in item:
            yield tokens.chat(
                [
                    {"role": "user", "content": str(item["prompt"])},
                    {"role": "assistant", "content": str(item["response"])},
                ]
            )
        elif "instruction" in item and "output" in item:
            yield tokens.chat(
                [
                    {"role": "user", "content": str(item["instruction"])},
                    {"role": "assistant", "content": str(item["output"])},
                ]
            )
        elif isinstance(item.get("text"), str):
            yield tokens.text(item["text"])


def data_files(paths: Sequence[Path]) -> list[Path]:
    """The files `--data` names (folders searched for text, code and .jsonl); a path that is
    not there is a UsageError (the train command asks before loading anything)."""
    files: list[Path] = []
    for path in paths:
        path = Path(path)
        if path.is_dir():
            found = [p for p in path.rglob("*") if p.is_file() and (p.suffix in TEXT_SUFFIXES or p.suffix == ".jsonl")]
            files.extend(sorted(found))
        elif path.is_file():
            files.append(path)
        else:
            raise UsageError(
                f"no such file or folder: {path}", hint="--data takes files or folders of text, code or .jsonl"
            )
    return files


def _documents(data: Sequence[Path], tokens: Tokens) -> Iterator[list[int]]:
    if data:
        for path in data_files(data):
            if path.suffix == ".jsonl":
                yield from _jsonl_items(path, tokens)
            else:
                text = read_text_file(path)
                if text and text.strip():
                    yield tokens.text(text)
        return
    for number, path in enumerate(stdlib_files()):
        text = read_text_file(path)
        if not text or not text.strip():
            continue
        yield tokens.text(text)
        if number % FILES_PER_CHAT == 0:
            for request, answer in documented_functions(text, limit=1):
                yield tokens.chat([{"role": "user", "content": request}, {"role": "assistant", "content": answer}])


def build_corpus(
    tokenizer: Any,
    max_tokens: int,
    data: Sequence[Path] = (),
    segment_tokens: int = SEGMENT_TOKENS,
    chats: Sequence[Sequence[dict[str, str]]] = (),
) -> Corpus:
    """`max_tokens` tokens (rounded up to whole segments) of `chats` (the target's own answers,
    speccli.heads.answers) and then the named data or the default corpus, as one stream cut
    into segments of `segment_tokens`; fewer when the text runs out (a shorter tail is dropped)."""
    if max_tokens < segment_tokens:
        raise UsageError(f"--tokens must be at least {segment_tokens}, got {max_tokens}")
    tokens = Tokens(tokenizer)
    stream: list[int] = []
    segments: list[list[int]] = []
    documents = itertools.chain((tokens.chat(chat) for chat in chats), _documents(data, tokens))
    for document in documents:
        stream.extend(document)
        while len(stream) >= segment_tokens and len(segments) * segment_tokens < max_tokens:
            segments.append(stream[:segment_tokens])
            del stream[:segment_tokens]
        if len(segments) * segment_tokens >= max_tokens:
            break
    if not segments:
        where = ", ".join(str(p) for p in data) if data else "the Python standard library"
        raise UsageError(f"no training text found in {where}", hint=f"give at least {segment_tokens} tokens of text")
    description = (
        "default: Python standard library sources and chats made from them"
        if not data
        else "files: " + ", ".join(str(p) for p in data)
    )
    if chats:
        description = f"{len(chats)} of the target's own answers, then {description.removeprefix('default: ')}"
    return Corpus(segments, description)
