"""The shapes registered for every alias (speccli.models.names.shapes): what `specgen models` and
`specgen plan` size a model by when its config is not on this machine, without the network."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from speccli.cli import app
from speccli.models.memory.plan import WEIGHT_FORMATS, memory_need, meta_model, weight_sizes
from speccli.models.names.registry import ALIASES
from speccli.models.names.shapes import SHAPES, shape_config

DATA = Path(__file__).parent / "data"
FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "tie_word_embeddings",
    "max_position_embeddings",
)


@pytest.fixture
def no_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))


def test_every_alias_has_its_shapes():
    assert sorted(a.hub_id for a in ALIASES.values() if a.hub_id not in SHAPES) == []


@pytest.mark.parametrize(
    "folder, hub_id",
    [("llama3-70b", "meta-llama/Meta-Llama-3-70B-Instruct"), ("llama3-8b", "meta-llama/Meta-Llama-3-8B-Instruct")],
)
def test_the_shapes_are_the_hubs_config(folder, hub_id):
    """tests/data holds the Hub's config.json of both (see test_plan.py)."""
    hub = json.loads((DATA / folder / "config.json").read_text())
    registered = shape_config(hub_id)
    assert {f: getattr(registered, f) for f in FIELDS} == {f: hub[f] for f in FIELDS}


def test_the_offline_packages_shapes_are_their_files():
    """The GGUF headers of the installed offline packages give the same shapes."""
    from speccli.models.names import offline
    from speccli.models.memory.plan import _local_config

    checked = 0
    for alias in ALIASES.values():
        package = offline.OFFLINE_MODELS.get(alias.offline) if alias.offline else None
        if package is None or offline.installed_parts(package) is None:
            continue
        local = _local_config(alias.name, offline.default_cache_dir())
        if local is None:  # a chunked package not assembled yet
            continue
        registered = shape_config(alias.hub_id)
        for field in FIELDS[:6]:
            assert getattr(local, field) == getattr(registered, field), (alias.name, field)
        checked += 1
    if not checked:
        pytest.skip("no offline package is installed and assembled here")


@pytest.mark.parametrize(
    "alias", ["llama3-70b", "llama3.2-1b", "qwen2.5-7b", "qwen3-32b", "vicuna-33b", "smollm2-135m"]
)
def test_sizes_from_two_layers_equal_the_whole_models(alias, tmp_path, no_hub):
    """`specgen models` counts one and two layers and extrapolates: the same bytes as the whole
    meta model, in every format."""
    whole = meta_model(shape_config(ALIASES[alias].hub_id))
    exact = {name: round(memory_need(whole, quant, torch.bfloat16).weights) for name, quant in WEIGHT_FORMATS}
    assert weight_sizes(alias, tmp_path) == exact


def test_plan_sizes_a_registered_pair_without_the_network(no_hub):
    result = CliRunner().invoke(
        app,
        ["plan", "--target", "llama3-70b", "--draft", "llama3-8b", "--quant", "none", "--gpu-memory", "80", "--json"],
    )
    assert result.exit_code == 2, result.output  # 141 GB of weights: refused, with what fits
    plan = json.loads(result.stdout)
    assert plan["target_weights"] == 141_107_412_992 and "use --tp 4 on 4 80 GB GPUs" in plan["verdict"]
    assert (
        "llama3-70b: sizes from the shapes specgen registers for meta-llama/Meta-Llama-3-70B-Instruct" in result.stderr
    )


def test_plan_still_needs_the_hub_for_a_model_it_does_not_know(no_hub):
    result = CliRunner().invoke(app, ["plan", "--target", "someone/unknown-model", "--draft", "ngram"])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith("error: cannot load 'someone/unknown-model'")
    assert "hint: no network: download it first (`hf download someone/unknown-model`" in result.stderr
