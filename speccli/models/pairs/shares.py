"""How much of a target's vocabulary drafts of other tokenizers spell alike, for `specgen
models --drafts-for`: read from tokenizers already on this machine, never downloaded."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from speccli.models.errors import ModelLoadError


def _local(name: str, cache_dir: Path | None) -> bool:
    from speccli.models.names.registry import resolve

    try:
        return resolve(name, cache_dir, assemble=False).kind != "hub"
    except ModelLoadError:
        return False


def vocabulary_shares(target: str, drafts: Sequence[str], cache_dir: Path | None = None) -> dict[str, float | None]:
    """Each draft's share of the target's tokens it spells alike (None where the two cannot
    be bridged); drafts whose tokenizer, or the target's, is not on this machine are left out."""
    local = [name for name in drafts if _local(name, cache_dir)]
    if not local or not _local(target, cache_dir):
        return {}
    from speccli.config import LoadConfig
    from speccli.models.loading import load_tokenizer
    from speccli.drafters.vocab_bridge import CannotBridge, bridge_vocabularies

    config = LoadConfig(device="cpu")
    target_tokenizer = load_tokenizer(target, config, cache_dir=cache_dir).tokenizer
    shares: dict[str, float | None] = {}
    for name in local:
        draft_tokenizer = load_tokenizer(name, config, cache_dir=cache_dir).tokenizer
        try:
            shares[name] = bridge_vocabularies(target_tokenizer, draft_tokenizer).share_of_target()
        except CannotBridge:
            shares[name] = None
    return shares
