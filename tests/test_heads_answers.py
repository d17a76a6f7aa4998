"""The target's own answers as training text: the requests, the resumable answers file, the corpus."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from speccli.heads.answers import make_answers, read_answers
from speccli.heads.command import _fitting, default_text
from speccli.heads.corpus import Tokens, build_corpus
from speccli.heads.instructions import LANGUAGES, SENTENCES, requests

BENCH_PROMPTS = Path(__file__).resolve().parents[1] / "scripts" / "prompts" / "default.jsonl"


def test_requests_are_the_same_every_time_unique_and_of_every_kind():
    made = requests(120)
    assert made == requests(120) and len(set(made)) == 120
    assert requests(10) == made[:10]  # a larger count extends the list
    assert requests(120, seed=1) != made
    kinds = {
        "chat": ("tips for", "email to", "Explain to a child", "pros and cons", "short story"),
        "arithmetic": ("step by step", "Show your work", "When does it arrive", "% of", "notebooks cost"),
        "translation": ("Translate into",),
        "code": ("Write a Python function", "with a short Python example", "Explain what this Python function does"),
    }
    for kind, markers in kinds.items():
        assert sum(any(m in r for m in markers) for r in made) >= 12, kind


def test_a_kind_that_runs_out_gives_its_turns_to_the_others():
    # Translations run out after len(LANGUAGES) x len(SENTENCES) requests; a longer list once
    # stopped there (352 requests for any larger count).
    made = requests(500)
    assert len(made) == len(set(made)) == 500
    assert made[:352] == requests(352)
    assert sum(r.startswith("Translate into") for r in made) == len(LANGUAGES) * len(SENTENCES)


def test_no_request_is_a_benchmark_prompt():
    # Heads trained on the benchmark's own prompts would be measured on text they had seen.
    bench = set()
    for line in BENCH_PROMPTS.read_text().splitlines():
        item = json.loads(line)
        for message in item.get("messages", []):
            if message["role"] == "user":
                bench.add(message["content"].strip())
        if isinstance(item.get("prompt"), str):
            bench.add(item["prompt"].strip())
    assert bench and not bench & {r.strip() for r in requests(400)}


def test_answers_are_made_once_and_resumed(tmp_path):
    path = tmp_path / "answers.jsonl"
    asked: list[str] = []

    def answer(batch: list[str]) -> list[str]:
        asked.extend(batch)
        return [f"answer to {request[:10]}" for request in batch]

    first = requests(3)
    make_answers(first, path, answer)
    assert asked == first and len(path.read_text().splitlines()) == 3
    # Killed in the middle of a line: that line is dropped and made again.
    with path.open("a") as out:
        out.write('{"messages": [{"role": "user", "content": "cut')
    progress: list[tuple[int, int]] = []
    more = requests(5)
    make_answers(more, path, answer, lambda done, total: progress.append((done, total)))
    assert asked == first + more[3:]
    assert progress == [(3, 5), (4, 5), (5, 5)]
    made = read_answers(path)
    assert list(made) == more and made[more[4]] == f"answer to {more[4][:10]}"
    assert all(json.loads(line)["messages"][1]["role"] == "assistant" for line in path.read_text().splitlines())


def test_a_first_answer_cut_short_is_made_again(tmp_path):
    path = tmp_path / "answers.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "cut')
    make_answers(requests(1), path, lambda batch: ["done"] * len(batch))
    assert read_answers(path) == {requests(1)[0]: "done"} and len(path.read_text().splitlines()) == 1


def test_answers_are_asked_for_in_batches_and_kept_after_each(tmp_path):
    path = tmp_path / "answers.jsonl"
    batches: list[int] = []
    lines_before: list[int] = []

    def answer(batch: list[str]) -> list[str]:
        batches.append(len(batch))
        lines_before.append(len(path.read_text().splitlines()) if path.exists() else 0)
        return [request.upper() for request in batch]

    progress: list[tuple[int, int]] = []
    make_answers(requests(7), path, answer, lambda done, total: progress.append((done, total)), batch=3)
    assert batches == [3, 3, 1] and lines_before == [0, 3, 6]
    assert progress == [(0, 7), (3, 7), (6, 7), (7, 7)]
    assert read_answers(path) == {r: r.upper() for r in requests(7)}
    with pytest.raises(ValueError, match="2 requests got 1 answers"):
        make_answers(requests(9), path, lambda batch: batch[:1], batch=2)


def test_a_batch_is_cut_where_its_prompts_and_answers_would_not_fit_the_cache():
    prompts = [[1] * 10, [2] * 30, [3] * 5, [4] * 80]
    assert _fitting(prompts, 20, 100) == [[[1] * 10, [2] * 30], [[3] * 5], [[4] * 80]]
    assert _fitting(prompts, 0, 1000) == [prompts]


def test_answers_come_first_in_the_corpus(tokenizer):
    chats = [[{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4. " * 60}]]
    corpus = build_corpus(tokenizer, 512, chats=chats, segment_tokens=64)
    rendered = Tokens(tokenizer).chat(chats[0])
    assert len(rendered) > 64 and corpus.segments[0] == rendered[:64]
    assert corpus.segments != build_corpus(tokenizer, 512, segment_tokens=64).segments
    assert corpus.description.startswith("1 of the target's own answers, then Python standard library")


def test_answers_shorten_the_default_text_but_not_the_users_own():
    assert default_text(250, own_data=False) == (64_000, 8.0)
    assert default_text(250, own_data=True) == default_text(0, own_data=False) == (180_000, 4.0)


def test_a_batch_of_greedy_answers_is_each_prompts_own_greedy_continuation():
    import torch

    from conftest import tiny_llama
    from speccli.heads.command import greedy_batch

    model = tiny_llama(40, seed=3, logit_scale=4.0).eval()
    prompts = [[5, 6, 7, 8, 9, 10], [11], [12, 13, 14]]
    alone = [
        model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p) :].tolist() for p in prompts
    ]
    assert greedy_batch(model, prompts, 12, stop=[39]) == alone  # padded on the left, masked: the same tokens
    # Each answer ends before its first stop token; the others run on.
    stop = alone[0][4]
    cut = [row[: row.index(stop)] if stop in row else row for row in alone]
    assert greedy_batch(model, prompts, 12, stop=[stop, 39]) == cut and len(cut[0]) <= 4
    with pytest.raises(ValueError, match="stop token"):
        greedy_batch(model, prompts, 12, stop=[])


def test_answers_come_through_transformers_in_batches_where_the_target_is_in_a_fast_dtype():
    from types import SimpleNamespace

    import torch

    from speccli.heads.command import TRANSFORMERS_ANSWER_BATCH, _batches_fast

    def loaded(device: str, dtype: torch.dtype):
        return SimpleNamespace(device=torch.device(device), dtype=dtype)

    assert _batches_fast(loaded("cpu", torch.bfloat16)) and _batches_fast(loaded("cpu", torch.float16))
    assert _batches_fast(loaded("cuda", torch.float32)) and not _batches_fast(loaded("cpu", torch.float32))
    assert TRANSFORMERS_ANSWER_BATCH >= 16
