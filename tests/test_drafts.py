"""`--draft auto` and `specgen models --drafts-for` (speccli.models.pairs.drafts): the registry picks,
with no network and no weights."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from speccli.cli import app
from speccli.models.pairs.drafts import DraftChoice, choose_draft, drafts_for, trained_heads
from speccli.models.names.registry import DEFAULT_DRAFT, DEFAULT_TARGET


@pytest.mark.parametrize(
    "target, draft",
    [
        ("llama3-70b", "llama3-8b"),  # the tool's own example pair
        ("meta-llama/Meta-Llama-3-70B-Instruct", "llama3-8b"),  # by Hub id
        ("llama3.1-8b", "llama3.2-1b"),  # nothing smaller in its family: the same tokenizer's smallest
        ("qwen2.5-7b", "qwen2.5-0.5b"),
        (DEFAULT_TARGET, DEFAULT_DRAFT),  # the offline pair
        ("someone/unknown-7b", "ngram"),
        ("llama3.2-1b", "ngram"),  # the smallest of its tokenizer
    ],
)
def test_auto_picks_from_the_registry(target, draft):
    assert choose_draft(target).name == draft


@pytest.mark.parametrize(
    "target, draft",
    [
        ("llama3.1-8b", "eagle3:yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"),  # its registered EAGLE-3 head
        ("llama3-70b", "eagle:yuhuili/EAGLE-LLaMA3-Instruct-70B"),  # EAGLE-1/2 where no EAGLE-3 head is registered
        ("llama3.3-70b", "eagle3:yuhuili/EAGLE3-LLaMA3.3-Instruct-70B"),
        ("qwen3-8b", "eagle3:AngelSlim/Qwen3-8B_eagle3"),
        ("vicuna-7b", "medusa:FasterDecoding/medusa-vicuna-7b-v1.3"),
        ("llama3.1-70b", "llama3.1-8b"),  # no head registered: the same-family model
        ("qwen2.5-7b", "qwen2.5-0.5b"),
        (DEFAULT_TARGET, DEFAULT_DRAFT),
        ("someone/unknown-7b", "ngram"),
    ],
)
def test_auto_on_cuda_takes_a_registered_published_head_first(target, draft):
    assert choose_draft(target, cuda=True).name == draft


def test_the_reason_is_said():
    assert choose_draft("llama3-70b").reason == "the smallest registered model of its family (8B)"
    assert "not in specgen's registry" in choose_draft("./my-model").reason


def test_drafts_for_lists_models_heads_and_drafters(tmp_path):
    from speccli.models.names.offline import default_heads_path

    heads = default_heads_path(tmp_path, "llama3.1-70b", "eagle")
    heads.parent.mkdir(parents=True)
    heads.write_bytes(b"")
    options = drafts_for("llama3.1-70b", tmp_path)
    assert [o.name for o in options] == [
        "llama3.1-8b",
        "llama3.2-1b",
        "llama3.2-3b",
        "llama3-8b",
        "smollm2-135m",
        "qwen2.5-0.5b",
        "qwen3-0.6b",
        "vicuna-7b",
        "eagle",
        "ngram",
        "suffix",
        "lookahead",
    ]
    assert {o.kind for o in options if o.name in ("smollm2-135m", "vicuna-7b")} == {"model (other tokenizer)"}
    # Suffix drafting takes turns with the draft auto picks.
    assert [o.name for o in options if o.auto] == ["llama3.1-8b", "suffix"]
    assert [o.name for o in options if o.auto_cuda] == ["llama3.1-8b", "suffix"]


def test_drafts_for_lists_the_published_heads_first():
    options = drafts_for("llama3.1-8b")
    heads = [o for o in options if o.kind == "published head"]
    assert [o.name for o in heads] == [
        "eagle3:yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
        "eagle3:lmsys/SGLang-EAGLE3-Llama-3.1-8B-Instruct-SpecForge",
        "eagle3:RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3",
        "eagle:yuhuili/EAGLE-LLaMA3.1-Instruct-8B",
    ]
    assert options[: len(heads)] == heads
    assert "about 1/32 of the target's; published acceptance about 6 at temperature 0" in heads[0].about
    assert [o.name for o in options if o.auto_cuda] == [heads[0].name, "suffix"]
    assert [o.name for o in options if o.auto] == ["llama3.2-1b", "suffix"]


def test_models_drafts_for_in_json_and_as_a_table(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path))
    listed = CliRunner().invoke(app, ["models", "--drafts-for", "qwen2.5-7b", "--json"])
    assert listed.exit_code == 0
    items = json.loads(listed.stdout)
    assert items[0] == {
        "name": "qwen2.5-0.5b",
        "kind": "model",
        "about": "Qwen2.5 0.5B Instruct, 0.5B (same family)",
        "auto": True,
        "auto_cuda": True,
    }
    table = CliRunner().invoke(app, ["models", "--drafts-for", "someone/unknown-7b"])
    assert "--draft auto: someone/unknown-7b is not in specgen's registry" in table.stdout


def test_generate_says_what_auto_chose(tmp_path, tokenizer, monkeypatch):
    from conftest import save_model_folder, tiny_llama

    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path))
    folder = save_model_folder(tiny_llama(len(tokenizer), seed=1), tokenizer, tmp_path / "mine")
    result = CliRunner().invoke(
        app, ["generate", "abc", "--target", str(folder), "--device", "cpu", "--dtype", "float32", "-n", "4"]
    )
    assert result.exit_code == 0, result.stderr
    assert f"draft: ngram (--draft auto: {folder} is not in specgen's registry" in result.stderr


def test_models_lists_each_aliases_published_heads(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path))
    listed = CliRunner().invoke(app, ["models", "--json"])
    assert listed.exit_code == 0
    heads = {row["alias"]: row["published_heads"] for row in json.loads(listed.stdout)}
    assert heads["llama3.1-8b"][0] == "eagle3:yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
    assert heads["vicuna-13b"] == ["medusa:FasterDecoding/medusa-vicuna-13b-v1.3"]
    assert heads[DEFAULT_TARGET] == []
    table = CliRunner().invoke(app, ["models"])
    row = next(line for line in table.stdout.splitlines() if line.startswith("│ llama3.1-8b "))
    assert row.rstrip(" │").endswith("eagle3, eagle")


def test_a_draft_of_another_tokenizer_is_autos_only_where_none_shares_it_and_it_measured_paying():
    # qwen2.5-0.5b is the smallest of its tokenizer: no draft shares it.
    assert choose_draft("qwen2.5-0.5b").name == "ngram"
    assert choose_draft("qwen2.5-0.5b", measured={"smollm2-135m": 1.05}).name == "ngram"
    choice = choose_draft("qwen2.5-0.5b", measured={"smollm2-135m": 1.3, "qwen3-0.6b": 1.2})
    assert choice.name == "smollm2-135m"
    assert choice.reason == (
        "no registered model shares qwen2.5-0.5b's tokenizer; smollm2-135m (another tokenizer, drafting by text)"
        " measured 1.30x plain decoding's rate here"
    )
    assert choose_draft("qwen2.5-0.5b", measured={"llama3-8b": 2.0}).name == "ngram"  # not smaller
    # Where a draft shares the tokenizer, it stays auto's choice whatever was measured.
    assert choose_draft("qwen2.5-7b", measured={"smollm2-135m": 3.0}).name == "qwen2.5-0.5b"
    options = drafts_for("qwen2.5-0.5b", measured={"smollm2-135m": 1.3}, shares={"smollm2-135m": 0.258})
    smol = next(o for o in options if o.name == "smollm2-135m")
    assert smol.auto and smol.kind == "model (other tokenizer)"
    assert smol.about.endswith("drafts by text (26% of the target's tokens spelled alike; measured 1.30x plain here)")


def _saved_prior(cache, name: str, target: str, draft, hardware: str, methods: dict) -> None:
    folder = cache / "calibration" / "acceptance"
    folder.mkdir(parents=True, exist_ok=True)
    identity = {"target": {"name": target}, "draft": draft, "hardware": hardware}
    (folder / name).write_text(json.dumps({"identity": identity, "acceptance": [0.5], "steps": 3, "methods": methods}))


def test_measured_draft_gains_read_the_saved_priors_of_this_target_on_this_machine(tmp_path):
    from speccli.calibration import measured_draft_gains

    from speccli.models.loading import cpu_name

    here = cpu_name()
    chain, tree = {"gain": 1.2, "steps": 9}, {"gain": 1.4, "steps": 9}
    _saved_prior(tmp_path, "a.json", "qwen2.5-0.5b", {"name": "smollm2-135m"}, here, {"model chain": chain})
    _saved_prior(tmp_path, "b.json", "qwen2.5-0.5b", {"name": "smollm2-135m"}, here, {"model tree": tree})
    _saved_prior(tmp_path, "c.json", "qwen2.5-0.5b", {"name": "qwen3-0.6b"}, "Other CPU", {"model chain": tree})
    _saved_prior(tmp_path, "d.json", "qwen2.5-7b", {"name": "qwen3-0.6b"}, here, {"model chain": tree})
    _saved_prior(tmp_path, "e.json", "qwen2.5-0.5b", "ngram", here, {"ngram chain": tree})
    _saved_prior(tmp_path, "f.json", "qwen2.5-0.5b", {"name": "smollm2-360m"}, here, {"ngram chain": tree})
    (tmp_path / "calibration" / "acceptance" / "g.json").write_text("{not json")
    assert measured_draft_gains("qwen2.5-0.5b", tmp_path) == {"smollm2-135m": 1.4, "ngram": 1.4}


def test_lookahead_is_autos_where_it_measured_paying_and_more_than_the_choice_before_it():
    assert choose_draft("./my-model", measured={"lookahead": 1.05}).name == "ngram"
    choice = choose_draft("./my-model", measured={"lookahead": 1.4})
    assert choice == DraftChoice("lookahead", "lookahead decoding measured 1.40x plain decoding's rate here")
    assert choose_draft("./my-model", measured={"lookahead": 1.4, "ngram": 1.6}).name == "ngram"
    assert choose_draft("qwen2.5-7b", measured={"lookahead": 1.8}).name == "qwen2.5-0.5b"  # the draft: not measured
    assert choose_draft("qwen2.5-7b", measured={"lookahead": 2.6, "qwen2.5-0.5b": 2.4}).name == "lookahead"
    options = drafts_for("./my-model", measured={"lookahead": 1.4})
    assert next(o for o in options if o.name == "lookahead").auto
    assert not next(o for o in options if o.name == "suffix").auto  # lookahead takes no turns with suffix drafting


def test_heads_trained_here_are_autos_where_they_measured_more_than_its_draft():
    target = "qwen2.5-7b"  # the draft auto takes otherwise: qwen2.5-0.5b
    assert choose_draft(target, measured={"eagle": 3.0}).name == "qwen2.5-0.5b"  # none trained here
    # Trained, but the draft model was never measured here: it keeps its place.
    assert choose_draft(target, measured={"eagle": 3.0}, trained=["eagle"]).name == "qwen2.5-0.5b"
    measured = {"qwen2.5-0.5b": 2.1, "eagle": 2.4, "medusa": 2.2}
    choice = choose_draft(target, measured=measured, trained=["medusa", "eagle"])
    assert choice == DraftChoice(
        "eagle", "the eagle heads trained here measured 2.40x plain decoding's rate here (qwen2.5-0.5b: 2.10x)"
    )
    assert choose_draft(target, measured={**measured, "eagle": 2.0}, trained=["eagle"]).name == "qwen2.5-0.5b"
    # Where no draft model serves the target: heads that pay, else prompt lookup.
    assert choose_draft("./my-model", measured={"medusa": 1.05}, trained=["medusa"]).name == "ngram"
    assert choose_draft("./my-model", measured={"medusa": 1.5}, trained=["medusa"]).name == "medusa"
    # Published heads stay first on CUDA.
    assert choose_draft("llama3.1-8b", cuda=True, measured={"eagle": 9.0}, trained=["eagle"]).name.startswith("eagle3:")


def test_drafts_for_marks_trained_heads_that_auto_takes(tmp_path):
    from speccli.models.names.offline import default_heads_path

    path = default_heads_path(tmp_path, "qwen2.5-7b", "eagle")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    assert trained_heads("qwen2.5-7b", tmp_path) == ["eagle"] and trained_heads("qwen2.5-3b", tmp_path) == []
    options = drafts_for("qwen2.5-7b", tmp_path, measured={"qwen2.5-0.5b": 2.0, "eagle": 2.5})
    eagle = next(o for o in options if o.name == "eagle")
    assert eagle.auto and eagle.kind == "heads" and eagle.about.endswith("; measured 2.50x plain here)")
    assert not next(o for o in options if o.name == "qwen2.5-0.5b").auto


def test_measured_draft_gains_count_heads_trained_here_by_their_kind(tmp_path):
    from speccli.calibration import measured_draft_gains
    from speccli.models.loading import cpu_name

    here = cpu_name()
    _saved_prior(tmp_path, "a.json", "qwen2.5-7b", "eagle", here, {"eagle tree": {"gain": 2.5, "steps": 9}})
    taking_turns = {"medusa chain": {"gain": 1.7, "steps": 9}, "suffix chain": {"gain": 4.0, "steps": 9}}
    _saved_prior(tmp_path, "b.json", "qwen2.5-7b", "medusa+suffix", here, taking_turns)
    _saved_prior(tmp_path, "c.json", "qwen2.5-7b", "lookahead", here, {"lookahead": {"gain": 1.3, "steps": 9}})
    assert measured_draft_gains("qwen2.5-7b", tmp_path) == {"eagle": 2.5, "medusa": 1.7, "lookahead": 1.3}
