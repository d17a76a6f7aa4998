"""Converted weights, kept: the first load of a GGUF file through transformers dequantizes
every block (the slow part of a start); what it produced is written as safetensors in
specgen's cache, and later starts load that instead.

An entry is keyed by everything its tensors depend on: the source file's identity (name,
size, modification time and a hash of its first MiB, which holds the header), the dtype,
and the versions of transformers, torch and this format. It is written under a temporary
name and renamed into place, so a conversion killed mid-write (or a full disk) leaves no
entry, only a temporary folder that the next write removes; an entry whose files no longer
have the sizes it recorded (truncated, partly deleted), whose JSON does not parse, whose
weights file has a damaged header, or whose weights changed since they were written (a
checksum, read whole only where the file's modification time changed: see `damage`) is
removed and converted again, never loaded.

`SPECGEN_NO_CACHE=1` (or `--no-cache`) neither reads nor writes entries.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

FORMAT = 1
FOLDER = "converted"
ENTRY_FILE = "specgen-entry.json"
NO_CACHE_ENV = "SPECGEN_NO_CACHE"
HEADER_BYTES = 1 << 20
PARTIAL = ".partial-"


def disabled_by_environment() -> bool:
    return os.environ.get(NO_CACHE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def source_identity(path: Path) -> dict[str, Any]:
    """What identifies a source file's contents without reading all of it."""
    stat = path.stat()
    with path.open("rb") as handle:
        header = hashlib.sha256(handle.read(HEADER_BYTES)).hexdigest()
    return {"file": path.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "header_sha256": header}


def identity(source: Path, dtype: str) -> dict[str, Any]:
    """Everything a conversion of `source` to `dtype` (its name: "bfloat16") depends on."""
    import transformers

    return {
        "format": FORMAT,
        "source": source_identity(source),
        "dtype": dtype,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }


def _key(ident: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    stem = Path(ident["source"]["file"]).stem
    return f"{stem}-{ident['dtype']}-{digest}"


@dataclass(frozen=True)
class ConvertedEntry:
    """One kept conversion: where it is, what it came from, the size of its files."""

    folder: Path
    source: str
    dtype: str
    size_bytes: int
    created: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "folder": str(self.folder),
            "source": self.source,
            "dtype": self.dtype,
            "size_bytes": self.size_bytes,
            "created": self.created,
        }


def _read_entry(folder: Path) -> dict[str, Any] | None:
    try:
        entry = json.loads((folder / ENTRY_FILE).read_text())
    except (OSError, ValueError):
        return None
    return entry if isinstance(entry, dict) else None


def _intact(folder: Path, entry: dict[str, Any]) -> bool:
    files = entry.get("files")
    if not isinstance(files, dict) or not files:
        return False
    for name, size in files.items():
        try:
            if (folder / name).stat().st_size != size:
                return False
        except OSError:
            return False
    return True


def file_digest(path: Path) -> str:
    """The file's BLAKE2b digest (read whole: about 1.6 s a GB on a 2-core EPYC)."""
    digest = hashlib.blake2b()
    with path.open("rb") as handle:
        while chunk := handle.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _check(path: Path) -> dict[str, Any]:
    return {"mtime_ns": path.stat().st_mtime_ns, "blake2b": file_digest(path)}


def safetensors_problem(path: Path) -> str | None:
    """Why a safetensors file cannot be what save_pretrained wrote (its header is not JSON, or
    its tensors do not end where the file does); None when it can. Reads the header alone."""
    try:
        with path.open("rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            if not 2 <= length <= min(100 << 20, path.stat().st_size - 8):
                return "its header's length is impossible"
            header = json.loads(handle.read(length))
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return "its header is damaged"
    if 8 + length + max(ends, default=0) != path.stat().st_size:
        return "its tensors do not end where the file does"
    return None


def damage(folder: Path, entry: dict[str, Any]) -> str | None:
    """Why an entry's files are not what it recorded, or None when they are. Cheap where nothing
    changed: sizes, the JSON files parsed, each weights file's header read and its modification
    time compared with the one recorded with its checksum. A weights file whose time differs (it
    was written to, or copied without its times) is read whole and its checksum compared; a
    match records the new time. An entry written before checksums were kept gets them now."""
    if not _intact(folder, entry):
        return "a file is missing or its size changed"
    checks = entry.get("checks")
    checks = dict(checks) if isinstance(checks, dict) else {}
    changed = False
    for name in entry["files"]:
        path = folder / name
        if name.endswith(".json"):
            try:
                json.loads(path.read_text())
            except (OSError, ValueError):
                return f"{name} is not valid JSON"
        elif name.endswith(".safetensors"):
            problem = safetensors_problem(path)
            if problem is not None:
                return f"{name}: {problem}"
            recorded = checks.get(name)
            if isinstance(recorded, dict) and recorded.get("mtime_ns") == path.stat().st_mtime_ns:
                continue
            now = _check(path)
            if isinstance(recorded, dict) and recorded.get("blake2b") != now["blake2b"]:
                return f"{name} changed since it was written (its checksum differs)"
            checks[name] = now
            changed = True
    if changed:
        _write_entry(folder, {**entry, "checks": checks})
    return None


def _write_entry(folder: Path, entry: dict[str, Any]) -> None:
    """Rewrite an entry file in one step (a write cut short leaves the old one)."""
    partial = folder / f"{ENTRY_FILE}{PARTIAL}{os.getpid()}"
    try:
        partial.write_text(json.dumps(entry, indent=2))
        os.replace(partial, folder / ENTRY_FILE)
    except OSError:  # a read-only cache: the check is made again next time
        partial.unlink(missing_ok=True)


def lookup(cache_dir: Path, ident: dict[str, Any], say: Callable[[str], None] | None = None) -> Path | None:
    """The folder of an intact entry for this identity, or None. A damaged entry is removed
    (and `say` told why: the caller converts again)."""
    folder = cache_dir / FOLDER / _key(ident)
    if not folder.is_dir():
        return None
    entry = _read_entry(folder)
    if entry is not None and entry.get("identity") == ident:
        problem = damage(folder, entry)
        if problem is None:
            return folder
    else:
        problem = "its record is missing or damaged"
    discard(folder)
    if say is not None:
        say(f"the converted weights in {folder} were damaged ({problem}): removed, converting again")
    return None


def discard(folder: Path) -> None:
    """Remove an entry that must not be used."""
    shutil.rmtree(folder, ignore_errors=True)


def store(cache_dir: Path, ident: dict[str, Any], save: Callable[[Path], None]) -> Path:
    """Write an entry: `save(folder)` writes the model's files (save_pretrained), then the
    entry file records their sizes, then the folder is renamed into place. Raises OSError
    (disk full, read-only cache); nothing partial is left behind."""
    root = cache_dir / FOLDER
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(root)
    final = root / _key(ident)
    partial = root / f"{final.name}{PARTIAL}{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        save(partial)
        files = {p.name: p.stat().st_size for p in sorted(partial.iterdir()) if p.is_file()}
        checks = {name: _check(partial / name) for name in files if name.endswith(".safetensors")}
        entry = {"identity": ident, "files": files, "checks": checks, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
        (partial / ENTRY_FILE).write_text(json.dumps(entry, indent=2))
        _flush(partial)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return final


def _flush(folder: Path) -> None:
    """Wait until the folder's files are on disk before the entry is renamed into place: an
    entry must not name files a crash (a power cut) would leave empty."""
    for path in folder.iterdir():
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())


def _remove_stale_partials(root: Path) -> None:
    """Temporary folders of writes whose process is gone (killed mid-write)."""
    for folder in root.glob(f"*{PARTIAL}*"):
        pid = folder.name.rsplit(PARTIAL, 1)[-1]
        if not pid.isdigit() or not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # PermissionError: alive, someone else's
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def entries(cache_dir: Path) -> list[ConvertedEntry]:
    """The kept conversions, intact ones only, largest first."""
    root = cache_dir / FOLDER
    found = []
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        if PARTIAL in folder.name or not folder.is_dir():
            continue
        entry = _read_entry(folder)
        if entry is None or not _intact(folder, entry):
            continue
        ident = entry.get("identity", {})
        size = sum(entry["files"].values())  # checked against the files by _intact
        found.append(
            ConvertedEntry(
                folder,
                ident.get("source", {}).get("file", "?"),
                ident.get("dtype", "?"),
                size,
                entry.get("created", "?"),
            )
        )
    return sorted(found, key=lambda e: -e.size_bytes)


def remove(cache_dir: Path, matching: str | None = None) -> list[ConvertedEntry]:
    """Remove kept conversions (those whose source file name contains `matching`, or all),
    and any leftovers of interrupted writes. Returns what was removed. An empty `matching`
    would match every entry: it is refused (None removes them all)."""
    if matching is not None and not matching.strip():
        raise ValueError("an empty name matches every converted entry; None removes them all")
    removed = []
    for entry in entries(cache_dir):
        if matching is None or matching in entry.source:
            shutil.rmtree(entry.folder, ignore_errors=True)
            removed.append(entry)
    root = cache_dir / FOLDER
    if root.is_dir():
        _remove_stale_partials(root)
    return removed


_keeping: list[threading.Thread] = []


def keeper(
    model: Any, cache: Path, conversion: dict[str, Any], name: str, say: Callable[[str], None]
) -> Callable[[], None]:
    """What starts writing the GGUF's dequantization for later starts, in a thread beside the
    rest of the start (the next model's load, the first tokens); the interpreter waits for it
    before it exits (see finish_conversions). A failure (a full disk, a read-only cache) costs
    only the next start's time; a write cut short leaves no entry (store). Calling
    it again does nothing."""
    # The tensors are taken now, before any layer is replaced (an int8 draft's while the
    # thread writes, the kernels' after timing): the thread writes these, alive and unchanged.
    tensors = model.state_dict()
    started: list[threading.Thread] = []

    # Nothing is said when it is done: by then the answer may be streaming to the terminal.
    def write() -> None:
        try:
            store(cache, conversion, lambda target: model.save_pretrained(target, state_dict=tensors))
        except OSError as error:
            say(f"{name}: could not keep the converted weights ({error}); the next start converts again")

    def start() -> None:
        if started:
            return
        say(f"{name}: keeping the converted weights in {cache / FOLDER} for later starts")
        thread = threading.Thread(target=write, name=f"specgen-keep-{name}")
        started.append(thread)
        _keeping.append(thread)
        thread.start()

    return start


def finish_conversions() -> None:
    """Wait for the conversions being written (a non-daemon thread is waited for at exit anyway)."""
    while _keeping:
        _keeping.pop().join()
