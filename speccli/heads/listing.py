"""Heads files in the cache (`specgen heads`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from speccli.heads.store import HeadsMismatch, read_metadata


@dataclass(frozen=True)
class HeadsListing:
    path: str
    kind: str
    target: str
    size_bytes: int
    tokens: int | None
    accuracy: list[float]
    vocab: int | None
    trained: str | None


def find_heads(cache_dir: Path) -> list[HeadsListing]:
    found = []
    for path in sorted((Path(cache_dir) / "heads").glob("*/*.safetensors")):
        try:
            meta = read_metadata(path)
        except HeadsMismatch:
            continue
        training = meta["training"]
        found.append(
            HeadsListing(
                path=str(path),
                kind=meta["kind"],
                target=str(meta["target"].get("name")),
                size_bytes=path.stat().st_size,
                tokens=training.get("tokens"),
                accuracy=list(training.get("accuracy") or []),
                vocab=training.get("vocab"),
                trained=training.get("trained"),
            )
        )
    return found
