"""`specgen bench` and `specgen models` from the command line."""

from __future__ import annotations

import csv
import io
import json
from importlib.metadata import version

import pytest
from typer.testing import CliRunner

from conftest import ON_CPU, char_tokenizer, perturbed_copy, save_model_folder, tiny_llama
from speccli import __version__
from speccli.cli import app

# The commands here run with k auto (calibrating) unless told otherwise: keep it out of ~/.cache.
pytestmark = pytest.mark.usefixtures("private_cache")

runner = CliRunner()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tokenizer = char_tokenizer()
    target = tiny_llama(len(tokenizer), seed=1, logit_scale=20.0)
    draft = perturbed_copy(target, noise=0.3, seed=11)
    root = tmp_path_factory.mktemp("bench-models")
    prompts = root / "prompts.txt"
    prompts.write_text("def fib(n):\nhello world\n\nabcabcabc\n", encoding="utf-8")
    return {
        "target": str(save_model_folder(target, tokenizer, root / "target")),
        "draft": str(save_model_folder(draft, tokenizer, root / "draft")),
        "prompts": str(prompts),
        "root": root,
    }


def bench(folders, *extra: str):
    return runner.invoke(
        app,
        [
            "bench",
            folders["prompts"],
            "--target",
            folders["target"],
            "--draft",
            folders["draft"],
            *ON_CPU,
            "--dtype",
            "float32",
            "-n",
            "12",
            "-q",
            *extra,
        ],
    )


def test_json_report_has_every_prompt_and_k_and_identical_greedy_outputs(folders):
    result = bench(folders, "--k", "1,3", "--format", "json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    rows = report["rows"]
    assert len(rows) == 3 * 2
    assert {row["k"] for row in rows} == {1, 3}
    assert all(row["identical"] and row["error"] is None for row in rows)
    assert "speed-up" in result.stderr  # the headline goes to stderr


def test_csv_and_markdown_reports(folders):
    result = bench(folders, "--format", "csv", "--repeat", "2")
    assert result.exit_code == 0, result.stderr
    table = list(csv.DictReader(io.StringIO(result.stdout)))
    assert len(table) == 3 * 2
    assert "speedup" in table[0]
    result = bench(folders, "--format", "md")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith("| prompt | category | k | plain tok/s | spec tok/s | speed-up |")
    assert "| **all prompts** |" in result.stdout


def test_table_to_file_and_plot(folders):
    out = folders["root"] / "report.txt"
    png = folders["root"] / "plot.png"
    result = bench(folders, "--output", str(out), "--plot", str(png), "--k", "1,2")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == ""
    text = out.read_text(encoding="utf-8")
    assert "prompts:1" in text and "prompts:4" in text and "all prompts" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ngram_draft(folders):
    result = runner.invoke(
        app,
        [
            "bench",
            folders["prompts"],
            "--target",
            folders["target"],
            "--draft",
            "ngram",
            *ON_CPU,
            "--dtype",
            "float32",
            "-n",
            "12",
            "-q",
            "--format",
            "json",
        ],
    )
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["metadata"]["drafter"] == "ngram"


@pytest.mark.parametrize(
    "content, name, message",
    [
        (b"", "empty.txt", "no prompts"),
        (b"ok\n\xff\xfe\n", "bad.txt", "line 2"),
        (b'{"prompt": "a"}\n{nope\n', "bad.jsonl", "line 2"),
        (b"hello", "prompts.csv", ".csv"),
    ],
)
def test_bad_prompt_files_exit_2(folders, tmp_path, content, name, message):
    path = tmp_path / name
    path.write_bytes(content)
    result = runner.invoke(app, ["bench", str(path), "--target", folders["target"], "--draft", "ngram"])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ") and message in result.stderr.splitlines()[0]
    assert result.stdout == ""


def test_missing_prompt_file_and_bad_options(folders, tmp_path):
    result = runner.invoke(app, ["bench", str(tmp_path / "none.txt"), "--draft", "ngram"])
    assert result.exit_code == 2 and str(tmp_path / "none.txt") in result.stderr
    for extra, message in (
        (["--k", "0"], "--k"),
        (["--format", "xml"], "--format"),
        (["--draft", "none"], "needs a draft"),
    ):
        result = runner.invoke(
            app, ["bench", folders["prompts"], "--target", folders["target"], "--draft", "ngram", *extra]
        )
        assert result.exit_code == 2, (extra, result.stderr)
        assert message in result.stderr


def test_models_json_lists_the_default_pair():
    result = runner.invoke(app, ["models", "--json"])
    assert result.exit_code == 0
    listing = {item["alias"]: item for item in json.loads(result.stdout)}
    assert {"qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "llama3-70b", "llama3-8b", "smollm2-135m"} <= set(listing)
    assert listing["llama3-8b"]["resolves_to"] == "meta-llama/Meta-Llama-3-8B-Instruct"


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout == f"specgen {__version__}\n"
    assert __version__ == version("specgen")  # the package's metadata (pyproject.toml)


@pytest.mark.parametrize("command", [[], ["generate"], ["chat"], ["bench"], ["models"], ["train"]])
def test_help_shows_flags_as_flags(command):
    result = runner.invoke(app, [*command, "--help"], terminal_width=120)
    assert result.exit_code == 0
    assert "--help" in result.stdout and "<bool>" not in result.stdout
