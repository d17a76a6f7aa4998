"""The example drafter of docs/development.md: one file implementing the Drafter protocol and
one registry line make a working `--draft NAME`. The test runs the very code block the page shows."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import ON_CPU, char_tokenizer, save_model_folder, tiny_llama, wrap
from speccli.cli import app
from speccli.config import SamplingConfig, SpecConfig
from speccli.drafters.registry import DRAFTERS
from speccli.events import StepEvent
from speccli.loop import SpeculativeDecoder
from test_decoder_greedy import emitted, encode, target_greedy

DOC = Path(__file__).resolve().parents[1] / "docs" / "development.md"

pytestmark = pytest.mark.usefixtures("private_cache")


def example_source() -> str:
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("## Adding a drafter") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture
def echo():
    namespace: dict = {}
    exec(compile(example_source(), str(DOC), "exec"), namespace)
    yield namespace["EchoDrafter"]
    DRAFTERS.pop("echo", None)


def test_the_example_is_short():
    assert len(example_source().strip().splitlines()) <= 30


def test_the_example_is_registered_and_lossless(echo, pairs, tokenizer):
    assert DRAFTERS["echo"] is echo
    target = pairs[0].target
    for text in ("abcabcabcab", "def fib(n):\n    return fib(n"):
        prompt = encode(tokenizer, text)
        decoder = SpeculativeDecoder(wrap(target), tokenizer, [], DRAFTERS["echo"]())
        events = list(decoder.generate(prompt, SamplingConfig(), SpecConfig(k=3, max_new_tokens=32)))
        assert emitted(events) == target_greedy(target, prompt)
        assert sum(e.drafted for e in events if isinstance(e, StepEvent)) > 0  # it did guess


def test_draft_echo_from_the_command_line(echo, tmp_path):
    tokenizer = char_tokenizer()
    folder = save_model_folder(tiny_llama(len(tokenizer), seed=1, logit_scale=20.0), tokenizer, tmp_path / "target")
    result = CliRunner().invoke(
        app,
        [
            "generate",
            "abcabcabc",
            "--target",
            str(folder),
            "--draft",
            "echo",
            *ON_CPU,
            "--dtype",
            "float32",
            "-n",
            "12",
            "--k",
            "2",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["draft"] == "echo" and len(payload["token_ids"]) == 12
