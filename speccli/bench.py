"""Prompt sets through plain target decoding and speculative decoding, side by side.

Nothing here prints: progress goes to a callback, results come back as typed dataclasses
with `as_dict()` for JSON; speccli.ui.bench_report renders them.

How a measurement is made fair:

- Each row is one (prompt, k, repeat) and holds its own plain run and speculative run,
  made one right after the other with the same prompt ids, SamplingConfig (the same seed)
  and SpecConfig (k, max_new_tokens, stop strings). The speed-up of a row is the ratio of
  the two tokens/s figures measured side by side.
- Both runs start cold: the target's cache and the drafter's state are emptied first, so
  neither run reuses the other's prefill. A draft model's own prefill of the prompt is
  part of the speculative run's prefill time (tokens/s leaves prefill out for both).
- Which of the two runs goes first alternates from row to row, so drift (clock boost,
  thermal throttling, other load) does not favour one method.
- Short unrecorded warm-up runs come first (lazy initialisation, allocator growth, and
  each k's verification shape): one plain, one speculative per k, on the first prompt.
- tokens/s is generated tokens over decode time (draft + verify, prefill excluded), as in
  GenerationStats. End-to-end figures (prefill included) are kept beside it.
"""

from __future__ import annotations

import json
import platform
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from speccli.config import AUTO_K, SamplingConfig, SpecConfig, parse_draft_length
from speccli.engine.backends import CausalLM
from speccli.engine.calibration import CostProfile
from speccli.engine.decoder import SpeculativeDecoder
from speccli.engine.drafters import Drafter
from speccli.engine.events import TokenEvent
from speccli.errors import UsageError
from speccli.stats import GenerationStats

PROMPT_SUFFIXES = (".txt", ".jsonl")
WARMUP_TOKENS = 8
JSONL_EXAMPLE = '{"prompt": "def fib(n):"} or {"messages": [{"role": "user", "content": "Hi"}]}'
JSONL_HINT = f"each line of a .jsonl prompt file is one JSON object, e.g. {JSONL_EXAMPLE}"


class BenchInputError(UsageError):
    """A prompt file or bench option a user got wrong: a message and a hint."""


# --------------------------------------------------------------------------- prompts


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
                f"{path}: line {number}: duplicate prompt name {prompt.name!r} (first on line {first_line[prompt.name]})",
                "give each prompt its own \"name\"",
            )
        first_line[prompt.name] = number
    return prompts


def _parse_jsonl_line(path: Path, number: int, line: str) -> BenchPrompt:
    where = f"{path}: line {number}"
    try:
        item = json.loads(line)
    except json.JSONDecodeError as error:
        raise BenchInputError(
            f"{where} is not valid JSON: {error.msg} (column {error.colno})", JSONL_HINT
        ) from None
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


def encode_bench_prompt(
    tokenizer, prompt: BenchPrompt, chat: bool = False, system: str | None = None
) -> list[int]:
    """Token ids for a prompt. Messages always go through the chat template; text does
    when `chat` is set (as one user turn, after `system` if given)."""
    if prompt.messages is None and not chat:
        return list(tokenizer(prompt.text)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise BenchInputError(
            f"prompt {prompt.name!r} needs a chat template and this model has none",
            "use a model with a chat template, or prompts given as plain \"prompt\" text",
        )
    if prompt.messages is not None:
        messages = [dict(m) for m in prompt.messages]
    else:
        messages = [{"role": "user", "content": prompt.text}]
    if system and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system})
    from speccli.pipeline import chat_template_ids

    return chat_template_ids(tokenizer, messages)


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class BenchSettings:
    """What every run of a benchmark shares.

    With a sampling seed, repeat r of every row uses seed + r for both of its runs.
    """

    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    max_new_tokens: int = 128
    ks: tuple[int | str, ...] = (4,)
    repeat: int = 1
    warmup: bool = True
    chat: bool = False
    system: str | None = None
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.ks:
            raise ValueError("give at least one draft length k")
        if any(k != AUTO_K and (not isinstance(k, int) or k < 1) for k in self.ks):
            raise ValueError(f"draft lengths must be >= 1 or {AUTO_K!r}, got {list(self.ks)}")
        if self.repeat < 1:
            raise ValueError(f"repeat must be >= 1, got {self.repeat}")
        SpecConfig(k=1, max_new_tokens=self.max_new_tokens, stop_strings=self.stop_strings)

    def spec_config(self, k: int | str) -> SpecConfig:
        return SpecConfig(k=k, max_new_tokens=self.max_new_tokens, stop_strings=self.stop_strings)

    def sampling_for(self, repeat: int) -> SamplingConfig:
        seed = self.sampling.seed
        if seed is None:
            return self.sampling
        return SamplingConfig(self.sampling.temperature, self.sampling.top_k, self.sampling.top_p, seed + repeat)

    def as_dict(self) -> dict:
        s = self.sampling
        return {
            "greedy": s.greedy,
            "temperature": s.temperature,
            "top_k": s.top_k,
            "top_p": s.top_p,
            "seed": s.seed,
            "max_new_tokens": self.max_new_tokens,
            "ks": list(self.ks),
            "repeat": self.repeat,
            "warmup": self.warmup,
            "chat": self.chat,
            "system": self.system,
            "stop_strings": list(self.stop_strings),
        }


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


@dataclass
class RunResult:
    """One generation: its figures and the tokens it emitted."""

    stats: GenerationStats
    token_ids: list[int]

    @property
    def new_tokens(self) -> int:
        return self.stats.new_tokens

    @property
    def decode_seconds(self) -> float:
        return self.stats.decode_seconds

    @property
    def tokens_per_second(self) -> float | None:
        return self.stats.tokens_per_second

    @property
    def end_to_end_tokens_per_second(self) -> float | None:
        """Tokens over the whole request, prefill included."""
        seconds = self.stats.total_seconds
        return self.stats.new_tokens / seconds if seconds > 0 else None

    def as_dict(self, tokens: bool = False) -> dict:
        out = self.stats.as_dict()
        out["decode_seconds"] = _round(self.decode_seconds)
        out["end_to_end_tokens_per_second"] = _round(self.end_to_end_tokens_per_second, 3)
        if tokens:
            out["token_ids"] = list(self.token_ids)
        return out


@dataclass
class BenchRow:
    """One prompt at one k, one repeat: a plain run and a speculative run side by side.

    `error` is set when a run failed (its result is then None) or, in greedy mode, when
    the two outputs differ; `mismatch_position` is then the index of the first differing
    new token.
    """

    prompt: str
    category: str | None
    k: int | str
    repeat: int
    prompt_tokens: int
    plain_first: bool
    plain: RunResult | None = None
    spec: RunResult | None = None
    identical: bool | None = None  # None: not checked (sampling) or a run failed
    mismatch_position: int | None = None
    error: str | None = None

    @property
    def completed(self) -> bool:
        """Both runs finished (whether or not their outputs agree)."""
        return self.plain is not None and self.spec is not None

    @property
    def speedup(self) -> float | None:
        """Speculative tokens/s over plain tokens/s."""
        if not self.completed:
            return None
        plain, spec = self.plain.tokens_per_second, self.spec.tokens_per_second
        return spec / plain if plain and spec is not None else None

    @property
    def end_to_end_speedup(self) -> float | None:
        if not self.completed:
            return None
        plain, spec = self.plain.end_to_end_tokens_per_second, self.spec.end_to_end_tokens_per_second
        return spec / plain if plain and spec is not None else None

    def as_dict(self, tokens: bool = False) -> dict:
        return {
            "prompt": self.prompt,
            "category": self.category,
            "k": self.k,
            "repeat": self.repeat,
            "prompt_tokens": self.prompt_tokens,
            "plain_first": self.plain_first,
            "speedup": _round(self.speedup),
            "end_to_end_speedup": _round(self.end_to_end_speedup),
            "identical": self.identical,
            "mismatch_position": self.mismatch_position,
            "error": self.error,
            "plain": None if self.plain is None else self.plain.as_dict(tokens),
            "speculative": None if self.spec is None else self.spec.as_dict(tokens),
        }


@dataclass(frozen=True)
class Spread:
    """Summary of a list of figures (speed-ups over repeats, or over rows)."""

    n: int
    median: float
    mean: float
    min: float
    max: float
    stdev: float | None  # sample standard deviation; None for a single value

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread | None:
        if not values:
            return None
        return cls(
            n=len(values),
            median=statistics.median(values),
            mean=statistics.fmean(values),
            min=min(values),
            max=max(values),
            stdev=statistics.stdev(values) if len(values) > 1 else None,
        )

    def as_dict(self) -> dict:
        return {
            "n": self.n,
            "median": _round(self.median),
            "mean": _round(self.mean),
            "min": _round(self.min),
            "max": _round(self.max),
            "stdev": _round(self.stdev),
        }


@dataclass(frozen=True)
class BenchSummary:
    """Figures over a group of rows: one prompt at one k, every prompt at one k, or all.

    The speed-up spread is over the group's completed rows (one value per side-by-side
    pair). Pooled figures are totals: tokens/s = total tokens / total decode seconds,
    acceptance = accepted / drafted over every step, and so on; `pooled_speedup` is the
    ratio of the two pooled tokens/s.
    """

    prompt: str | None
    category: str | None
    k: int | str | None
    rows: int
    completed: int
    failures: int  # rows where a run raised
    mismatches: int  # greedy rows whose outputs differ
    speedup: Spread | None
    plain: GenerationStats
    spec: GenerationStats

    @classmethod
    def of(cls, rows: Sequence[BenchRow], prompt: str | None, category: str | None, k: int | str | None) -> BenchSummary:
        done = [r for r in rows if r.completed]
        speedups = [r.speedup for r in done if r.speedup is not None]
        return cls(
            prompt=prompt,
            category=category,
            k=k,
            rows=len(rows),
            completed=len(done),
            failures=sum(not r.completed for r in rows),
            mismatches=sum(r.identical is False for r in rows),
            speedup=Spread.of(speedups),
            plain=GenerationStats.pooled(r.plain.stats for r in done),
            spec=GenerationStats.pooled(r.spec.stats for r in done),
        )

    @property
    def errors(self) -> int:
        return self.failures + self.mismatches

    @property
    def plain_tokens_per_second(self) -> float | None:
        return self.plain.tokens_per_second

    @property
    def spec_tokens_per_second(self) -> float | None:
        return self.spec.tokens_per_second

    @property
    def pooled_speedup(self) -> float | None:
        plain, spec = self.plain_tokens_per_second, self.spec_tokens_per_second
        return spec / plain if plain and spec is not None else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.spec.acceptance_rate

    @property
    def tokens_per_step(self) -> float | None:
        return self.spec.tokens_per_step

    @property
    def predicted_tokens_per_step(self) -> float | None:
        return self.spec.predicted_tokens_per_step

    @property
    def acceptance_by_position(self) -> list[float]:
        return self.spec.acceptance_by_position

    def as_dict(self) -> dict:
        return {
            "prompt": self.prompt,
            "category": self.category,
            "k": self.k,
            "rows": self.rows,
            "completed": self.completed,
            "failures": self.failures,
            "mismatches": self.mismatches,
            "speedup": None if self.speedup is None else self.speedup.as_dict(),
            "pooled_speedup": _round(self.pooled_speedup),
            "plain_tokens": self.plain.new_tokens,
            "plain_decode_seconds": _round(self.plain.decode_seconds),
            "plain_tokens_per_second": _round(self.plain_tokens_per_second, 3),
            "spec_tokens": self.spec.new_tokens,
            "spec_decode_seconds": _round(self.spec.decode_seconds),
            "spec_tokens_per_second": _round(self.spec_tokens_per_second, 3),
            "acceptance_rate": _round(self.acceptance_rate),
            "tokens_per_step": _round(self.tokens_per_step),
            "predicted_tokens_per_step": _round(self.predicted_tokens_per_step),
            "acceptance_by_position": [round(x, 4) for x in self.acceptance_by_position],
        }


@dataclass
class BenchResults:
    """Every row of a benchmark, and summaries over them.

    `complete` is False when the run was interrupted and these are the rows so far.
    """

    settings: BenchSettings
    rows: list[BenchRow]
    metadata: dict[str, Any] = field(default_factory=dict)
    complete: bool = True

    @property
    def by_prompt(self) -> list[BenchSummary]:
        """One summary per (prompt, k), in the order the rows ran."""
        groups: dict[tuple[str, int], list[BenchRow]] = {}
        for row in self.rows:
            groups.setdefault((row.prompt, row.k), []).append(row)
        return [BenchSummary.of(rows, p, rows[0].category, k) for (p, k), rows in groups.items()]

    @property
    def by_k(self) -> list[BenchSummary]:
        """One summary per k over every prompt, in the order of settings.ks."""
        out = []
        for k in self.settings.ks:
            rows = [r for r in self.rows if r.k == k]
            if rows:
                out.append(BenchSummary.of(rows, None, None, k))
        return out

    @property
    def overall(self) -> BenchSummary:
        return BenchSummary.of(self.rows, None, None, None)

    @property
    def prompts(self) -> list[str]:
        return list(dict.fromkeys(r.prompt for r in self.rows))

    @property
    def errors(self) -> list[BenchRow]:
        return [r for r in self.rows if r.error is not None]

    def as_dict(self, tokens: bool = False) -> dict:
        return {
            "complete": self.complete,
            "settings": self.settings.as_dict(),
            "metadata": dict(self.metadata),
            "overall": self.overall.as_dict(),
            "by_k": [s.as_dict() for s in self.by_k],
            "by_prompt": [s.as_dict() for s in self.by_prompt],
            "rows": [r.as_dict(tokens) for r in self.rows],
        }


# --------------------------------------------------------------------------- running


@dataclass(frozen=True)
class BenchProgress:
    """Sent to the progress callback.

    phase "warmup": the unrecorded warm-up is about to run (row_index 0);
    "start": row `row_index` (0-based) of `total` is about to run;
    "done": it finished, `row` holds it (completed = row_index + 1 rows are done).
    """

    phase: str
    row_index: int
    total: int
    prompt: str
    k: int | str
    repeat: int
    row: BenchRow | None = None

    @property
    def completed(self) -> int:
        return self.row_index + (self.phase == "done")

    def describe(self) -> str:
        if self.phase == "warmup":
            return f"warming up on {self.prompt!r}"
        where = f"[{self.completed}/{self.total}] {self.prompt} k={self.k} repeat {self.repeat + 1}"
        if self.phase == "start":
            return where
        row = self.row
        if row is not None and row.error:
            return f"{where}: {row.error}"
        speedup = None if row is None else row.speedup
        return f"{where}: " + ("n/a" if speedup is None else f"{speedup:.2f}x")


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two token lists differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def mismatch_message(plain: Sequence[int], spec: Sequence[int], position: int) -> str:
    if position < len(plain) and position < len(spec):
        detail = f"plain token id {plain[position]}, speculative {spec[position]}"
    else:
        detail = f"plain emitted {len(plain)} tokens, speculative {len(spec)}"
    return f"greedy outputs differ at new token {position}: {detail}"


class BenchRunner:
    """Runs prompts through plain and speculative decoding and keeps the rows.

    `make_drafter` is called before each speculative run; it may build a new drafter or
    return the same one every time: the runner empties its state (`rollback(0)`) and the
    target's cache before every run. Rows accumulate in `self.rows`, so after an
    interruption `results(complete=False)` still reports what was measured.
    """

    def __init__(
        self,
        target: CausalLM,
        tokenizer,
        eos_token_ids: Sequence[int],
        make_drafter: Callable[[], Drafter],
        settings: BenchSettings,
        progress: Callable[[BenchProgress], None] | None = None,
        metadata: dict[str, Any] | None = None,
        costs: CostProfile | None = None,
    ) -> None:
        self.target = target
        self.costs = costs
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self.make_drafter = make_drafter
        self.settings = settings
        self.progress = progress or (lambda _: None)
        self.metadata = {**environment(target), **(metadata or {})}
        self.rows: list[BenchRow] = []

    def results(self, complete: bool = True) -> BenchResults:
        return BenchResults(self.settings, list(self.rows), dict(self.metadata), complete)

    def run(self, prompts: Sequence[BenchPrompt]) -> BenchResults:
        if not prompts:
            raise BenchInputError("no prompts to run", "give a prompt file with at least one prompt")
        s = self.settings
        encoded = []
        for prompt in prompts:
            ids = encode_bench_prompt(self.tokenizer, prompt, s.chat, s.system)
            if not ids:
                raise BenchInputError(f"prompt {prompt.name!r} encodes to no tokens", "give it some text")
            encoded.append(ids)

        if s.warmup:
            self.progress(BenchProgress("warmup", 0, 0, prompts[0].name, s.ks[0], 0))
            self._warm_up(encoded[0])

        plan = [
            (prompt, ids, k, r)
            for prompt, ids in zip(prompts, encoded)
            for r in range(s.repeat)
            for k in s.ks
        ]
        self.rows = []
        for index, (prompt, ids, k, repeat) in enumerate(plan):
            self.progress(BenchProgress("start", index, len(plan), prompt.name, k, repeat))
            row = self.run_row(prompt, ids, k, repeat, plain_first=index % 2 == 0)
            self.rows.append(row)
            self.progress(BenchProgress("done", index, len(plan), prompt.name, k, repeat, row))
        return self.results()

    def run_row(
        self, prompt: BenchPrompt, prompt_ids: Sequence[int], k: int, repeat: int, plain_first: bool = True
    ) -> BenchRow:
        """One side-by-side pair."""
        s = self.settings
        sampling = s.sampling_for(repeat)
        spec_config = s.spec_config(k)
        row = BenchRow(prompt.name, prompt.category, k, repeat, len(prompt_ids), plain_first)
        order = ("plain", "spec") if plain_first else ("spec", "plain")
        for method in order:
            try:
                drafter = None if method == "plain" else self.make_drafter()
                result = self._run_one(drafter, prompt_ids, sampling, spec_config)
            except Exception as error:  # noqa: BLE001 - one failed prompt must not end the bench
                row.error = f"{'plain' if method == 'plain' else 'speculative'} decoding failed: {type(error).__name__}: {error}"
                return row
            setattr(row, method, result)
        if sampling.greedy:
            position = first_difference(row.plain.token_ids, row.spec.token_ids)
            row.identical = position is None
            if position is not None:
                row.mismatch_position = position
                row.error = mismatch_message(row.plain.token_ids, row.spec.token_ids, position)
        return row

    def _run_one(
        self, drafter: Drafter | None, prompt_ids: Sequence[int], sampling: SamplingConfig, spec: SpecConfig
    ) -> RunResult:
        self.target.rollback(0)
        if drafter is not None:
            drafter.rollback(0)
        decoder = SpeculativeDecoder(self.target, self.tokenizer, self.eos_token_ids, drafter, self.costs)
        stats = GenerationStats()
        tokens: list[int] = []
        stats.start()
        for event in decoder.generate(prompt_ids, sampling, spec):
            stats.observe(event)
            if isinstance(event, TokenEvent):
                tokens.append(event.token_id)
        return RunResult(stats, tokens)

    def _warm_up(self, prompt_ids: Sequence[int]) -> None:
        s = self.settings
        spec = SpecConfig(k=0, max_new_tokens=min(WARMUP_TOKENS, s.max_new_tokens))
        self._run_one(None, prompt_ids, s.sampling, spec)
        for k in s.ks:  # each k verifies k + 1 tokens at once: a new shape for the backend
            spec = SpecConfig(k=k, max_new_tokens=min(WARMUP_TOKENS, s.max_new_tokens))
            self._run_one(self.make_drafter(), prompt_ids, s.sampling, spec)
        self.target.rollback(0)


def run_bench(
    prompts: Sequence[BenchPrompt],
    target: CausalLM,
    tokenizer,
    eos_token_ids: Sequence[int],
    make_drafter: Callable[[], Drafter],
    settings: BenchSettings,
    progress: Callable[[BenchProgress], None] | None = None,
    metadata: dict[str, Any] | None = None,
) -> BenchResults:
    """Build a BenchRunner and run it."""
    runner = BenchRunner(target, tokenizer, eos_token_ids, make_drafter, settings, progress, metadata)
    return runner.run(prompts)


def environment(target: CausalLM | None = None) -> dict[str, Any]:
    """Versions and threads, recorded with results so they can be compared later."""
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    if target is not None:
        try:
            info["device"] = str(target.device)
        except Exception:  # pragma: no cover - a fake backend may not say
            pass
    return info


__all__ = [
    "BenchInputError",
    "BenchPrompt",
    "BenchProgress",
    "BenchResults",
    "BenchRow",
    "BenchRunner",
    "BenchSettings",
    "BenchSummary",
    "RunResult",
    "Spread",
    "encode_bench_prompt",
    "environment",
    "first_difference",
    "load_prompts",
    "mismatch_message",
    "parse_k_list",
    "run_bench",
]
