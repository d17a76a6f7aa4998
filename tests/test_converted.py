"""Converted weights kept in the cache: a GGUF is dequantized once, later loads read the safetensors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from speccli.cli import app
from speccli.config import LoadConfig
from speccli.models.formats import converted, gguf_weights
from speccli.models.loading import finish_conversions
from speccli.models.loading import load_model as load_model_alone
from test_models_registry import write_tiny_gguf

F32 = LoadConfig(device="cpu", dtype="float32", cpu_linear="stock")


def load_model(*args, **kwargs):
    """Load, and wait for the conversion kept beside the load (a thread)."""
    loaded = load_model_alone(*args, **kwargs)
    finish_conversions()
    return loaded


@pytest.fixture
def gguf_file(tmp_path):
    path = tmp_path / "src" / "tiny.F32.gguf"
    path.parent.mkdir()
    return path, write_tiny_gguf(path)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.delenv(converted.NO_CACHE_ENV, raising=False)
    return tmp_path / "cache"


@pytest.fixture
def model_loads(monkeypatch):
    """What each weights load read: ("gguf", file name) for a dequantization of a GGUF file,
    ("folder", path) for AutoModelForCausalLM.from_pretrained of a folder (a conversion)."""
    calls = []
    real_model, real_gguf = AutoModelForCausalLM.from_pretrained, gguf_weights.load_causal_lm

    def model_spy(location, *args, **kwargs):
        calls.append(("gguf", kwargs["gguf_file"]) if "gguf_file" in kwargs else ("folder", str(location)))
        return real_model(location, *args, **kwargs)

    def gguf_spy(path, *args, **kwargs):
        calls.append(("gguf", path.name))
        return real_gguf(path, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", model_spy)
    monkeypatch.setattr(gguf_weights, "load_causal_lm", gguf_spy)
    return calls


def weights_equal(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_the_second_load_reads_the_conversion_and_does_not_dequantize(gguf_file, cache, model_loads):
    path, source = gguf_file
    messages = []
    first = load_model(str(path), F32, messages.append, cache)
    entries = converted.entries(cache)
    assert [(e.source, e.dtype) for e in entries] == [("tiny.F32.gguf", "float32")]
    assert model_loads == [("gguf", "tiny.F32.gguf")]
    assert any("dequantizing tiny.F32.gguf" in m for m in messages)

    messages.clear()
    again = load_model(str(path), F32, messages.append, cache)
    assert model_loads[1] == ("folder", str(entries[0].folder))  # nothing dequantized
    assert not any("dequantizing" in m for m in messages)
    assert any("converted earlier" in m for m in messages)
    assert weights_equal(again.model, first.model) and weights_equal(again.model, source)
    assert again.quant == first.quant == "gguf→float32"  # described (and calibrated) as the GGUF it came from
    assert again.eos_token_ids == first.eos_token_ids
    ids = torch.tensor([[5, 6, 7, 8, 3]])
    with torch.no_grad():
        assert torch.equal(again.model(ids).logits, first.model(ids).logits)


def test_another_dtype_is_another_entry(gguf_file, cache, model_loads):
    path, _ = gguf_file
    load_model(str(path), F32, cache_dir=cache)
    load_model(str(path), LoadConfig(device="cpu", dtype="bfloat16", cpu_linear="stock"), cache_dir=cache)
    assert sorted(e.dtype for e in converted.entries(cache)) == ["bfloat16", "float32"]
    assert [kind for kind, _ in model_loads] == ["gguf", "gguf"]


def test_a_truncated_entry_is_converted_again_not_loaded(gguf_file, cache, model_loads):
    path, source = gguf_file
    load_model(str(path), F32, cache_dir=cache)
    (entry,) = converted.entries(cache)
    weights = entry.folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert converted.entries(cache) == []  # not listed as a usable entry
    again = load_model(str(path), F32, cache_dir=cache)
    assert [kind for kind, _ in model_loads] == ["gguf", "gguf"]
    assert weights_equal(again.model, source)
    assert len(converted.entries(cache)) == 1  # rebuilt, intact
    load_model(str(path), F32, cache_dir=cache)
    assert model_loads[-1][0] == "folder"


def test_a_changed_source_file_invalidates_its_entry(gguf_file, cache, model_loads):
    path, _ = gguf_file
    load_model(str(path), F32, cache_dir=cache)
    changed = write_tiny_gguf(path, seed=9)
    again = load_model(str(path), F32, cache_dir=cache)
    assert model_loads[-1] == ("gguf", "tiny.F32.gguf")
    assert weights_equal(again.model, changed)


def test_no_cache_neither_reads_nor_writes(gguf_file, cache, model_loads, monkeypatch):
    path, _ = gguf_file
    load_model(str(path), LoadConfig(device="cpu", dtype="float32", keep_converted=False), cache_dir=cache)
    assert not (cache / converted.FOLDER).exists()
    monkeypatch.setenv(converted.NO_CACHE_ENV, "1")
    load_model(str(path), F32, cache_dir=cache)
    assert not (cache / converted.FOLDER).exists()
    monkeypatch.delenv(converted.NO_CACHE_ENV)
    load_model(str(path), F32, cache_dir=cache)  # writes
    monkeypatch.setenv(converted.NO_CACHE_ENV, "1")
    load_model(str(path), F32, cache_dir=cache)  # and does not read
    assert [kind for kind, _ in model_loads] == ["gguf"] * 4


def test_a_write_that_fails_leaves_nothing_and_the_load_goes_on(gguf_file, cache, monkeypatch):
    path, source = gguf_file

    def disk_full(self, folder, *args, **kwargs):
        folder = type(cache)(folder)
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("transformers.PreTrainedModel.save_pretrained", disk_full)
    messages = []
    loaded = load_model(str(path), F32, messages.append, cache)
    assert weights_equal(loaded.model, source)
    assert list((cache / converted.FOLDER).iterdir()) == []
    assert any("could not keep" in m and "No space left" in m for m in messages)


def test_a_killed_writes_leftovers_are_removed(gguf_file, cache):
    path, _ = gguf_file
    leftover = cache / converted.FOLDER / f"tiny.F32-float32-0123{converted.PARTIAL}999999999"
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(b"half")
    load_model(str(path), F32, cache_dir=cache)
    assert not leftover.exists()
    assert len(converted.entries(cache)) == 1


def test_models_lists_and_removes_conversions(gguf_file, cache, monkeypatch):
    path, _ = gguf_file
    monkeypatch.setenv("SPECGEN_CACHE", str(cache))
    load_model(str(path), F32, cache_dir=cache)
    runner = CliRunner()
    listed = runner.invoke(app, ["models", "--converted", "--json"])
    assert listed.exit_code == 0, listed.output
    (item,) = json.loads(listed.stdout)
    assert item["source"] == "tiny.F32.gguf" and item["dtype"] == "float32" and item["size_bytes"] > 0
    table = runner.invoke(app, ["models", "--converted"])
    assert "tiny.F32.gguf" in table.stdout and "float32" in table.stdout
    kept = runner.invoke(app, ["models", "--remove-converted", "other-model"])
    assert kept.exit_code == 0 and len(converted.entries(cache)) == 1
    assert "no converted weights match" in kept.stderr
    removed = runner.invoke(app, ["models", "--remove-converted", "all"])
    assert removed.exit_code == 0 and converted.entries(cache) == []
    assert "removed tiny.F32.gguf (float32" in removed.stderr
    shutil.rmtree(cache)


def test_the_conversion_is_kept_beside_the_rest_of_the_start(gguf_file, cache, monkeypatch):
    """The load returns while the conversion is still being written; an int8 draft is
    quantized meanwhile, and what is kept is still the float32 dequantization."""
    import threading

    path, source = gguf_file
    release = threading.Event()
    real_store = converted.store

    def slow_store(*args, **kwargs):
        assert release.wait(30)
        return real_store(*args, **kwargs)

    monkeypatch.setattr(converted, "store", slow_store)
    # backend transformers: where llama-cpp-python is installed, auto would run the file there.
    as_draft = LoadConfig(device="cpu", dtype="auto", for_draft=True, backend="transformers")
    draft = load_model_alone(str(path), as_draft, cache_dir=cache)
    assert draft.quant == "gguf→int8" and converted.entries(cache) == []  # returned before the write
    release.set()
    finish_conversions()
    [entry] = converted.entries(cache)
    assert entry.dtype == "float32"
    assert weights_equal(AutoModelForCausalLM.from_pretrained(str(entry.folder)), source)


def test_the_kernels_are_timed_before_the_conversion_is_written(gguf_file, cache, monkeypatch):
    from speccli.models import loading

    path, _ = gguf_file
    order = []
    real_choose, real_store = loading.choose_stock_rows, converted.store
    monkeypatch.setattr(loading, "choose_stock_rows", lambda *a, **k: order.append("timed") or real_choose(*a, **k))
    monkeypatch.setattr(converted, "store", lambda *a, **k: order.append("written") or real_store(*a, **k))
    load_model(str(path), LoadConfig(device="cpu", dtype="float32", cpu_linear="auto"), cache_dir=cache)
    assert order == ["timed", "written"]  # a writing thread would have slowed the timed kernels


def _damage_weights_in_place(weights, offset_share: float, data: bytes) -> None:
    """Write `data` over the weights file at a share of its length, keeping its size."""
    with weights.open("r+b") as handle:
        handle.seek(int(weights.stat().st_size * offset_share))
        handle.write(data)


@pytest.mark.parametrize(
    "damage, reason",
    [
        # Random bytes over the middle, the size unchanged: only the checksum can tell.
        (
            lambda folder: _damage_weights_in_place(folder / "model.safetensors", 0.5, bytes(range(256)) * 4),
            "changed since it was written",
        ),
        # A header that is not JSON any more.
        (
            lambda folder: _damage_weights_in_place(
                folder / "model.safetensors", 0.0, b"\x10\x00\x00\x00\x00\x00\x00\x00{{{{"
            ),
            "header",
        ),
        # An impossible header length.
        (
            lambda folder: _damage_weights_in_place(folder / "model.safetensors", 0.0, b"\xff" * 8),
            "header's length is impossible",
        ),
        # Same size, not JSON any more.
        (
            lambda folder: (folder / "config.json").write_text("[" + (folder / "config.json").read_text()[1:]),
            "config.json is not valid JSON",
        ),
        (lambda folder: (folder / "specgen-entry.json").write_text("[]"), "record is missing or damaged"),
    ],
)
def test_a_damaged_entry_is_never_loaded_and_is_converted_again(gguf_file, cache, model_loads, damage, reason):
    path, source = gguf_file
    load_model(str(path), F32, cache_dir=cache)
    (entry,) = converted.entries(cache) or [None]
    if entry is None:
        pytest.fail("no entry was kept")
    damage(entry.folder)
    messages = []
    again = load_model(str(path), F32, messages.append, cache)
    assert [kind for kind, _ in model_loads] == ["gguf", "gguf"]  # dequantized again, the entry not read
    assert weights_equal(again.model, source)
    said = [m for m in messages if "were damaged" in m]
    assert len(said) == 1 and reason in said[0] and "converting again" in said[0]
    load_model(str(path), F32, cache_dir=cache)
    assert model_loads[-1][0] == "folder"  # the rebuilt entry is read


def test_a_touched_but_unchanged_entry_is_checked_once_and_kept(gguf_file, cache, model_loads):
    import os

    path, _ = gguf_file
    load_model(str(path), F32, cache_dir=cache)
    (entry,) = converted.entries(cache)
    weights = entry.folder / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # copied without its times
    load_model(str(path), F32, cache_dir=cache)
    assert model_loads[-1][0] == "folder"
    record = json.loads((entry.folder / converted.ENTRY_FILE).read_text())
    assert record["checks"]["model.safetensors"]["mtime_ns"] == weights.stat().st_mtime_ns  # the new time, checked


def test_an_entry_that_fails_to_load_is_removed_and_converted_again(gguf_file, cache, model_loads, monkeypatch):
    path, source = gguf_file
    load_model(str(path), F32, cache_dir=cache)
    real = AutoModelForCausalLM.from_pretrained

    def broken(location, *args, **kwargs):
        if "gguf_file" not in kwargs and converted.FOLDER in str(location):
            raise OSError("Error while deserializing header: invalid")
        return real(location, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", broken)
    messages = []
    again = load_model(str(path), F32, messages.append, cache)
    assert weights_equal(again.model, source)
    assert any("could not be read (OSError): removed, converting again" in m for m in messages)


def test_an_empty_name_removes_nothing(gguf_file, cache):
    path, _ = gguf_file
    load_model(str(path), F32, cache_dir=cache)
    with pytest.raises(ValueError):
        converted.remove(cache, "")
    with pytest.raises(ValueError):
        converted.remove(cache, "  ")
    assert len(converted.entries(cache)) == 1
