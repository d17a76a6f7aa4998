"""`specgen train`, `specgen heads` and `--draft medusa|eagle` as a black box."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ON_CPU, char_tokenizer, save_model_folder, tiny_llama
from test_heads import TEXT

REPO = Path(__file__).resolve().parents[1]


def specgen(*args: str, cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "speccli.cli", *args],
        input=b"",
        capture_output=True,
        cwd=REPO,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), "SPECGEN_CACHE": str(cache), "OMP_NUM_THREADS": "1"},
    )


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    tokenizer = char_tokenizer()
    target = tiny_llama(len(tokenizer), seed=7, hidden=32, logit_scale=4.0)
    other = tiny_llama(len(tokenizer), seed=8, hidden=32, logit_scale=4.0)
    (root / "data").mkdir()
    (root / "data" / "code.py").write_text(TEXT)
    return {
        "root": root,
        "target": str(save_model_folder(target, tokenizer, root / "target")),
        "other": str(save_model_folder(other, tokenizer, root / "other")),
        "data": str(root / "data"),
        "cache": root / "cache",
        "model": target,
        "tokenizer": tokenizer,
    }


def test_train_then_draft_with_the_heads(setup):
    cache = setup["cache"]
    trained = specgen(
        "train",
        "medusa",
        "--target",
        setup["target"],
        "--data",
        setup["data"],
        "--tokens",
        "4096",
        "--heads",
        "3",
        "--vocab",
        "40",
        "--epochs",
        "4",
        *ON_CPU,
        "--dtype",
        "float32",
        "--json",
        cache=cache,
    )
    assert trained.returncode == 0, trained.stderr.decode()
    record = json.loads(trained.stdout)
    path = Path(record["path"])
    assert path.is_file() and path.parent == cache / "heads" / "target"
    assert record["kind"] == "medusa" and len(record["accuracy"]) == 3 and record["vocab"] == 40
    assert record["tokens"] == 15 * 256 and record["held_out_tokens"] == 256
    err = trained.stderr.decode()
    assert "held-out top-1: head 1 " in err and f"saved {path}" in err
    assert not path.with_name(path.name + ".checkpoint").exists()

    # Found in the cache for its target; the output is the target's own greedy text.
    prompt = "def add(a, b):\n"
    generated = specgen(
        "generate",
        prompt,
        "--target",
        setup["target"],
        "--draft",
        "medusa",
        "--k",
        "3",
        "--max-new-tokens",
        "24",
        *ON_CPU,
        "--dtype",
        "float32",
        "--json",
        cache=cache,
    )
    assert generated.returncode == 0, generated.stderr.decode()
    ids = setup["tokenizer"](prompt)["input_ids"]
    reference = setup["model"].generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids) :].tolist()
    if 2 in reference:
        reference = reference[: reference.index(2)]
    assert json.loads(generated.stdout)["token_ids"] == reference
    assert "medusa heads from" in generated.stderr.decode()

    listed = specgen("heads", "--json", cache=cache)
    assert listed.returncode == 0
    (entry,) = json.loads(listed.stdout)
    assert entry["kind"] == "medusa" and entry["path"] == str(path) and entry["tokens"] == 15 * 256

    # Another target refuses them, in one line with a hint, exit 2.
    refused = specgen(
        "generate",
        "x",
        "--target",
        setup["other"],
        "--draft",
        f"medusa:{path}",
        *ON_CPU,
        "--dtype",
        "float32",
        cache=cache,
    )
    assert refused.returncode == 2
    lines = refused.stderr.decode().strip().splitlines()
    assert any(
        line.startswith("error: ") and "was trained for" in line and "output weights differ" in line for line in lines
    ), lines
    assert "Traceback" not in refused.stderr.decode()


def test_train_on_the_targets_own_answers(setup, tmp_path):
    args = (
        "train",
        "eagle",
        "--target",
        setup["target"],
        "--answers",
        "2",
        "--tokens",
        "2048",
        "--epochs",
        "1",
        "--vocab",
        "40",
        *ON_CPU,
        "--dtype",
        "float32",
        "--json",
    )
    first = specgen(*args, "--unroll", "2", cache=tmp_path)
    assert first.returncode == 0, first.stderr.decode()
    err = first.stderr.decode()
    trained = json.loads(first.stdout)
    # Accuracy at three depths, each where the tokens before it were right.
    assert trained["config"]["eagle_steps"] == 2 and len(trained["accuracy"]) == 3
    assert "held-out top-1: first token " in err and ", token 3 " in err and "(where the ones before were right)" in err
    answers = tmp_path / "heads" / "target" / "answers.jsonl"
    assert f"the target answers 2 of 2 requests (through transformers; kept in {answers})" in err
    assert json.loads(first.stdout)["data"].startswith("2 of the target's own answers, then")
    chats = [json.loads(line)["messages"] for line in answers.read_text().splitlines()]
    assert [c[0]["role"] for c in chats] == ["user", "user"] and all(c[1]["content"] for c in chats)
    # The answers are the target's own greedy continuation of each request.
    request = chats[0][0]["content"]
    ids = setup["tokenizer"](request)["input_ids"]
    expected = setup["model"].generate(torch.tensor([ids]), max_new_tokens=192, do_sample=False)[0, len(ids) :].tolist()
    if 2 in expected:
        expected = expected[: expected.index(2)]
    assert chats[0][1]["content"] == setup["tokenizer"].decode(expected, skip_special_tokens=True)
    again = specgen(*args, cache=tmp_path)  # made once: a rerun reads them back
    assert again.returncode == 0 and "the target answers" not in again.stderr.decode()
    # By default, with answers: 256 tokens per answer and 8 passes.
    default = specgen(*args[:6], "--vocab", "40", *ON_CPU, "--dtype", "float32", "--json", cache=tmp_path)
    record = json.loads(default.stdout)
    assert record["config"]["epochs"] == 8.0 and record["tokens"] + record["held_out_tokens"] == 2 * 256
    assert record["config"]["eagle_steps"] == 3  # EAGLE_UNROLL
    bad = specgen("train", "eagle", "--target", setup["target"], "--answers", "-1", cache=tmp_path)
    assert bad.returncode == 2 and "--answers must be 0 or more, got -1" in bad.stderr.decode()
    bad = specgen("train", "eagle", "--target", setup["target"], "--unroll", "0", cache=tmp_path)
    assert bad.returncode == 2 and "--unroll must be at least 1, got 0" in bad.stderr.decode()


def test_missing_heads_and_bad_kind_exit_2(setup, tmp_path):
    missing = specgen("generate", "x", "--target", setup["target"], "--draft", "eagle", *ON_CPU, cache=tmp_path)
    assert missing.returncode == 2
    err = missing.stderr.decode()
    assert "no eagle heads trained for" in err and "specgen train eagle --target" in err
    bad = specgen("train", "hydra", "--target", setup["target"], cache=tmp_path)
    assert bad.returncode == 2 and "unknown kind of heads 'hydra'" in bad.stderr.decode()
    empty = specgen("heads", cache=tmp_path)
    assert empty.returncode == 0 and "no heads trained yet" in empty.stdout.decode()


def test_train_progress_without_a_terminal_prints_a_line_every_tenth():
    from speccli.heads.train import TrainProgress
    from speccli.ui.progress import TrainProgressDisplay

    lines: list[str] = []
    display = TrainProgressDisplay(lines.append, bar=False)
    with display:
        for done in range(0, 1001, 50):
            display.features(done, 1000)
        display.steps(TrainProgress(step=3, steps=3, loss=0.5, seconds=1.0))
        display.say("saved")
    assert lines == [f"target features (tokens): {n}/1000" for n in range(0, 1001, 100)] + [
        "training (steps): 3/3, loss 0.500",
        "saved",
    ]
