"""`specgen generate` as a black box: what lands on stdout and stderr, and exit codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from conftest import (
    ENDLESS_CONTEXT,
    ON_CPU,
    char_tokenizer,
    default_sigint,
    isolated_env,
    never_ends,
    perturbed_copy,
    read_first,
    save_model_folder,
    tiny_llama,
)
from speccli.cli import app

# The commands here run with k auto (calibrating) unless told otherwise: keep it out of ~/.cache.
pytestmark = pytest.mark.usefixtures("private_cache")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tokenizer = char_tokenizer()
    target = tiny_llama(len(tokenizer), seed=1, logit_scale=20.0, max_positions=4096)
    draft = perturbed_copy(target, noise=0.3, seed=11)
    root = tmp_path_factory.mktemp("models")
    return {
        "tokenizer": tokenizer,
        "target_model": target,
        "target": str(save_model_folder(target, tokenizer, root / "target")),
        "draft": str(save_model_folder(draft, tokenizer, root / "draft")),
    }


@pytest.fixture(scope="module")
def endless(tmp_path_factory):
    """A target whose greedy text never ends by </s>, one character a token, in a context
    longer than any pipe holds unread."""
    tokenizer = char_tokenizer()
    target = never_ends(tiny_llama(len(tokenizer), seed=1, logit_scale=20.0, max_positions=ENDLESS_CONTEXT))
    folder = save_model_folder(target, tokenizer, tmp_path_factory.mktemp("endless") / "target")
    return {"tokenizer": tokenizer, "target_model": target, "target": str(folder)}


def reference_text(folders, prompt: str, max_new: int) -> str:
    tokenizer, model = folders["tokenizer"], folders["target_model"]
    ids = tokenizer(prompt)["input_ids"]
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False)
    return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)


def specgen(*args: str, stdin: bytes | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "speccli.cli", *args],
        input=stdin if stdin is not None else b"",
        capture_output=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        timeout=300,
    )


def model_args(folders) -> list[str]:
    # The CPU, as the in-memory reference (quant auto there: none for the target, int8 for the
    # draft); float32: greedy equality with the reference is exact only there.
    return ["--target", folders["target"], "--draft", folders["draft"], *ON_CPU, "--dtype", "float32"]


def test_piped_output_is_exactly_the_targets_greedy_text(folders):
    result = specgen(
        "generate", "def fib(n):", *model_args(folders), "--max-new-tokens", "32", "--temperature", "0", "--stats"
    )
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode() == reference_text(folders, "def fib(n):", 32)
    assert b"\x1b" not in result.stdout
    stderr = result.stderr.decode()
    assert "acceptance" in stderr and "tok/s" in stderr
    assert "Traceback" not in stderr


def test_stdin_comes_first_then_the_argument(folders):
    result = specgen("generate", "world", *model_args(folders), "-n", "16", "-q", stdin=b"hello\n")
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode() == reference_text(folders, "hello\nworld", 16)
    assert result.stderr == b""


def test_json_output(folders):
    result = specgen("generate", "abc", *model_args(folders), "-n", "20", "--json", "-q", "--k", "3")
    assert result.returncode == 0, result.stderr.decode()
    payload = json.loads(result.stdout)
    assert payload["text"] == reference_text(folders, "abc", 20)
    assert len(payload["token_ids"]) == 20 == payload["stats"]["new_tokens"]
    assert [t["id"] for t in payload["tokens"]] == payload["token_ids"]
    assert {t["provenance"] for t in payload["tokens"]} <= {"accepted", "resampled", "bonus", "target"}
    assert payload["finish_reason"] == "length"
    assert payload["settings"]["k"] == 3
    assert sum(payload["stats"]["provenance"].values()) == 20


def test_ctrl_c_keeps_what_was_printed_and_exits_130(endless, tmp_path):
    # Up to 100000 tokens of one character each, more than the pipe holds: once we stop
    # reading, the child blocks on a full pipe long before its answer could end, so the
    # interrupt always lands inside the generation, however late it comes.
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "speccli.cli",
            "generate",
            "hello",
            "--target",
            endless["target"],
            "-n",
            "100000",
            "-q",
            "--draft",
            "none",
            *ON_CPU,
            "--dtype",
            "float32",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
        env=isolated_env(tmp_path),
        bufsize=0,  # unbuffered: reading 8 bytes takes no more from the pipe
        preexec_fn=default_sigint,
    )
    try:
        import fcntl

        fcntl.fcntl(process.stdout.fileno(), fcntl.F_SETPIPE_SZ, 4096)  # the child runs at most a page ahead
    except (ImportError, AttributeError, OSError):
        pass  # not Linux: the default pipe, still far shorter than the answer
    first = read_first(process.stdout, 8)
    process.send_signal(signal.SIGINT)
    rest, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr.decode()
    assert len(first) == 8
    assert (first + rest).decode() == reference_text(endless, "hello", len(first + rest))
    assert b"interrupted" in stderr and b"Traceback" not in stderr


def test_a_reader_that_closes_the_pipe_stops_generation_quietly_with_141(endless, tmp_path):
    # `specgen generate ... | head -c 8`: the child writes into a pipe whose reader is gone.
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "speccli.cli",
            "generate",
            "hello",
            "--target",
            endless["target"],
            "-n",
            "100000",
            "-q",
            "--draft",
            "ngram",
            *ON_CPU,
            "--dtype",
            "float32",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
        env=isolated_env(tmp_path),
        bufsize=0,
    )
    first = read_first(process.stdout, 8)
    process.stdout.close()
    stderr = process.stderr.read()
    assert process.wait(timeout=120) == 141, stderr.decode()
    assert first == reference_text(endless, "hello", 8).encode()
    assert stderr == b""  # no "BrokenPipeError", no traceback


@pytest.mark.parametrize("args", [["--help"], ["generate", "--help"], ["--version"]])
def test_help_and_version_to_a_reader_that_is_gone_exit_141_as_generation_does(args, tmp_path):
    # `specgen --help | head -1`: Rich meets the closed pipe inside Typer and would exit 1.
    process = subprocess.Popen(
        [sys.executable, "-m", "speccli.cli", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
        env=isolated_env(tmp_path),
    )
    process.stdout.close()  # gone before the first write
    stderr = process.stderr.read()
    assert process.wait(timeout=120) == 141, stderr.decode()
    assert stderr == b""


def test_help_to_the_null_device_still_exits_0(tmp_path):
    with open(os.devnull, "w") as null:
        done = subprocess.run(
            [sys.executable, "-m", "speccli.cli", "--help"],
            stdout=null,
            stderr=subprocess.PIPE,
            cwd=REPO,
            env=isolated_env(tmp_path),
            timeout=120,
        )
    assert done.returncode == 0 and done.stderr == b""


runner = CliRunner()


def invoke(args: list[str], stdin: bytes | str = b""):
    return runner.invoke(app, args, input=stdin)


@pytest.mark.parametrize(
    "args, stdin, message",
    [
        (["generate", ""], b"", "error: the prompt is empty"),
        (["generate"], b"   \n", "error: the prompt is empty"),
        (["generate", "hi", "--k", "0"], b"", "error: --k must be a whole number >= 1 or auto, got '0'"),
        (["generate", "hi", "--k", "many"], b"", "error: --k must be a whole number >= 1 or auto, got 'many'"),
        (["generate", "hi", "--temperature", "-1"], b"", "error: temperature must be >= 0, got -1.0"),
        (["generate", "hi", "--top-p", "0"], b"", "error: top_p must be in (0, 1], got 0.0"),
        (["generate", "hi", "-n", "0"], b"", "error: max_new_tokens must be >= 1, got 0"),
        (
            ["generate", "hi", "--dtype", "float8"],
            b"",
            "error: dtype must be one of auto, float32, bfloat16, float16, got 'float8'",
        ),
        (["generate", "hi", "--cpu-linear", "mkl"], b"", "error: cpu_linear must be one of auto, stock, got 'mkl'"),
        (["generate"], b"caf\xe9\n", "error: standard input is not valid UTF-8 (byte 3)"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(folders, args, stdin, message):
    result = invoke(args[:1] + model_args(folders) + args[1:], stdin)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert result.stderr.splitlines()[0] == message
    assert "Traceback" not in result.stderr


def test_unknown_model_is_refused_with_a_hint(folders):
    result = invoke(["generate", "hi", "--target", "no-such-model-xyz", "--draft", "ngram"])
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.startswith("error: ")
    assert "hint: " in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_folder_is_refused(tmp_path):
    result = invoke(["generate", "hi", "--target", str(tmp_path / "nope"), "--draft", "ngram"])
    assert result.exit_code == 2
    assert str(tmp_path / "nope") in result.stderr


def test_ngram_and_plain_drafts_give_the_same_greedy_text(folders):
    expected = reference_text(folders, "abcabc", 24)
    for draft in ("ngram", "none"):
        result = invoke(
            [
                "generate",
                "abcabc",
                "--target",
                folders["target"],
                "--draft",
                draft,
                "-n",
                "24",
                "-q",
                *ON_CPU,
                "--dtype",
                "float32",
            ]
        )
        assert result.exit_code == 0, result.stderr
        assert result.stdout == expected


def test_a_prompt_longer_than_the_context_is_bad_input(folders):
    result = invoke(["generate", "x" * 5000, "-q"] + model_args(folders))
    assert result.exit_code == 2
    assert result.stderr.startswith(
        f"error: the prompt is 5000 tokens long and {folders['target']}'s context holds 4096"
    )
    assert "hint: shorten the prompt" in result.stderr


def test_help_explains_the_options():
    result = invoke(["generate", "--help"])
    assert result.exit_code == 0
    for option in ("--target", "--draft", "--k", "--temperature", "--json", "--stats", "ngram"):
        assert option in result.stdout
    # Rich reads "[word]" as markup: the extra's name must survive it.
    assert '"specgen[llamacpp]"' in result.stdout


def test_auto_k_calibrates_once_per_pair_and_recalibrates_on_request(folders, tmp_path):
    env = {"SPECGEN_CACHE": str(tmp_path)}
    args = ("generate", "abc", *model_args(folders), "-n", "8")
    first = specgen(*args, env=env)
    assert first.returncode == 0, first.stderr.decode()
    assert "calibrating: timing target passes over 1, 2, 4, 8, 17 tokens and one draft token" in first.stderr.decode()
    assert len(list((tmp_path / "calibration").glob("*.json"))) == 1
    second = specgen(*args, env=env)
    assert second.returncode == 0 and "calibrat" not in second.stderr.decode()
    assert second.stdout == first.stdout == reference_text(folders, "abc", 8).encode()
    third = specgen(*args, "--recalibrate", env=env)
    assert "calibrating: timing target passes over 1-17 tokens and one draft token in 8 rounds" in third.stderr.decode()
    assert "calibrated in" in third.stderr.decode()
    fixed = specgen(*args, "--k", "3", "--recalibrate", env=env)  # a fixed k needs no costs
    assert fixed.returncode == 0 and "calibrat" not in fixed.stderr.decode()


def test_the_draft_is_int8_on_the_cpu_unless_told_otherwise(folders, tmp_path):
    env = {"SPECGEN_CACHE": str(tmp_path)}
    base = ("generate", "abc", *model_args(folders), "-n", "8", "--json", "-q", "--k", "2")
    quantized = json.loads(specgen(*base, env=env).stdout)
    plain = json.loads(specgen(*base, "--draft-quant", "none", env=env).stdout)
    assert quantized["text"] == plain["text"] == reference_text(folders, "abc", 8)
    assert (quantized["settings"]["draft_quant"], plain["settings"]["draft_quant"]) == ("int8", "none")
    assert (quantized["settings"]["linear"], plain["settings"]["linear"]) == ("onednn", "onednn")
    stock = json.loads(specgen(*base, "--cpu-linear", "stock", env=env).stdout)
    assert stock["settings"]["linear"] == "stock" and stock["text"] == quantized["text"]
    bad = specgen(*base, "--draft-quant", "int8", "--draft-dtype", "bfloat16", env=env)
    assert bad.returncode == 2
    assert "computes in float32 around int8 weights, not in bfloat16" in bad.stderr.decode()
