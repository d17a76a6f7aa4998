"""Every bad input, through the real entry point (`python -m speccli.cli`, a new process):
one line on stderr with a hint, exit 2 for usage and 1 for runtime failures, no traceback,
and nothing deleted or changed by a failed command. docs/development.md states the contract.

Two parts: a table of cases (every command and option class: numbers out of range, NaN
and infinity, empty strings, missing and damaged files and folders, closed stdout), and a
fuzz of every numeric option of every command, read from the CLI itself, so that the next
option added is tried too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from conftest import char_tokenizer, isolated_env, save_model_folder, tiny_llama
from published_layouts import (
    EAGLE3_SHAPES,
    dims,
    draft_ids_with_gaps,
    random_tensors,
    write_eagle3,
    write_medusa,
    medusa_tensors,
)
from test_models_registry import write_tiny_gguf

REPO = Path(__file__).resolve().parents[1]
EXIT_USAGE, EXIT_FAILURE = 2, 1


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """Models, heads and prompt files, intact and damaged, for the cases to name."""
    root = tmp_path_factory.mktemp("inputs")
    tokenizer = char_tokenizer()
    target = tiny_llama(len(tokenizer), seed=1, layers=8, logit_scale=20.0)
    folder = save_model_folder(target, tokenizer, root / "target")
    sizes = dims(target.config)

    shapes = {k: v for k, v in EAGLE3_SHAPES.items() if k not in ("d2t", "t2d")}
    eagle3 = write_eagle3(
        root / "eagle3",
        target.config,
        random_tensors(shapes, {**sizes, "W": 40}, 5),
        draft_ids_with_gaps(target.config.vocab_size, 40),
        fmt="safetensors",
    )
    weights = eagle3 / "model.safetensors"
    truncated = root / "eagle3-truncated"
    truncated.mkdir()
    (truncated / "config.json").write_bytes((eagle3 / "config.json").read_bytes())
    (truncated / "model.safetensors").write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    random_bytes = root / "eagle3-random"
    random_bytes.mkdir()
    (random_bytes / "config.json").write_bytes((eagle3 / "config.json").read_bytes())
    (random_bytes / "model.safetensors").write_bytes(os.urandom(weights.stat().st_size))
    medusa = write_medusa(root / "medusa-random", medusa_tensors(sizes, 2, 1, 3), 2, 1, fmt="safetensors")
    (medusa / "medusa_lm_head.safetensors").write_bytes(os.urandom(4096))
    eagle_header = root / "eagle-bad-header"
    eagle_header.mkdir()
    (eagle_header / "config.json").write_bytes((eagle3 / "config.json").read_bytes())
    (eagle_header / "model.safetensors").write_bytes(
        b"\x20\x00\x00\x00\x00\x00\x00\x00" + b"{not a header" + bytes(100)
    )
    bad_json_model = root / "bad-json-model"
    save_model_folder(target, tokenizer, bad_json_model)
    (bad_json_model / "config.json").write_text("{not json")

    prompts = root / "prompts.txt"
    prompts.write_text("hello\n")
    (root / "empty.txt").write_text("")
    (root / "bad.jsonl").write_text('{"prompt": "x"}\n{not json\n')
    gguf = root / "tiny.F32.gguf"
    write_tiny_gguf(gguf)
    return {
        "target": str(folder),
        "eagle3_truncated": str(truncated),
        "eagle3_random": str(random_bytes),
        "medusa_random": str(medusa),
        "eagle_bad_header": str(eagle_header),
        "bad_json_model": str(bad_json_model),
        "prompts": str(prompts),
        "empty": str(root / "empty.txt"),
        "bad_jsonl": str(root / "bad.jsonl"),
        "missing": str(root / "nothing-here"),
        "gguf": str(gguf),
    }


def specgen(args: list[str], home: Path, stdout_closed: bool = False) -> subprocess.CompletedProcess:
    """The real entry point in a new process; `stdout_closed`: started with standard output closed (`>&-`)."""
    return subprocess.run(
        [sys.executable, "-m", "speccli.cli", *args],
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        stdout=None if stdout_closed else subprocess.PIPE,
        cwd=REPO,
        env=isolated_env(home),
        timeout=300,
        preexec_fn=(lambda: os.close(1)) if stdout_closed else None,
    )


def assert_one_line(result: subprocess.CompletedProcess, code: int, words: str) -> None:
    stderr = result.stderr.decode(errors="replace")
    assert result.returncode == code, stderr
    assert "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr
    assert words in stderr, stderr
    assert len([line for line in stderr.splitlines() if line.startswith("hint:")]) <= 1


TINY = ["--target", "{target}", "--device", "cpu", "--dtype", "float32"]

# (command line with {placeholders} from `files`, exit code, words on stderr)
CASES = [
    # Numbers out of range, NaN and infinity
    (["generate", "x", *TINY, "--temperature", "nan"], EXIT_USAGE, "temperature must be a finite number"),
    (["generate", "x", *TINY, "--temperature", "inf"], EXIT_USAGE, "temperature must be a finite number"),
    (["generate", "x", *TINY, "--top-p", "nan"], EXIT_USAGE, "top_p must be in (0, 1]"),
    (["generate", "x", *TINY, "--seed", str(1 << 70)], EXIT_USAGE, "seed must fit in 64 bits"),
    (["generate", "x", *TINY, "--tp", "0"], EXIT_USAGE, "Invalid value for '--tp'"),
    (["generate", "x", *TINY, "--tree", "--no-tree"], EXIT_USAGE, "--tree and --no-tree contradict each other"),
    (["bench", "{prompts}", *TINY, "--no-tree", "--tree"], EXIT_USAGE, "--tree and --no-tree contradict each other"),
    (["chat", *TINY, "--tree", "--no-tree"], EXIT_USAGE, "--tree and --no-tree contradict each other"),
    (["generate", "x", *TINY, "-n", "-3"], EXIT_USAGE, "max_new_tokens must be >= 1"),
    (["chat", *TINY, "--temperature", "nan"], EXIT_USAGE, "temperature must be a finite number"),
    (["bench", "{prompts}", *TINY, "--draft", "ngram", "--top-p", "2"], EXIT_USAGE, "top_p must be in (0, 1]"),
    (["bench", "{prompts}", *TINY, "--draft", "ngram", "--repeat", "0"], EXIT_USAGE, "repeat"),
    (["plan", "--target", "{target}", "--gpu-memory", "-5"], EXIT_USAGE, "--gpu-memory must be a positive number"),
    (["plan", "--target", "{target}", "--gpu-memory", "0"], EXIT_USAGE, "--gpu-memory must be a positive number"),
    (["plan", "--target", "{target}", "--gpu-memory", "nan"], EXIT_USAGE, "--gpu-memory must be a positive number"),
    (["plan", "--target", "{target}", "--max-context", "0"], EXIT_USAGE, "Invalid value for '--max-context'"),
    (["train", "medusa", "--target", "{target}", "--epochs", "nan"], EXIT_USAGE, "--epochs must be a positive number"),
    (["train", "medusa", "--target", "{target}", "--lr", "-1"], EXIT_USAGE, "--lr must be a positive number"),
    (["train", "medusa", "--target", "{target}", "--tokens", "0"], EXIT_USAGE, "--tokens must be at least 1"),
    (["serve", *TINY, "--port", "70000"], EXIT_USAGE, "--port must lie in 0..65535"),
    (["serve", *TINY, "--max-queue", "-1"], EXIT_USAGE, "Invalid value for '--max-queue'"),
    # Splits that cannot work: refused before any process starts
    (["generate", "x", *TINY, "--tp", "3", "--quant", "none"], EXIT_USAGE, "hint: use --tp 2"),
    (
        ["generate", "x", *TINY, "--tp", "2", "--backend", "llama.cpp"],
        EXIT_USAGE,
        "the llama.cpp backend runs it whole",
    ),
    (
        ["plan", "--target", "llama3-70b", "--tp", "3", "--quant", "none", "--gpu-memory", "80"],
        EXIT_USAGE,
        "hint: use --tp 2 or 4 or 8",
    ),
    (
        ["plan", "--target", "llama3-70b", "--tp", "1000", "--quant", "none", "--gpu-memory", "80"],
        EXIT_USAGE,
        "cannot split llama3-70b",
    ),
    (
        ["plan", "--target", "llama3-70b", "--tp", "4", "--quant", "4bit", "--gpu-memory", "80"],
        EXIT_USAGE,
        "`generate --tp` refuses --quant 4bit",
    ),
    # Empty strings
    (["generate", "x", "--target", "", "--device", "cpu"], EXIT_USAGE, "--target is empty"),
    (["generate", "x", *TINY, "--draft", " "], EXIT_USAGE, "--draft is empty"),
    (["generate", "x", *TINY, "--draft", "auto+bogus"], EXIT_USAGE, "after '+' come drafters that need no model"),
    (["generate", "x", *TINY, "--draft", "auto+"], EXIT_USAGE, "after '+' come drafters that need no model"),
    (["generate", "x", *TINY, "--draft", "ngram+ngram"], EXIT_USAGE, "before '+' comes a draft model or heads"),
    (["bench", "{prompts}", *TINY, "--draft", "none+ngram"], EXIT_USAGE, "before '+' comes a draft model or heads"),
    (["generate", "x", *TINY, "--draft", "suffix+ngram"], EXIT_USAGE, "before '+' comes a draft model or heads"),
    (
        ["bench", "{prompts}", *TINY, "--draft", "lookahead+suffix"],
        EXIT_USAGE,
        "before '+' comes a draft model or heads",
    ),
    (["generate", "x", *TINY, "--stop", ""], EXIT_USAGE, "stop strings must not be empty"),
    (["generate", "x", *TINY, "--device", ""], EXIT_USAGE, "device must be one of"),
    (["generate", "x", "--server", ""], EXIT_USAGE, "--server is empty"),
    (["generate", "x", "--server", "ftp://host"], EXIT_USAGE, "http:// or https://"),
    (["generate", ""], EXIT_USAGE, "the prompt is empty"),
    (["plan", "--target", ""], EXIT_USAGE, "--target is empty"),
    (["train", "medusa", "--target", ""], EXIT_USAGE, "--target is empty"),
    (["models", "--remove-converted", ""], EXIT_USAGE, "--remove-converted is empty"),
    (["models", "--drafts-for", ""], EXIT_USAGE, "--drafts-for is empty"),
    (["serve", *TINY, "--api-key", ""], EXIT_USAGE, "--api-key is empty"),
    (["serve", *TINY, "--model-name", ""], EXIT_USAGE, "--model-name is empty"),
    (["serve", *TINY, "--host", ""], EXIT_USAGE, "cannot resolve --host"),
    # Missing and damaged files and folders
    (["generate", "x", "--target", "{missing}"], EXIT_USAGE, "error:"),
    (["generate", "x", "--target", "{bad_json_model}", "--device", "cpu"], EXIT_USAGE, "error:"),
    (["generate", "x", *TINY, "--draft", "eagle3:{eagle3_truncated}"], EXIT_USAGE, "cannot be read as safetensors"),
    (["generate", "x", *TINY, "--draft", "eagle3:{eagle3_random}"], EXIT_USAGE, "cannot be read as safetensors"),
    (["generate", "x", *TINY, "--draft", "eagle:{eagle_bad_header}"], EXIT_USAGE, "cannot be read as safetensors"),
    (["generate", "x", *TINY, "--draft", "medusa:{medusa_random}"], EXIT_USAGE, "cannot be read as safetensors"),
    (["generate", "x", *TINY, "--draft", "eagle3:{missing}"], EXIT_USAGE, "error:"),
    (["bench", "{missing}", *TINY], EXIT_USAGE, "prompt file not found"),
    (["bench", "{empty}", *TINY], EXIT_USAGE, "error:"),
    (["bench", "{bad_jsonl}", *TINY], EXIT_USAGE, "error:"),
    (["train", "medusa", "--target", "{target}", "--data", "{missing}", "--device", "cpu"], EXIT_USAGE, "error:"),
    # Words the commands do not know
    (["train", "nonsense"], EXIT_USAGE, "unknown kind of heads"),
    (["generate", "x", *TINY, "--nope"], EXIT_USAGE, "No such option: --nope"),
    (["bench", "{prompts}", *TINY, "--format", "yaml"], EXIT_USAGE, "--format must be one of"),
    (["plan", "--target", "{target}", "--quant", "3bit"], EXIT_USAGE, "--quant takes"),
]


@pytest.mark.parametrize("args, code, words", CASES, ids=[" ".join(c[0])[:60] for c in CASES])
def test_bad_input_is_one_line_with_its_exit_code(files, tmp_path, args, code, words):
    result = specgen([a.format(**files) for a in args], tmp_path)
    assert_one_line(result, code, words)
    assert result.stdout == b""


@pytest.mark.parametrize(
    "args",
    [
        ["models", "--json"],
        ["heads", "--json"],
        ["plan", "--target", "{target}", "--gpu-memory", "80"],
        ["generate", "x", *TINY, "--draft", "none", "-n", "2"],
        ["--help"],
    ],
)
def test_a_closed_stdout_is_a_runtime_failure_said_in_one_line(files, tmp_path, args):
    result = specgen([a.format(**files) for a in args], tmp_path, stdout_closed=True)
    assert_one_line(result, EXIT_FAILURE, "standard output is closed")


def gguf_generate(files, prompt: str, tokens: int) -> list[str]:
    """`generate` over the tiny GGUF through transformers: its first start keeps a converted entry."""
    return [
        "generate",
        prompt,
        "--target",
        files["gguf"],
        "--draft",
        "none",
        "--device",
        "cpu",
        "-n",
        str(tokens),
        "--backend",
        "transformers",
    ]


def test_a_failed_remove_removes_nothing(files, tmp_path):
    """`models --remove-converted ""` once removed every entry: a forgotten $NAME in a script."""
    first = specgen(gguf_generate(files, "x", 1), tmp_path)
    assert first.returncode == 0, first.stderr.decode()
    listed = specgen(["models", "--converted", "--json"], tmp_path)
    assert len(json.loads(listed.stdout)) == 1
    for name in ("", "  "):
        assert specgen(["models", "--remove-converted", name], tmp_path).returncode == EXIT_USAGE
    assert specgen(["models", "--converted", "--json"], tmp_path).stdout == listed.stdout


@pytest.mark.parametrize("damage", ["same-size", "header", "config-json"])
def test_a_damaged_converted_entry_is_converted_again_with_one_line(files, tmp_path, damage):
    args = gguf_generate(files, "abc", 4)
    first = specgen(args, tmp_path)
    assert first.returncode == 0, first.stderr.decode()
    (entry,) = (tmp_path / "specgen-cache" / "converted").iterdir()
    weights = entry / "model.safetensors"
    if damage == "same-size":
        with weights.open("r+b") as handle:
            handle.seek(weights.stat().st_size // 2)
            handle.write(os.urandom(4096))
    elif damage == "header":
        with weights.open("r+b") as handle:
            handle.seek(8)
            handle.write(b"}}}}")
    else:
        config = entry / "config.json"
        config.write_text("[" + config.read_text()[1:])
    again = specgen(args, tmp_path)
    stderr = again.stderr.decode()
    assert again.returncode == 0 and "Traceback" not in stderr
    assert stderr.count("were damaged") == 1 and "converting again" in stderr
    assert again.stdout == first.stdout


# ---------------------------------------------------------------------------------------------
# Every numeric option of every command, read from the CLI: the next one added is tried too.


def numeric_options() -> list[tuple[str, str]]:
    from speccli.cli import app

    group = typer.main.get_command(app)
    found = []
    for name, command in sorted(group.commands.items()):
        for param in command.params:
            kind = type(param.type).__name__
            if param.param_type_name == "option" and kind in (
                "IntParamType",
                "FloatParamType",
                "IntRange",
                "FloatRange",
            ):
                found.append((name, max(param.opts, key=len)))
    return found


# What each command needs before its options are checked (a prompt, a prompt file, a kind).
LEADING = {"generate": ["x"], "bench": ["{prompts}", "--draft", "ngram"], "train": ["medusa"]}
TAKES_TARGET = ("generate", "chat", "bench", "serve", "plan", "train")


def test_the_fuzz_covers_the_numeric_options():
    options = numeric_options()
    assert ("generate", "--temperature") in options and ("serve", "--port") in options
    assert ("plan", "--gpu-memory") in options and ("train", "--epochs") in options
    assert ("generate", "--tp") in options and ("serve", "--max-queue") in options and len(options) > 30


@pytest.mark.parametrize("command, option", numeric_options())
@pytest.mark.parametrize("value", ["nan", "abc", ""])
def test_every_numeric_option_refuses_what_is_not_a_number(files, tmp_path, command, option, value):
    args = [command, *LEADING.get(command, [])]
    if command in TAKES_TARGET:
        args += ["--target", "{target}"]
    if command in ("generate", "chat", "bench", "serve", "train"):
        args += ["--device", "cpu"]
    result = specgen([a.format(**files) for a in [*args, option, value]], tmp_path)
    assert_one_line(result, EXIT_USAGE, "error:")


# ---------------------------------------------------------------------------------------------
# Interrupted runs


def test_an_interrupted_generation_exits_130_with_one_word(tmp_path):
    import signal

    from conftest import ENDLESS_CONTEXT, default_sigint, never_ends, read_first

    tokenizer = char_tokenizer()
    endless = never_ends(tiny_llama(len(tokenizer), seed=1, logit_scale=20.0, max_positions=ENDLESS_CONTEXT))
    folder = save_model_folder(endless, tokenizer, tmp_path / "endless")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "speccli.cli",
            "generate",
            "go",
            "--target",
            str(folder),
            "--draft",
            "ngram",
            "--device",
            "cpu",
            "-n",
            "100000",
            "-q",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
        env=isolated_env(tmp_path),
        bufsize=0,
        preexec_fn=default_sigint,
    )
    first = read_first(process.stdout, 4)
    process.send_signal(signal.SIGINT)
    rest, stderr = process.communicate(timeout=120)
    assert process.returncode == 130
    assert stderr.decode().strip().splitlines()[-1] == "interrupted" and b"Traceback" not in stderr
    assert len(first + rest) >= 4
