"""The benchmark: prompt files, side-by-side runs on tiny models, summaries, and reports."""

from __future__ import annotations

import csv
import io
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from rich.console import Console

from conftest import char_tokenizer, wrap
from speccli.api import Speculator
from speccli.bench.prompts import BenchInputError, BenchPrompt, encode_bench_prompt, load_prompts, parse_k_list
from speccli.bench.results import BenchResults, BenchRow, BenchSettings, RunResult, Spread
from speccli.bench.runner import BenchProgress, BenchRunner, run_bench
from speccli.config import SamplingConfig
from speccli.drafters.model import ModelDrafter
from speccli.drafters.ngram import PromptLookupDrafter
from speccli.errors import UsageError
from speccli.events import StepEvent
from speccli.models.kernels.cpu import cpu_name
from speccli.stats import GenerationStats
from speccli.ui import bench_report
from speccli.ui.bench_report import CSV_COLUMNS, SUMMARY_COLUMNS, ReportError

EOS = 2
MAX_NEW = 16
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- load_prompts


def write(tmp_path: Path, name: str, content: str | bytes) -> Path:
    path = tmp_path / name
    if isinstance(content, str):
        content = content.encode("utf-8")
    path.write_bytes(content)
    return path


def error_of(path: Path) -> BenchInputError:
    with pytest.raises(BenchInputError) as info:
        load_prompts(path)
    assert isinstance(info.value, UsageError)  # the CLI reports it as one line + hint, exit 2
    assert info.value.hint
    return info.value


def test_txt_one_prompt_per_non_empty_line(tmp_path):
    path = write(tmp_path, "set.txt", "\ufeffdef fib(n):\n\n   \nhello world  \r\n# a comment is a prompt too\n")
    prompts = load_prompts(path)
    assert prompts == [
        BenchPrompt(name="set:1", text="def fib(n):"),
        BenchPrompt(name="set:4", text="hello world  "),
        BenchPrompt(name="set:5", text="# a comment is a prompt too"),
    ]
    assert not prompts[0].is_chat


def test_txt_suffix_is_case_insensitive_and_last_line_needs_no_newline(tmp_path):
    assert load_prompts(write(tmp_path, "A.TXT", "x\ny")) == [
        BenchPrompt(name="A:1", text="x"),
        BenchPrompt(name="A:2", text="y"),
    ]


def test_jsonl_prompts_messages_names_and_categories(tmp_path):
    lines = [
        json.dumps({"prompt": "def f(x):", "name": "f", "category": "code", "extra": 1}),
        "",
        json.dumps({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}),
        json.dumps({"prompt": "2 + 2 =", "category": "arithmetic"}),
    ]
    prompts = load_prompts(write(tmp_path, "p.jsonl", "\n".join(lines) + "\n"))
    assert prompts == [
        BenchPrompt(name="f", text="def f(x):", category="code"),
        BenchPrompt(
            name="p:3",
            messages=({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}),
        ),
        BenchPrompt(name="p:4", text="2 + 2 =", category="arithmetic"),
    ]
    assert prompts[1].is_chat
    assert prompts[1].as_dict() == {
        "name": "p:3",
        "category": None,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    }


def test_the_shipped_prompt_set_loads():
    path = Path(__file__).resolve().parents[1] / "scripts" / "prompts" / "default.jsonl"
    prompts = load_prompts(path)
    assert len(prompts) >= 12
    categories = {p.category for p in prompts}
    assert {"code-completion", "code-instruction", "chat", "arithmetic", "translation"} <= categories
    assert all(p.name and p.category for p in prompts)
    assert any(p.is_chat for p in prompts if p.category == "code-instruction")


def test_missing_file(tmp_path):
    path = tmp_path / "nope.jsonl"
    assert str(error_of(path)) == f"prompt file not found: {path}"


def test_directory(tmp_path):
    folder = tmp_path / "dir.txt"
    folder.mkdir()
    assert str(error_of(folder)) == f"prompt file is a directory: {folder}"


@pytest.mark.parametrize("name, shown", [("p.csv", "'.csv'"), ("prompts", "'(none)'")])
def test_unknown_extension(tmp_path, name, shown):
    path = write(tmp_path, name, "x\n")
    error = error_of(path)
    assert str(error) == f"unsupported prompt file type {shown}: {path}"
    assert ".jsonl" in error.hint


def test_unreadable_file(tmp_path, monkeypatch):
    path = write(tmp_path, "p.txt", "x\n")

    def denied(self):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_bytes", denied)
    assert str(error_of(path)) == f"cannot read prompt file {path}: Permission denied"


@pytest.mark.parametrize("name", ["p.txt", "p.jsonl"])
@pytest.mark.parametrize("content", ["", "\n\n  \n\t\n"])
def test_empty_file(tmp_path, name, content):
    path = write(tmp_path, name, content)
    assert str(error_of(path)) == f"no prompts in {path}"


@pytest.mark.parametrize("name", ["p.txt", "p.jsonl"])
def test_invalid_utf8_names_the_line(tmp_path, name):
    path = write(tmp_path, name, b'{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "caf\xe9"}\n')
    assert str(error_of(path)) == f"{path}: line 3 is not valid UTF-8 (byte 16 of the line)"


def test_invalid_json_line(tmp_path):
    path = write(tmp_path, "p.jsonl", '{"prompt": "a"}\n\n{"prompt": "a" "b"}\n')
    error = error_of(path)
    assert str(error) == f"{path}: line 3 is not valid JSON: Expecting ',' delimiter (column 16)"
    assert '{"prompt": "def fib(n):"}' in error.hint


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"text": "a"}', 'line 1 has neither "prompt" nor "messages"'),
        ('{"prompt": "a", "messages": []}', 'line 1 has both "prompt" and "messages"; give one'),
        ('["a"]', "line 1 must be a JSON object, not an array"),
        ('"a"', "line 1 must be a JSON object, not a string"),
        ('{"prompt": 3}', 'line 1: "prompt" must be a non-empty string'),
        ('{"prompt": ""}', 'line 1: "prompt" must be a non-empty string'),
        (
            '{"messages": []}',
            'line 1: "messages" must be a non-empty list of {"role": "...", "content": "..."} objects',
        ),
        (
            '{"messages": [{"role": "user"}]}',
            'line 1: "messages" must be a non-empty list of {"role": "...", "content": "..."} objects',
        ),
        (
            '{"messages": "hi"}',
            'line 1: "messages" must be a non-empty list of {"role": "...", "content": "..."} objects',
        ),
        ('{"prompt": "a", "name": 5}', 'line 1: "name" must be a non-empty string'),
        ('{"prompt": "a", "category": ""}', 'line 1: "category" must be a non-empty string'),
    ],
)
def test_bad_jsonl_lines(tmp_path, line, message):
    path = write(tmp_path, "p.jsonl", line + "\n")
    assert str(error_of(path)) == f"{path}: {message}"


def test_duplicate_names(tmp_path):
    path = write(tmp_path, "p.jsonl", '{"prompt": "a", "name": "x"}\n{"prompt": "b"}\n{"prompt": "c", "name": "x"}\n')
    assert str(error_of(path)) == f"{path}: line 3: duplicate prompt name 'x' (first on line 1)"


def test_parse_k_list():
    assert parse_k_list("1,2,4") == [1, 2, 4]
    assert parse_k_list(" 4, 2 ,4") == [4, 2]
    for bad, part in [("0", "'0'"), ("1,x", "'x'"), ("1,,2", "''"), ("-1", "'-1'")]:
        with pytest.raises(BenchInputError) as info:
            parse_k_list(bad)
        assert str(info.value) == f"bad draft length {part} in --k {bad!r}"


def test_settings_validate():
    with pytest.raises(ValueError):
        BenchSettings(ks=())
    with pytest.raises(ValueError):
        BenchSettings(ks=(0, 1))
    with pytest.raises(ValueError):
        BenchSettings(repeat=0)
    with pytest.raises(ValueError):
        BenchSettings(max_new_tokens=0)
    s = BenchSettings(sampling=SamplingConfig(temperature=0.7, seed=10))
    assert [s.sampling_for(r).seed for r in range(3)] == [10, 11, 12]
    assert s.sampling_for(2).temperature == 0.7
    assert BenchSettings().sampling_for(5).seed is None


# --------------------------------------------------------------------------- encoding


@pytest.fixture()
def chat_tokenizer():
    tok = char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


def test_encode_text_and_chat(chat_tokenizer):
    text = BenchPrompt("t", text="abc")
    assert encode_bench_prompt(chat_tokenizer, text) == chat_tokenizer("abc")["input_ids"]
    as_chat = encode_bench_prompt(chat_tokenizer, text, chat=True, system="sys")
    assert chat_tokenizer.decode(as_chat) == "system: sys\nuser: abc\nassistant:"
    msgs = BenchPrompt("m", messages=({"role": "user", "content": "hi"},))
    assert chat_tokenizer.decode(encode_bench_prompt(chat_tokenizer, msgs)) == "user: hi\nassistant:"


def test_chat_prompt_without_template_fails_before_any_run(tokenizer, pairs):
    calls = []
    runner = BenchRunner(
        Speculator.over(wrap(pairs[0].target), tokenizer, [EOS]),
        PromptLookupDrafter,
        BenchSettings(),
        progress=calls.append,
    )
    prompts = [BenchPrompt("ok", text="abc"), BenchPrompt("chatty", messages=({"role": "user", "content": "hi"},))]
    with pytest.raises(BenchInputError) as info:
        runner.run(prompts)
    assert str(info.value) == "prompt 'chatty' needs a chat template and this model has none"
    assert calls == [] and runner.rows == []


def test_prompt_without_tokens_is_refused(tokenizer, pairs):
    with pytest.raises(BenchInputError, match="prompt 'empty' encodes to no tokens"):
        run_bench(
            [BenchPrompt("empty", text="")],
            wrap(pairs[0].target),
            tokenizer,
            [EOS],
            PromptLookupDrafter,
            BenchSettings(),
        )


# --------------------------------------------------------------------------- runner on tiny models


def reference_greedy(model, prompt_ids: list[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_NEW, do_sample=False, num_beams=1)
    new = out[0, len(prompt_ids) :].tolist()
    return new[: new.index(EOS)] if EOS in new else new


PROMPTS = [BenchPrompt("fib", text="def fib(n):", category="code"), BenchPrompt("abc", text="abcabcabc")]


@pytest.fixture(scope="module")
def greedy_results(pairs, tokenizer):
    pair = pairs[0]
    made = []

    def make_drafter():
        # The same drafter every time: the runner must empty it before each run.
        if not made:
            made.append(ModelDrafter(wrap(pair.draft), len(tokenizer)))
        else:
            made.append(made[0])
        return made[-1]

    progress: list[BenchProgress] = []
    settings = BenchSettings(max_new_tokens=MAX_NEW, ks=(1, 3), repeat=2)
    results = run_bench(
        PROMPTS, wrap(pair.target), tokenizer, [EOS], make_drafter, settings, progress.append, {"target": "tiny"}
    )
    return results, made, progress


def test_greedy_rows_are_identical_and_complete(greedy_results, pairs, tokenizer):
    results, _, _ = greedy_results
    assert len(results.rows) == len(PROMPTS) * 2 * 2
    assert [(r.prompt, r.repeat, r.k) for r in results.rows] == [
        (p.name, rep, k) for p in PROMPTS for rep in range(2) for k in (1, 3)
    ]
    refs = {p.name: reference_greedy(pairs[0].target, tokenizer(p.text)["input_ids"]) for p in PROMPTS}
    for row in results.rows:
        assert row.error is None and row.identical is True and row.mismatch_position is None
        assert row.plain.token_ids == row.spec.token_ids == refs[row.prompt]
        assert row.prompt_tokens == len(tokenizer(dict((p.name, p.text) for p in PROMPTS)[row.prompt])["input_ids"])
        assert row.plain.stats.drafted == 0 and row.spec.stats.drafted > 0
        assert row.spec.stats.mean_draft_length <= row.k
    assert results.errors == [] and results.complete
    assert results.metadata["target"] == "tiny" and "torch" in results.metadata
    assert results.metadata["cpu"] == cpu_name()  # every figure names the CPU it was measured on


def test_every_run_starts_cold_and_order_alternates(greedy_results):
    results, made, _ = greedy_results
    assert all(r.plain.stats.reused_tokens == 0 and r.spec.stats.reused_tokens == 0 for r in results.rows)
    assert [r.plain_first for r in results.rows] == [i % 2 == 0 for i in range(len(results.rows))]
    assert len(made) == len(results.rows) + 2  # one per speculative run, plus a warm-up per k


def test_progress_callback(greedy_results):
    _, _, progress = greedy_results
    assert progress[0].phase == "warmup" and progress[0].prompt == "fib"
    rest = progress[1:]
    assert [p.phase for p in rest] == ["start", "done"] * 8
    assert [p.completed for p in rest if p.phase == "done"] == list(range(1, 9))
    assert all(p.total == 8 for p in rest)
    assert rest[1].row is not None and rest[1].describe().startswith("[1/8] fib k=1 repeat 1: ")
    assert rest[0].describe() == "[0/8] fib k=1 repeat 1"


def test_figures_are_consistent(greedy_results):
    results, _, _ = greedy_results
    for row in results.rows:
        assert row.speedup == row.spec.tokens_per_second / row.plain.tokens_per_second
        assert row.plain.tokens_per_second == row.plain.new_tokens / row.plain.decode_seconds
        st = row.spec.stats
        assert st.acceptance_rate == st.accepted / st.drafted
        assert st.tokens_per_step == st.new_tokens / st.steps
        assert len(st.acceptance_by_position) == row.k
    for summary in results.by_prompt + results.by_k + [results.overall]:
        rows = [r for r in results.rows if (summary.prompt in (None, r.prompt)) and (summary.k in (None, r.k))]
        speedups = [r.speedup for r in rows]
        assert summary.rows == summary.completed == len(rows)
        assert summary.speedup.median == statistics.median(speedups)
        assert summary.speedup.mean == pytest.approx(statistics.fmean(speedups))
        assert (summary.speedup.min, summary.speedup.max) == (min(speedups), max(speedups))
        assert summary.speedup.stdev == pytest.approx(statistics.stdev(speedups))
        plain_tokens = sum(r.plain.new_tokens for r in rows)
        plain_seconds = sum(r.plain.decode_seconds for r in rows)
        spec_tokens = sum(r.spec.new_tokens for r in rows)
        spec_seconds = sum(r.spec.decode_seconds for r in rows)
        assert summary.plain_tokens_per_second == pytest.approx(plain_tokens / plain_seconds)
        assert summary.spec_tokens_per_second == pytest.approx(spec_tokens / spec_seconds)
        assert summary.pooled_speedup == pytest.approx((spec_tokens / spec_seconds) / (plain_tokens / plain_seconds))
        assert summary.acceptance_rate == sum(r.spec.stats.accepted for r in rows) / sum(
            r.spec.stats.drafted for r in rows
        )
    assert [s.k for s in results.by_k] == [1, 3]
    assert [(s.prompt, s.k) for s in results.by_prompt] == [("fib", 1), ("fib", 3), ("abc", 1), ("abc", 3)]
    assert results.by_prompt[0].speedup.n == 2


def test_prompt_lookup_and_chat_prompts(pairs, chat_tokenizer):
    pair = pairs[1]
    prompts = [
        BenchPrompt("chat", messages=({"role": "user", "content": "abab abab"},)),
        BenchPrompt("text", text="x = 1\nx = 1\nx ="),
    ]
    results = run_bench(
        prompts,
        wrap(pair.target),
        chat_tokenizer,
        [EOS],
        PromptLookupDrafter,
        BenchSettings(max_new_tokens=MAX_NEW, ks=(2,), warmup=False),
    )
    assert len(results.rows) == 2 and results.errors == []
    chat_ids = encode_bench_prompt(chat_tokenizer, prompts[0])
    assert results.rows[0].prompt_tokens == len(chat_ids)
    assert results.rows[0].plain.token_ids == reference_greedy(pair.target, chat_ids)
    assert all(r.identical for r in results.rows)


class TargetDouble:
    """A backend that is `inner` but for the logits its `forward` returns (subclasses say how)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @property
    def cached_tokens(self):
        return self.inner.cached_tokens


class PerturbedVerification(TargetDouble):
    """A target whose multi-token verification passes (only speculative decoding makes
    them) push every row's argmax down once `after` tokens are cached: a broken
    speculative path that plain decoding never exercises."""

    def __init__(self, inner, after: int) -> None:
        super().__init__(inner)
        self.after = after

    def forward(self, token_ids, all_logits=True):
        cached_before = len(self.inner.cached_tokens)
        logits = self.inner.forward(token_ids, all_logits)
        if all_logits and len(token_ids) > 1 and cached_before >= self.after:
            logits = logits.clone()
            logits[torch.arange(logits.shape[0]), logits.argmax(dim=-1)] = float("-inf")
        return logits


def test_broken_speculative_path_is_reported_as_a_mismatch(pairs, tokenizer):
    pair = pairs[0]
    prompt = BenchPrompt("fib", text="def fib(n):")
    prompt_len = len(tokenizer(prompt.text)["input_ids"])
    target = PerturbedVerification(wrap(pair.target), after=prompt_len + 4)
    results = run_bench(
        [prompt],
        target,
        tokenizer,
        [EOS],
        lambda: ModelDrafter(wrap(pair.draft), len(tokenizer)),
        BenchSettings(max_new_tokens=MAX_NEW, ks=(2,), repeat=2),
    )
    reference = reference_greedy(pair.target, tokenizer(prompt.text)["input_ids"])
    assert len(results.rows) == 2
    for row in results.rows:
        assert row.completed and row.identical is False
        assert row.plain.token_ids == reference  # plain decoding is untouched
        position = next(i for i, (a, b) in enumerate(zip(row.plain.token_ids, row.spec.token_ids)) if a != b)
        assert position >= 3  # the first verifications ran before the fault
        assert row.mismatch_position == position
        assert row.check == "mismatch" and row.divergence.tolerance == 0.0  # float32
        assert row.error == (
            f"MISMATCH at token {position} (gap {row.divergence.gap:.3f}; plain id {row.plain.token_ids[position]},"
            f" speculative id {row.spec.token_ids[position]})"
        )
    overall = results.overall
    assert overall.mismatches == 2 and overall.failures == 0 and overall.errors == 2
    assert (overall.identical, overall.near_ties) == (0, 0)
    assert overall.speedup.n == 2  # timings of a mismatched pair are still measurements
    assert len(results.errors) == 2


class SplitAt(TargetDouble):
    """A target that, predicting new token `position`, scores two tokens at 16.0: in one-token
    passes (plain decoding) `first` leads by `lead`, in verification passes over several
    tokens `second` leads by `lead`, and in the bench's re-scoring pass (several tokens, last
    row only) `second` trails by `rescored_gap`. It stands for rounding that depends on the
    pass's shape (a near-tie, rescored_gap small) or for a faulty verification (a mismatch,
    rescored_gap wide)."""

    def __init__(
        self, inner, prompt_len: int, position: int, first: int, second: int, lead: float, rescored_gap: float
    ):
        super().__init__(inner)
        self.at = prompt_len + position  # the context length whose next token is new token `position`
        self.first, self.second = first, second
        self.lead, self.rescored_gap = lead, rescored_gap

    def forward(self, token_ids, all_logits=True):
        cached_before = len(self.inner.cached_tokens)
        logits = self.inner.forward(token_ids, all_logits).clone()
        first_row_context = cached_before + 1 if all_logits else cached_before + len(token_ids)
        row = self.at - first_row_context
        if 0 <= row < logits.shape[0]:
            logits[row] = logits[row].clamp(max=8.0)
            if len(token_ids) == 1:
                logits[row, self.first], logits[row, self.second] = 16.0, 16.0 - self.lead
            elif all_logits:
                logits[row, self.first], logits[row, self.second] = 16.0 - self.lead, 16.0
            else:
                logits[row, self.first], logits[row, self.second] = 16.0, 16.0 - self.rescored_gap
        return logits


def split_bench(pair, tokenizer, dtype, rescored_gap):
    prompt = BenchPrompt("fib", text="def fib(n):")
    prompt_ids = tokenizer(prompt.text)["input_ids"]
    position = 3
    first = reference_greedy(pair.target, prompt_ids)[position]
    second = next(t for t in (first + 1, first + 2) if t != EOS)
    target = SplitAt(
        wrap(pair.target), len(prompt_ids), position, first, second, lead=0.0625, rescored_gap=rescored_gap
    )
    results = run_bench(
        [prompt],
        target,
        tokenizer,
        [EOS],
        lambda: ModelDrafter(wrap(pair.draft), len(tokenizer)),
        BenchSettings(max_new_tokens=MAX_NEW, ks=(2,), warmup=False),
        dtype=dtype,
    )
    (row,) = results.rows
    assert row.plain.token_ids[position] == first and row.spec.token_ids[position] == second
    assert row.plain.token_ids[:position] == row.spec.token_ids[:position]
    return results, row, position


def test_a_divergence_at_a_bfloat16_tie_is_a_near_tie_and_not_an_error(pairs, tokenizer):
    results, row, position = split_bench(pairs[0], tokenizer, torch.bfloat16, rescored_gap=0.0)
    assert row.identical is False and row.check == "near-tie" and row.near_tie
    assert row.mismatch_position == position and row.error is None
    assert row.divergence.gap == 0.0 and row.divergence.tolerance == 0.25  # 2 ulps of bfloat16 at 16
    assert row.divergence.describe() == f"near-tie at token {position} (gap 0.000, bfloat16)"
    assert results.errors == []  # the command exits 0
    overall = results.overall
    assert (overall.identical, overall.near_ties, overall.mismatches, overall.errors) == (0, 1, 0, 0)
    assert overall.speedup.n == 1  # a near-tie row keeps its place in the speed-up
    assert "greedy: 0 identical, 1 near-ties, 0 mismatches" in bench_report.headline(results)
    assert bench_report.near_tie_lines(results) == [
        f"fib k=2 repeat 1: near-tie at token {position} (gap 0.000, bfloat16)"
    ]
    data = json.loads(bench_report.to_json(results))
    assert data["overall"]["near_ties"] == 1 and data["overall"]["mismatches"] == 0
    assert data["rows"][0]["check"] == "near-tie"
    assert data["rows"][0]["divergence"] == {
        "kind": "near-tie",
        "position": position,
        "plain_token": row.plain.token_ids[position],
        "speculative_token": row.spec.token_ids[position],
        "gap": 0.0,
        "tolerance": 0.25,
        "dtype": "bfloat16",
    }


def test_a_divergence_at_a_wide_gap_is_a_mismatch_in_bfloat16(pairs, tokenizer):
    results, row, position = split_bench(pairs[0], tokenizer, torch.bfloat16, rescored_gap=1.25)
    assert row.check == "mismatch" and row.divergence.gap == 1.25
    assert row.error.startswith(f"MISMATCH at token {position} (gap 1.250; plain id ")
    assert results.errors == [row]  # the command exits 1
    assert "greedy: 0 identical, 0 near-ties, 1 mismatches; 1 error rows" in bench_report.headline(results)


def test_in_float32_a_divergence_at_an_exact_tie_is_a_mismatch(pairs, tokenizer):
    results, row, position = split_bench(pairs[0], tokenizer, torch.float32, rescored_gap=0.0)
    assert row.check == "mismatch" and row.divergence.gap == 0.0 and row.divergence.tolerance == 0.0
    assert results.errors == [row]


class ExplodingDrafter(PromptLookupDrafter):
    def propose(self, context, k, sampling, generator, noise=None):
        raise RuntimeError("boom")


def test_a_failing_run_becomes_an_error_row_and_the_bench_goes_on(pairs, tokenizer):
    drafters = iter([ExplodingDrafter(), PromptLookupDrafter()])
    results = run_bench(
        [BenchPrompt("a", text="hello"), BenchPrompt("b", text="world")],
        wrap(pairs[0].target),
        tokenizer,
        [EOS],
        lambda: next(drafters),
        BenchSettings(max_new_tokens=MAX_NEW, ks=(1,), warmup=False),
    )
    failed, ok = results.rows
    assert failed.error == "speculative decoding failed: RuntimeError: boom"
    assert failed.spec is None and failed.plain is not None and failed.identical is None and failed.speedup is None
    assert ok.error is None and ok.identical
    assert results.overall.failures == 1 and results.overall.completed == 1 and results.overall.speedup.n == 1


def test_seeded_sampling_rows_share_a_seed_and_print_the_plain_sample(pairs, tokenizer):
    pair = pairs[0]
    settings = BenchSettings(
        sampling=SamplingConfig(temperature=1.0, seed=3), max_new_tokens=MAX_NEW, ks=(2, "auto"), repeat=2, warmup=False
    )
    results = run_bench(
        [BenchPrompt("a", text="hello")],
        wrap(pair.target),
        tokenizer,
        [EOS],
        lambda: ModelDrafter(wrap(pair.draft), len(tokenizer)),
        settings,
    )
    # Sampling rows are not compared (in bfloat16 rounding makes seeded runs diverge at
    # near-ties far more often than greedy ones), but with a seed sampling is coupled:
    # in float32 the speculative run prints the plain run's sample.
    assert [r.identical for r in results.rows] == [None] * 4 and results.errors == []
    assert all(r.spec.token_ids == r.plain.token_ids for r in results.rows)
    by_repeat = {r.repeat: r.spec.token_ids for r in results.rows}
    assert all(r.spec.token_ids == by_repeat[r.repeat] for r in results.rows)  # k 2 and k auto agree
    assert by_repeat[0] != by_repeat[1]  # repeat r uses seed + r
    # Plain runs with the same seed reproduce: a rerun of repeat 0 gives the same tokens.
    runner = BenchRunner(Speculator.over(wrap(pair.target), tokenizer, [EOS]), PromptLookupDrafter, settings)
    again = runner.run_row(BenchPrompt("a", text="hello"), tokenizer("hello")["input_ids"], 2, 0)
    assert again.plain.token_ids == results.rows[0].plain.token_ids == again.spec.token_ids


def test_interrupted_run_keeps_the_rows_so_far(pairs, tokenizer):
    def stop_after_two(p: BenchProgress):
        if p.phase == "done" and p.completed == 2:
            raise KeyboardInterrupt

    runner = BenchRunner(
        Speculator.over(wrap(pairs[0].target), tokenizer, [EOS]),
        PromptLookupDrafter,
        BenchSettings(max_new_tokens=4, ks=(1, 2), repeat=3, warmup=False),
        stop_after_two,
    )
    with pytest.raises(KeyboardInterrupt):
        runner.run([BenchPrompt("a", text="hello")])
    partial = runner.results(complete=False)
    assert len(partial.rows) == 2 and partial.complete is False
    assert bench_report.headline(partial).endswith("(interrupted: partial results)")


# --------------------------------------------------------------------------- summaries and reports on fixed numbers


def fixed_run(tokens: int, seconds: float, drafted: int = 0, accepted: int = 0, steps: int | None = None) -> RunResult:
    stats = GenerationStats(
        prompt_tokens=5,
        new_tokens=tokens,
        steps=steps or tokens,
        drafted=drafted,
        accepted=accepted,
        fed=drafted + (steps or tokens),
        verify_seconds=seconds,
        total_seconds=seconds + 0.5,
        finish_reason="length",
    )
    if drafted:
        stats.drafted_at, stats.accepted_at = [drafted // 2, drafted // 2], [accepted // 2, accepted - accepted // 2]
    return RunResult(stats, list(range(tokens)))


def fixed_results() -> BenchResults:
    rows = [
        # prompt "p|1" (a pipe to escape in Markdown), k=2: speed-ups 2.0 and 1.0
        BenchRow("p|1", "code", 2, 0, 5, True, fixed_run(10, 1.0), fixed_run(10, 0.5, 8, 6, 5), True),
        BenchRow("p|1", "code", 2, 1, 5, False, fixed_run(10, 1.0), fixed_run(10, 1.0, 8, 2, 8), True),
        # prompt "q", k=2: speed-up 4.0, and a failed row
        BenchRow("q", None, 2, 0, 5, True, fixed_run(20, 2.0), fixed_run(20, 0.5, 12, 10, 8), True),
        BenchRow(
            "q",
            None,
            2,
            1,
            5,
            False,
            fixed_run(20, 2.0),
            None,
            None,
            None,
            "speculative decoding failed: RuntimeError: boom",
        ),
    ]
    return BenchResults(BenchSettings(max_new_tokens=20, ks=(2,), repeat=2), rows, {"target": "t"})


def test_stats_count_passes_by_tokens_fed_and_pool_them():
    first, second = GenerationStats(), GenerationStats()
    for stats, feds in ((first, [1, 3, 3]), (second, [3, 7])):
        for step, fed in enumerate(feds):
            stats.observe(StepEvent(step, fed - 1, 0, 0.0, 0.1, fed=fed, tree=fed == 7))
    assert first.passes == {1: 1, 3: 2}
    assert GenerationStats.pooled([first, second]).passes == {1: 1, 3: 3, 7: 1}


def test_summaries_on_fixed_numbers():
    results = fixed_results()
    assert [r.speedup for r in results.rows] == [2.0, 1.0, 4.0, None]
    p, q = results.by_prompt
    assert p.speedup == Spread(n=2, median=1.5, mean=1.5, min=1.0, max=2.0, stdev=statistics.stdev([2.0, 1.0]))
    assert p.plain_tokens_per_second == 10.0 and p.spec_tokens_per_second == 20 / 1.5
    assert p.acceptance_rate == 8 / 16 and p.tokens_per_step == 20 / 13
    assert p.mean_pass_size == (16 + 13) / 13
    assert q.speedup == Spread(n=1, median=4.0, mean=4.0, min=4.0, max=4.0, stdev=None)
    assert (q.rows, q.completed, q.failures, q.errors) == (2, 1, 1, 1)
    overall = results.overall
    assert overall.speedup.median == 2.0 and overall.speedup.mean == pytest.approx(7 / 3)
    assert overall.plain_tokens_per_second == 40 / 4.0
    assert overall.spec_tokens_per_second == 40 / 2.0
    assert overall.pooled_speedup == 2.0
    assert overall.acceptance_by_position == [(3 + 1 + 5) / 14, (3 + 1 + 5) / 14]
    payload = json.loads(json.dumps(results.as_dict()))
    assert payload["overall"]["speedup"]["median"] == 2.0
    assert payload["rows"][3]["speculative"] is None


def test_csv_report():
    text = bench_report.to_csv(fixed_results())
    rows = list(csv.reader(io.StringIO(text)))
    assert tuple(rows[0]) == CSV_COLUMNS
    assert len(rows) == 5
    first = dict(zip(CSV_COLUMNS, rows[1]))
    assert first["prompt"] == "p|1" and first["k"] == "2" and first["speedup"] == "2.0"
    assert first["plain_tokens_per_second"] == "10.0" and first["spec_tokens_per_second"] == "20.0"
    assert first["acceptance_rate"] == "0.75" and first["acceptance_by_position"] == "0.7500 0.7500"
    assert first["mean_pass_size"] == "2.6" and first["tree_steps"] == "0"
    assert first["identical"] == "true" and first["error"] == ""
    failed = dict(zip(CSV_COLUMNS, rows[4]))
    assert failed["speedup"] == "" and failed["error"] == "speculative decoding failed: RuntimeError: boom"


def test_json_report():
    payload = json.loads(bench_report.to_json(fixed_results()))
    assert set(payload) == {"complete", "settings", "metadata", "overall", "by_k", "by_category", "by_prompt", "rows"}
    assert [(s["category"], s["completed"]) for s in payload["by_category"]] == [("code", 2), ("uncategorised", 1)]
    assert payload["settings"]["ks"] == [2] and payload["metadata"] == {"target": "t"}
    assert [s["prompt"] for s in payload["by_prompt"]] == ["p|1", "q"]
    assert payload["rows"][0]["speedup"] == 2.0


def test_markdown_report():
    text = bench_report.to_markdown(fixed_results())
    lines = text.splitlines()
    assert lines[0] == "| " + " | ".join(SUMMARY_COLUMNS) + " |"
    assert lines[1].startswith("|---|---|---:|")
    assert lines[2].startswith("| p\\|1 | code | 2 | 10.00 | 13.33 | 1.50x | 1.00-2.00 | 50.0% | 1.54 | ")
    assert " | 2.2 | " in lines[2]  # pass size: (16 drafted + 13 steps) / 13 steps
    assert lines[3].startswith("| q | - | 2 | 10.00 | 40.00 | 4.00x | - |")
    assert lines[4].startswith("| **all prompts** | **-** | **2** |")
    assert lines[5].startswith("| **all code** | **code** | **2** | **10.00** | **13.33** | **1.50x** |")
    assert lines[6].startswith("| **all uncategorised** | **uncategorised** | **2** |")
    assert "- q k=2 repeat 2: speculative decoding failed: RuntimeError: boom" in lines


def test_table_report():
    console = Console(record=True, width=200, color_system=None)
    bench_report.print_table(fixed_results(), console)
    out = console.export_text()
    for cell in ("p|1", "all prompts", "1.50x", "4.00x", "1 failed", "error: q k=2 repeat 2"):
        assert cell in out
    assert "speed-up: median 2.00x, mean 2.33x (min 1.00x, max 4.00x, stdev 1.53) over 3 runs" in out
    assert bench_report.render(fixed_results(), "table").count("all prompts") == 1


def test_table_report_shows_bracketed_names_as_text():
    # Rich would read "[/i]" as a closing tag (an error) and "[int]" as a style (dropped).
    run = fixed_run(10, 0.5, 8, 6, 5)
    rows = [BenchRow("tag [/i] of list[int]", "[b]code", 2, 0, 5, True, fixed_run(10, 1.0), run, True)]
    results = BenchResults(BenchSettings(max_new_tokens=20, ks=(2,), repeat=1), rows, {})
    console = Console(record=True, width=200, color_system=None)
    bench_report.print_table(results, console)
    out = console.export_text()
    assert "tag [/i] of list[int]" in out and "[b]code" in out


def test_render_dispatch():
    results = fixed_results()
    assert bench_report.render(results, "csv") == bench_report.to_csv(results)
    assert bench_report.render(results, "md") == bench_report.to_markdown(results)
    assert bench_report.render(results, "json") == bench_report.to_json(results)
    with pytest.raises(ReportError, match="unknown report format 'xml'"):
        bench_report.render(results, "xml")


def test_plot_writes_a_png(tmp_path, greedy_results):
    pytest.importorskip("matplotlib")
    results, _, _ = greedy_results
    path = bench_report.plot(results, tmp_path / "bench.png")
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    fixed = bench_report.plot(fixed_results(), tmp_path / "fixed.png")
    assert fixed.read_bytes()[:8] == PNG_SIGNATURE


def test_plot_without_matplotlib_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ReportError) as info:
        bench_report.plot(fixed_results(), tmp_path / "x.png")
    assert str(info.value) == "the plot needs matplotlib, which is not installed"
    assert info.value.hint == "pip install matplotlib"
    assert not (tmp_path / "x.png").exists()


def test_k_auto_keeps_one_policy_across_runs_with_the_same_drafter(pairs, tokenizer):
    # What k auto learns on one prompt carries over to the next, as in a chat session.
    pair = pairs[0]
    drafter = ModelDrafter(wrap(pair.draft), len(tokenizer))
    generator = Speculator.over(wrap(pair.target), tokenizer, [EOS])
    policies = []
    original = generator.use_drafter

    def use_drafter(d):
        original(d)
        policies.append(generator.decoder.policy_for(BenchSettings(ks=("auto",)).spec_config("auto")))

    generator.use_drafter = use_drafter
    settings = BenchSettings(max_new_tokens=8, ks=("auto",), repeat=2, warmup=False)
    results = BenchRunner(generator, lambda: drafter, settings).run(PROMPTS)
    assert len(results.rows) == 4 and all(r.error is None for r in results.rows)
    assert len(policies) == 4 and all(p is policies[0] for p in policies)
    assert generator.decoder.learned() is not None  # it drafted, and learned from it


def _benchmark_script():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "benchmark.py"
    spec = importlib.util.spec_from_file_location("benchmark_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_keeps_the_fastest_of_repeated_runs():
    fastest_run = _benchmark_script().fastest_run
    runs = [
        {"tokens": [1, 2], "seconds": 3.0, "passes": {1: 2}},
        {"tokens": [1, 2], "seconds": 2.0, "passes": {2: 1}},
        {"tokens": [1, 2], "seconds": 2.5, "passes": {1: 2}},
    ]
    best = fastest_run(runs)
    assert best["seconds"] == 2.0 and best["passes"] == {2: 1}  # that run's own record, not a mix
    assert best["seconds_all"] == [3.0, 2.0, 2.5]
    assert best["repeats_identical"] is True
    runs[2]["tokens"] = [1, 3]
    assert fastest_run(runs)["repeats_identical"] is False


@pytest.mark.parametrize("count", [2, 3, 4, 5, 6])
def test_benchmark_orders_each_method_first_and_after_each_other_equally_often(count):
    balanced_order = _benchmark_script().balanced_order
    methods = [f"m{i}" for i in range(count)]
    rounds = count if count % 2 == 0 else 2 * count
    orders = [balanced_order(methods, sequence) for sequence in range(rounds)]
    assert all(sorted(order) == methods for order in orders)
    firsts = Counter(order[0] for order in orders)
    assert set(firsts.values()) == {rounds // count}
    follows = Counter((a, b) for order in orders for a, b in zip(order, order[1:]))
    assert len(follows) == count * (count - 1) and set(follows.values()) == {rounds // count}
