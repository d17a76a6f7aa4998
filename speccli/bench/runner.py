"""Prompt sets through plain target decoding and speculative decoding, side by side.

Nothing here prints: progress goes to a callback, results come back as typed dataclasses
with `as_dict()` for JSON; speccli.ui.bench_report renders them.

How a measurement is made fair:

- Each row is one (prompt, k, repeat) and holds its own plain run and speculative run,
  made one right after the other with the same prompt ids, SamplingConfig (the same seed)
  and SpecConfig (k, max_new_tokens, stop strings). The speed-up of a row is the ratio of
  the two tokens/s figures measured side by side.
- Both runs start cold: the target's cache and the drafter's state are emptied first, so
  neither run reuses the other's prefill. What `k auto` learned (acceptance, costs) is kept
  from one run to the next, as in a chat session: the figures are what a user gets after
  the first prompt. A draft model's own prefill of the prompt is
  part of the speculative run's prefill time (tokens/s leaves prefill out for both).
- Which of the two runs goes first alternates from row to row, so drift (clock boost,
  thermal throttling, other load) does not favour one method.
- Short unrecorded warm-up runs come first (lazy initialisation, allocator growth, and
  each k's verification shape): one plain, one speculative per k, on the first prompt.
- tokens/s is generated tokens over decode time (draft + verify, prefill excluded), as in
  GenerationStats. End-to-end figures (prefill included) are kept beside it.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from speccli.api import Speculator
from speccli.backends.base import CausalLM
from speccli.bench.divergence import Divergence, classify, first_difference
from speccli.bench.prompts import BenchInputError, BenchPrompt, encode_bench_prompt
from speccli.bench.results import BenchResults, BenchRow, BenchSettings, RunResult
from speccli.config import SamplingConfig, SpecConfig
from speccli.context import ContextOverflowError
from speccli.drafters.base import Drafter, LearnsText
from speccli.models.kernels.cpu import cpu_name

WARMUP_TOKENS = 8


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


class BenchRunner:
    """Runs prompts through plain and speculative decoding and keeps the rows.

    Both go through `generator`: plain runs as its plain baseline, speculative runs with
    the drafter `make_drafter` returns, called before each speculative run (None: the
    generator's own drafter). Returning the same drafter every time keeps what `k auto`
    learned across runs; the runner empties the drafter's state and the target's cache
    before every run. Rows accumulate in `self.rows`, so after an interruption
    `results(complete=False)` still reports what was measured.

    `dtype` is the target's compute dtype: in greedy mode a divergence within its rounding
    is a near-tie, not an error (speccli.bench.divergence).
    """

    def __init__(
        self,
        generator: Speculator,
        make_drafter: Callable[[], Drafter] | None,
        settings: BenchSettings,
        progress: Callable[[BenchProgress], None] | None = None,
        metadata: dict[str, Any] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.generator = generator
        self.dtype = dtype
        self.make_drafter: Callable[[], Drafter | None] = make_drafter or (lambda: generator.drafter)
        self.settings = settings
        self.progress = progress or (lambda _: None)
        self.metadata = {**environment(generator.target), **(metadata or {})}
        self.rows: list[BenchRow] = []

    def results(self, complete: bool = True) -> BenchResults:
        return BenchResults(self.settings, list(self.rows), dict(self.metadata), complete)

    def encode(self, prompt: BenchPrompt) -> list[int]:
        ids = encode_bench_prompt(self.generator.tokenizer, prompt, self.settings.chat, self.settings.system)
        if not ids:
            raise BenchInputError(f"prompt {prompt.name!r} encodes to no tokens", "give it some text")
        try:
            return self.generator.encode(ids)
        except ContextOverflowError as error:
            raise BenchInputError(
                f"prompt {prompt.name!r} is {error.prompt_tokens} tokens long and the model's context holds"
                f" {error.context}",
                "shorten it or leave it out",
            ) from None

    def run(self, prompts: Sequence[BenchPrompt]) -> BenchResults:
        if not prompts:
            raise BenchInputError("no prompts to run", "give a prompt file with at least one prompt")
        s = self.settings
        encoded = [self.encode(prompt) for prompt in prompts]

        if s.warmup:
            self.progress(BenchProgress("warmup", 0, 0, prompts[0].name, s.ks[0], 0))
            self._warm_up(encoded[0])

        plan = [(prompt, ids, k, r) for prompt, ids in zip(prompts, encoded) for r in range(s.repeat) for k in s.ks]
        self.rows = []
        for index, (prompt, ids, k, repeat) in enumerate(plan):
            self.progress(BenchProgress("start", index, len(plan), prompt.name, k, repeat))
            row = self.run_row(prompt, ids, k, repeat, plain_first=index % 2 == 0)
            self.rows.append(row)
            self.progress(BenchProgress("done", index, len(plan), prompt.name, k, repeat, row))
            if index + 1 == len(plan) or plan[index + 1][0] is not prompt:
                self._learn(ids, row)
        return self.results()

    def _learn(self, prompt_ids: Sequence[int], row: BenchRow) -> None:
        """A prompt's runs are over: a drafter that learns from texts (suffix drafting) is
        handed it with the plain answer once, so that no run of it drafted from another's."""
        drafter = self.generator.drafter  # the one its speculative runs drafted with
        if isinstance(drafter, LearnsText) and row.plain is not None:
            drafter.learn_text([*prompt_ids, *row.plain.token_ids])

    def run_row(
        self, prompt: BenchPrompt, prompt_ids: Sequence[int], k: int | str, repeat: int, plain_first: bool = True
    ) -> BenchRow:
        """One side-by-side pair."""
        s = self.settings
        sampling = s.sampling_for(repeat)
        spec_config = s.spec_config(k)
        row = BenchRow(prompt.name, prompt.category, k, repeat, len(prompt_ids), plain_first)
        order = ("plain", "spec") if plain_first else ("spec", "plain")
        for method in order:
            try:
                result = self._run_one(method == "plain", prompt_ids, sampling, spec_config)
            except Exception as error:  # noqa: BLE001 - one failed prompt must not end the bench
                kind = "plain" if method == "plain" else "speculative"
                row.error = f"{kind} decoding failed: {type(error).__name__}: {error}"
                return row
            setattr(row, method, result)
        plain, spec = row.plain, row.spec
        assert plain is not None and spec is not None  # both ran: a failure returned above
        if sampling.greedy:
            position = first_difference(plain.token_ids, spec.token_ids)
            row.identical = position is None
            if position is not None:
                divergence = self.divergence(prompt_ids, plain, spec, position)
                row.divergence = divergence
                row.mismatch_position = position
                if not divergence.near_tie:
                    row.error = divergence.describe()
        return row

    def divergence(self, prompt_ids: Sequence[int], plain: RunResult, spec: RunResult, position: int) -> Divergence:
        """Classify where two greedy runs part: the target scores the prompt and their common
        prefix once more, and the gap between its logits for the two choices is compared with
        the rounding of its dtype. A run that ended there stands for its end-of-sequence id."""
        prefix = plain.token_ids[:position]
        target = self.generator.target
        logits = None
        try:
            target.rollback(0)
            logits = target.forward([*prompt_ids, *prefix], all_logits=False)[-1]
        except Exception:  # noqa: BLE001 - a failed re-score leaves the divergence unexplained (a mismatch)
            pass
        finally:
            target.rollback(0)
        eos = sorted(self.generator.decoder.eos_token_ids)

        def ended_by(run: RunResult) -> list[int]:
            return eos if len(run.token_ids) == position and run.stats.finish_reason == "eos" else []

        return classify(position, plain.token_ids, spec.token_ids, logits, self.dtype, ended_by(plain), ended_by(spec))

    def _run_one(self, plain: bool, prompt_ids: Sequence[int], sampling: SamplingConfig, spec: SpecConfig) -> RunResult:
        if not plain:
            self.generator.use_drafter(self.make_drafter())
        generation = self.generator.stream(prompt_ids, sampling, spec, plain=plain, cold=True, learn=False).run()
        return RunResult(generation.stats, generation.token_ids)

    def _warm_up(self, prompt_ids: Sequence[int]) -> None:
        s = self.settings
        spec = SpecConfig(k=0, max_new_tokens=min(WARMUP_TOKENS, s.max_new_tokens))
        self._run_one(True, prompt_ids, s.sampling, spec)
        for k in s.ks:  # each k verifies k + 1 tokens at once: a new shape for the backend
            spec = SpecConfig(k=k, max_new_tokens=min(WARMUP_TOKENS, s.max_new_tokens))
            self._run_one(False, prompt_ids, s.sampling, spec)
        self.generator.target.rollback(0)


def run_bench(
    prompts: Sequence[BenchPrompt],
    target: CausalLM,
    tokenizer,
    eos_token_ids: Sequence[int],
    make_drafter: Callable[[], Drafter],
    settings: BenchSettings,
    progress: Callable[[BenchProgress], None] | None = None,
    metadata: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
) -> BenchResults:
    """Build a BenchRunner over a Speculator of these parts and run it."""
    generator = Speculator.over(target, tokenizer, eos_token_ids)
    runner = BenchRunner(generator, make_drafter, settings, progress, metadata, dtype)
    return runner.run(prompts)


def environment(target: CausalLM | None = None) -> dict[str, Any]:
    """Versions and threads, recorded with results so they can be compared later."""
    import torch

    info: dict[str, Any] = {
        "cpu": cpu_name(),
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
