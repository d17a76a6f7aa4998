"""Issue 17: with --seed, generate, chat, bench and --json print the target's own sample for
that seed, the same every time, whatever the drafter, k (auto included) or timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import char_tokenizer, perturbed_copy, save_model_folder, tiny_llama, wrap
from speccli.api import Speculator
from speccli.backends.hf import HFCausalLM
from speccli.chat import ChatSession, ChatSettings
from speccli.cli import app
from speccli.config import SamplingConfig, SpecConfig
from speccli.drafters.model import ModelDrafter
from speccli.events import TokenEvent
from speccli.loop import SpeculativeDecoder
from speccli.prompts import Prompt
from test_chat import chat_tokenizer

REPO = Path(__file__).resolve().parents[1]
EOS = 2
PROMPT = "def fib(n):"
MAX_NEW = 16


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tokenizer = char_tokenizer()
    target = tiny_llama(len(tokenizer), seed=1, logit_scale=3.0, max_positions=4096)
    draft = perturbed_copy(target, noise=0.3, seed=11)
    root = tmp_path_factory.mktemp("models")
    return {
        "tokenizer": tokenizer,
        "target_model": target,
        "target": str(save_model_folder(target, tokenizer, root / "target")),
        "draft": str(save_model_folder(draft, tokenizer, root / "draft")),
    }


def target_sample(folders, seed: int, temperature: float = 0.8) -> str:
    """The plain target's sample for this seed, in this process."""
    generator = Speculator.over(wrap(folders["target_model"]), folders["tokenizer"], [EOS])
    sampling = SamplingConfig(temperature=temperature, seed=seed)
    return generator.stream(Prompt.of(PROMPT), sampling, SpecConfig(max_new_tokens=MAX_NEW), plain=True).run().text


def draft_args(folders, method: str) -> list[str]:
    if method == "none":
        return ["--draft", "none"]
    if method == "ngram":
        return ["--draft", "ngram"]
    return ["--draft", folders["draft"], "--k", method]


def cli_args(folders, seed: int, method: str) -> list[str]:
    return [
        "generate",
        PROMPT,
        "--target",
        folders["target"],
        *draft_args(folders, method),
        "--dtype",
        "float32",
        "-q",
        "--temperature",
        "0.8",
        "--seed",
        str(seed),
        "-n",
        str(MAX_NEW),
    ]


def test_generate_prints_the_same_text_for_a_seed_with_any_drafter_and_k(folders, tmp_path):
    """Real runs, one process each, as a user makes them (k auto calibrates on the first)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "SPECGEN_CACHE": str(tmp_path)}
    expected = target_sample(folders, 1)
    assert expected
    texts = {}
    for method in ("none", "auto", "auto"):
        result = subprocess.run(
            [sys.executable, "-m", "speccli.cli", *cli_args(folders, 1, method)],
            capture_output=True,
            cwd=REPO,
            env=env,
            timeout=300,
            stdin=subprocess.DEVNULL,
        )
        assert result.returncode == 0, result.stderr.decode()
        assert result.stdout.decode() == expected, method
        texts.setdefault(method, set()).add(result.stdout.decode())
    assert texts["auto"] == {expected}  # twice in a row


def test_generate_in_process_for_more_seeds_and_json(folders, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path))
    runner = CliRunner()
    for seed in (2, 3, 4):
        expected = target_sample(folders, seed)
        for method in ("none", "4", "auto", "ngram"):
            result = runner.invoke(app, cli_args(folders, seed, method))
            assert result.exit_code == 0, result.output
            assert result.stdout == expected, (seed, method)
        payload = json.loads(runner.invoke(app, [*cli_args(folders, seed, "auto"), "--json"]).stdout)
        assert payload["text"] == expected
    # Another seed, another sample.
    assert len({target_sample(folders, seed) for seed in (2, 3, 4)}) > 1


def test_chat_answers_replay_for_a_seed_with_any_drafter(folders):
    """Answer n uses seed + n, /regen included; with or without a draft, any k, each answer
    is the plain target's sample for its seed."""
    tokenizer = chat_tokenizer()
    model, draft_model = folders["target_model"], perturbed_copy(folders["target_model"], noise=0.3, seed=11)

    def session(drafter: bool, k) -> ChatSession:
        target = HFCausalLM(model)
        drafter_ = ModelDrafter(HFCausalLM(draft_model), target.vocab_size) if drafter else None
        settings = ChatSettings.of(max_tokens=MAX_NEW, k=k)
        chat = ChatSession(
            Speculator(SpeculativeDecoder(target, tokenizer, [EOS], drafter_)), settings, None, model_info={}
        )
        chat.set("temperature", "0.9")
        chat.set("seed", "5")
        return chat

    def text(answer) -> str:
        return "".join(e.text for e in answer if isinstance(e, TokenEvent))

    def answers(chat: ChatSession) -> list[str]:
        return [text(chat.ask("hello")), text(chat.regenerate()), text(chat.regenerate()), text(chat.ask("and then?"))]

    runs = [
        answers(session(False, 4)),
        answers(session(True, 1)),
        answers(session(True, "auto")),
        answers(session(True, "auto")),
    ]
    assert all(run == runs[0] for run in runs[1:]), runs
    first, regen1, regen2, _ = runs[0]
    assert len({first, regen1, regen2}) > 1  # /regen draws a new sample (seed + n)
    # Answer n is the target's own sample with seed 5 + n.
    plain = Speculator.over(HFCausalLM(model), tokenizer, [EOS])
    ids = session(False, 4).prompt_ids([{"role": "user", "content": "hello"}])
    for n, text in enumerate([first, regen1, regen2]):
        sampling = SamplingConfig(temperature=0.9, seed=5 + n)
        assert plain.stream(ids, sampling, SpecConfig(max_new_tokens=MAX_NEW), plain=True).run().text == text
