"""What a benchmark measured: rows of side-by-side runs, and summaries over them, as typed
dataclasses with `as_dict()` for JSON. speccli.ui.bench_report renders them."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Sequence

from speccli.bench.divergence import Divergence
from speccli.config import AUTO_K, SamplingConfig, SpecConfig
from speccli.stats import GenerationStats, speedup


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
    tree: bool | None = None

    def __post_init__(self) -> None:
        if not self.ks:
            raise ValueError("give at least one draft length k")
        if any(k != AUTO_K and (not isinstance(k, int) or k < 1) for k in self.ks):
            raise ValueError(f"draft lengths must be >= 1 or {AUTO_K!r}, got {list(self.ks)}")
        if self.repeat < 1:
            raise ValueError(f"repeat must be >= 1, got {self.repeat}")
        SpecConfig(k=1, max_new_tokens=self.max_new_tokens, stop_strings=self.stop_strings)

    def spec_config(self, k: int | str) -> SpecConfig:
        return SpecConfig(k=k, max_new_tokens=self.max_new_tokens, stop_strings=self.stop_strings, tree=self.tree)

    def sampling_for(self, repeat: int) -> SamplingConfig:
        return self.sampling.nth(repeat)

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
            "tree": self.tree,
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

    In greedy mode, where the two outputs differ, `divergence` says where and whether the
    target's rounding explains it (a near-tie) or not (a mismatch); `mismatch_position` is
    the index of the first differing new token either way. `error` is set when a run failed
    (its result is then None) or at a mismatch; a near-tie is not an error.
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
    divergence: Divergence | None = None

    @property
    def check(self) -> str | None:
        """Greedy rows: "identical", "near-tie" or "mismatch"; None when not checked."""
        if self.identical:
            return "identical"
        return None if self.divergence is None else self.divergence.kind

    @property
    def near_tie(self) -> bool:
        return self.divergence is not None and self.divergence.near_tie

    @property
    def completed(self) -> bool:
        """Both runs finished (whether or not their outputs agree)."""
        return self.plain is not None and self.spec is not None

    @property
    def speedup(self) -> float | None:
        """Speculative tokens/s over plain tokens/s."""
        plain, spec = self.plain, self.spec
        if plain is None or spec is None:  # not completed
            return None
        return speedup(spec.tokens_per_second, plain.tokens_per_second)

    @property
    def end_to_end_speedup(self) -> float | None:
        plain, spec = self.plain, self.spec
        if plain is None or spec is None:  # not completed
            return None
        return speedup(spec.end_to_end_tokens_per_second, plain.end_to_end_tokens_per_second)

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
            "check": self.check,
            "mismatch_position": self.mismatch_position,
            "divergence": None if self.divergence is None else self.divergence.as_dict(),
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
    identical: int  # greedy rows whose outputs are the same
    near_ties: int  # greedy rows whose outputs part where rounding explains it
    mismatches: int  # greedy rows whose outputs part where rounding does not
    speedup: Spread | None
    plain: GenerationStats
    spec: GenerationStats

    @classmethod
    def of(
        cls, rows: Sequence[BenchRow], prompt: str | None, category: str | None, k: int | str | None
    ) -> BenchSummary:
        done = [r for r in rows if r.completed]
        runs = [(r.plain, r.spec) for r in done if r.plain is not None and r.spec is not None]  # all of done
        speedups = [r.speedup for r in done if r.speedup is not None]
        return cls(
            prompt=prompt,
            category=category,
            k=k,
            rows=len(rows),
            completed=len(done),
            failures=sum(not r.completed for r in rows),
            identical=sum(r.check == "identical" for r in rows),
            near_ties=sum(r.near_tie for r in rows),
            mismatches=sum(r.identical is False and not r.near_tie for r in rows),
            speedup=Spread.of(speedups),
            plain=GenerationStats.pooled(plain.stats for plain, _ in runs),
            spec=GenerationStats.pooled(spec.stats for _, spec in runs),
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
        return speedup(self.spec_tokens_per_second, self.plain_tokens_per_second)

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
    def mean_pass_size(self) -> float | None:
        """Tokens fed to the target per verification pass: drafted + 1 for chains, nodes + 1 for trees."""
        return self.spec.mean_pass_size

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
            "identical": self.identical,
            "near_ties": self.near_ties,
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
            "mean_pass_size": _round(self.mean_pass_size),
            "tree_steps": self.spec.tree_steps,
            "acceptance_by_position": [round(x, 4) for x in self.acceptance_by_position],
        }


UNCATEGORISED = "uncategorised"


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
        groups: dict[tuple[str, int | str], list[BenchRow]] = {}
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
    def by_category(self) -> list[BenchSummary]:
        """One summary per (category, k) over that category's prompts, when the prompts
        come in more than one category (a prompt without one counts as its own group)."""
        categories = list(dict.fromkeys(r.category for r in self.rows))
        if len(categories) < 2:
            return []
        return [
            BenchSummary.of(rows, None, category or UNCATEGORISED, k)
            for category in categories
            for k in self.settings.ks
            if (rows := [r for r in self.rows if r.category == category and r.k == k])
        ]

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
            "by_category": [s.as_dict() for s in self.by_category],
            "by_prompt": [s.as_dict() for s in self.by_prompt],
            "rows": [r.as_dict(tokens) for r in self.rows],
        }
