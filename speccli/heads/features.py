"""The frozen target run over a corpus (teacher forcing): at every position its last hidden
state (the feature its output layer reads) and its own greedy prediction of the next token
(the label: the heads learn what the target would say). Written to disk in shards as they
are computed, so an interrupted extraction resumes where it stopped."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from speccli.heads.corpus import Corpus

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SEGMENTS_PER_SHARD = 16

Progress = Callable[[int, int], None]  # (tokens done, tokens in all)


@dataclass
class Features:
    tokens: torch.Tensor  # [S, T] long: the corpus
    features: torch.Tensor  # [S, T, hidden]: the target's last hidden states
    labels: torch.Tensor  # [S, T] long: the target's argmax at each position (its next token)

    def select(self, indices: list[int]) -> "Features":
        index = torch.tensor(indices, dtype=torch.long)
        return Features(self.tokens[index], self.features[index], self.labels[index])

    def __len__(self) -> int:
        return len(self.tokens)


@torch.no_grad()  # not inference_mode: the features are training inputs
def target_pass(target: PreTrainedModel, segment: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [T, hidden], labels [T]) of one segment, from one pass of the target."""
    device = next(target.parameters()).device
    ids = torch.tensor([segment], dtype=torch.long, device=device)
    hidden = target.base_model(input_ids=ids).last_hidden_state
    labels = target.get_output_embeddings()(hidden).argmax(dim=-1)
    return hidden[0].cpu(), labels[0].cpu()


def _shard_path(folder: Path, segments: list[list[int]]) -> Path:
    """A shard is named by its segments' content: a longer corpus whose first segments are
    another's (the default corpus with more --tokens) reuses that one's shards."""
    digest = hashlib.sha256(json.dumps(segments).encode()).hexdigest()[:16]
    return folder / f"shard-{digest}.safetensors"


def extract(
    target: PreTrainedModel,
    corpus: Corpus,
    folder: Path,
    progress: Progress | None = None,
    feature_dtype: torch.dtype = torch.bfloat16,
) -> Features:
    """Features of every corpus segment, from `folder` where already computed for this
    corpus, else computed now and saved there shard by shard."""
    from safetensors.torch import load_file, save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    total = corpus.tokens
    tokens, features, labels = [], [], []
    done = 0
    for first in range(0, len(corpus.segments), SEGMENTS_PER_SHARD):
        segments = corpus.segments[first : first + SEGMENTS_PER_SHARD]
        path = _shard_path(folder, segments)
        shard = None
        if path.exists():
            try:
                shard = load_file(str(path))
            except Exception:  # noqa: BLE001 - a damaged shard (killed mid-write) is computed again
                shard = None
        if shard is None:
            rows = []
            for i, segment in enumerate(segments):
                rows.append(target_pass(target, segment))
                if progress is not None:
                    progress(done + (i + 1) * len(segment), total)
            shard = {
                "tokens": torch.tensor(segments, dtype=torch.int32),
                "features": torch.stack([f for f, _ in rows]).to(feature_dtype),
                "labels": torch.stack([lab for _, lab in rows]).to(torch.int32),
            }
            partial = path.with_name(path.name + ".partial")
            save_file(shard, str(partial))
            partial.replace(path)
        done += sum(len(s) for s in segments)
        if progress is not None:
            progress(done, total)
        tokens.append(shard["tokens"].long())
        features.append(shard["features"])
        labels.append(shard["labels"].long())
    return Features(torch.cat(tokens), torch.cat(features), torch.cat(labels))
