"""A GGUF file's tokenizer: its conversion is slow for a large vocabulary (Qwen's 151k), so it
runs once and is kept, as tokenizer.json, under ``<cache>/tokenizers/``, keyed by the file's
path, size, mtime and the transformers version; later loads read that file."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from speccli.models.names import offline
from speccli.models.names.registry import ResolvedModel

Progress = Callable[[str], None]


def _tokenizer_cache_folder(resolved: ResolvedModel, cache_dir: Path) -> tuple[Path, str | None] | None:
    """Where a GGUF's converted tokenizer is kept, and the file's chat template. The folder is
    keyed by what the conversion reads (the architecture and every `tokenizer.ggml.*` entry) and
    the transformers version, not by the file: a draft and target of one family share it, the
    chat template (which may differ between them) set on the loaded tokenizer afterwards.
    None for a file that cannot be read (its load will say why)."""
    import transformers

    from speccli.models.formats.gguf_file import GgufFormatError, read_header

    path = resolved.gguf_path
    if path is None:
        return None
    folders = cache_dir / "tokenizers"
    try:
        stat = path.stat()
    except OSError:
        return None
    # Reading the header to find the folder would cost every start a pass over the file's
    # vocabulary: what it found is kept by the file's identity.
    identity = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "transformers": transformers.__version__}
    index = folders / "files.json"
    found = offline.read_json_object(index).get(str(path.resolve()))
    if isinstance(found, dict) and all(found.get(k) == v for k, v in identity.items()) and found.get("folder"):
        return folders / found["folder"], found.get("template")
    try:
        header = read_header(path)
    except (OSError, GgufFormatError):
        return None
    key = f"{transformers.__version__}\0{header.architecture}\0{header.digest('tokenizer.ggml.')}"
    digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:24]
    template = header.metadata.get("tokenizer.chat_template")
    template = template if isinstance(template, str) else None
    folder = f"{header.architecture}-{digest}"
    entry = {**identity, "folder": folder, "template": template}
    offline.write_json(index, {**offline.read_json_object(index), str(path.resolve()): entry})
    return folders / folder, template


def load_gguf_tokenizer(resolved: ResolvedModel, cache_dir: Path, say: Progress) -> Any:
    """Convert the GGUF's tokenizer once; later loads read the saved tokenizer.json."""
    from transformers import AutoTokenizer

    kept = _tokenizer_cache_folder(resolved, cache_dir)
    folder, template = kept if kept is not None else (None, None)
    if folder is not None and (folder / "tokenizer_config.json").is_file():
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder)
        except Exception:
            shutil.rmtree(folder, ignore_errors=True)
        else:
            tokenizer.chat_template = template
            return tokenizer
    say(f"converting the tokenizer in {resolved.gguf_file} (once; it is kept in {cache_dir / 'tokenizers'})")
    from speccli.models.formats.gguf_weights import share_metadata_parse

    share_metadata_parse()  # the weights' config, converted next, reads the same parse
    tokenizer = AutoTokenizer.from_pretrained(resolved.location, gguf_file=resolved.gguf_file)
    if folder is not None:
        tmp: str | None = None
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
            tmp = tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.")
            tokenizer.save_pretrained(tmp)
            os.replace(tmp, folder)
            tmp = None
        except OSError:
            pass  # read-only or racing cache: only costs a conversion next time
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer
