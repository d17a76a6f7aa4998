"""The target's own answers to requests (speccli.heads.instructions), kept as a .jsonl chat
file: the text heads draft in is the target's answers, and heads trained on the standard
library's sources alone guess much worse there (an EAGLE head trained on them guessed the
target's held-out answers far less often than the stdlib's held-out tokens).

Answers are greedy, made a batch of requests at a time and appended to the file as they come:
a run cut short resumes with the first request the file lacks, and a larger count reuses
the answers already made.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Sequence

Answer = Callable[[Sequence[str]], list[str]]  # requests in, the target's answers out, in order
Progress = Callable[[int, int], None]  # (answers made, answers asked for)

ANSWER_TOKENS = 192  # new tokens per answer at most


def read_answers(path: Path) -> dict[str, str]:
    """The answers already in `path`, by request (an unreadable last line, cut short by a
    kill, is dropped and made again)."""
    answers: dict[str, str] = {}
    if not path.exists():
        return answers
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            messages = json.loads(line)["messages"]
            answers[messages[0]["content"]] = messages[1]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            continue
    return answers


def make_answers(
    requests: Sequence[str], path: Path, answer: Answer, progress: Progress | None = None, batch: int = 1
) -> Path:
    """The file of chats (user: request, assistant: the target's answer) for `requests`,
    making only the answers it lacks, `batch` requests per call of `answer`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    made = read_answers(path)
    missing = [r for r in requests if r not in made]
    if path.exists() and path.read_bytes()[-1:] not in (b"", b"\n"):
        # A line cut short by a kill: rewrite the file from what could be read.
        path.write_text("".join(_line(r, a) for r, a in made.items()), encoding="utf-8")
    done = len(requests) - len(missing)
    if progress is not None:
        progress(done, len(requests))
    with path.open("a", encoding="utf-8") as out:
        for first in range(0, len(missing), max(1, batch)):
            asked = missing[first : first + max(1, batch)]
            answers = answer(asked)
            if len(answers) != len(asked):
                raise ValueError(f"{len(asked)} requests got {len(answers)} answers")
            out.write("".join(_line(r, a) for r, a in zip(asked, answers)))
            out.flush()
            done += len(asked)
            if progress is not None:
                progress(done, len(requests))
    return path


def _line(request: str, answer: str) -> str:
    chat = [{"role": "user", "content": request}, {"role": "assistant", "content": answer}]
    return json.dumps({"messages": chat}, ensure_ascii=False) + "\n"
