"""A reduced draft vocabulary: the target ids a head may propose, the most frequent first.

On a CPU a head's cost is dominated by its output layer (151,936 rows for Qwen2.5); the few
thousand most frequent tokens of the training text cover most of what the target says
(EAGLE-3 does the same). A head scores only these ids; its q gives every other id
probability 0, which the verification rule handles like any draft distribution."""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE = -100  # a label outside the draft vocabulary: no loss, and a miss for accuracy


@dataclass(frozen=True)
class DraftVocab:
    ids: torch.Tensor  # [size] long: target ids, most frequent first
    target_size: int

    def __post_init__(self) -> None:
        if self.ids.ndim != 1 or len(self.ids) == 0:
            raise ValueError("a draft vocabulary needs at least one id")
        if int(self.ids.max()) >= self.target_size or int(self.ids.min()) < 0:
            raise ValueError(f"draft vocabulary ids must lie in [0, {self.target_size})")
        if len(torch.unique(self.ids)) != len(self.ids):
            raise ValueError("draft vocabulary ids must be distinct")

    @classmethod
    def most_frequent(
        cls, labels: torch.Tensor, size: int, target_size: int, fill: torch.Tensor | None = None
    ) -> "DraftVocab":
        """The `size` ids seen most often in `labels` (ties: the lower id first). Where the
        labels hold fewer distinct ids, the rest are the ids seen most often in `fill`
        (token ids of more text, which costs no pass of the target): a head trained on a
        few tens of thousands of tokens has seen only part of what the target says."""
        ranked = _by_count(labels, target_size)
        if fill is not None and len(ranked) < size:
            seen = torch.zeros(target_size, dtype=torch.bool)
            seen[ranked] = True
            extra = _by_count(fill, target_size)
            ranked = torch.cat([ranked, extra[~seen[extra]]])
        if len(ranked) == 0:
            ranked = torch.zeros(1, dtype=torch.long)
        return cls(ranked[: max(1, size)].clone(), target_size)

    def __len__(self) -> int:
        return len(self.ids)

    def _lookup(self) -> torch.Tensor:
        table = torch.full((self.target_size,), IGNORE, dtype=torch.long)
        table[self.ids] = torch.arange(len(self.ids))
        return table

    def index_of(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Each target id's index in this vocabulary, IGNORE where it has none."""
        return self._lookup().to(target_ids.device)[target_ids.long()]

    def coverage(self, labels: torch.Tensor) -> float:
        """The share of `labels` this vocabulary can propose."""
        if labels.numel() == 0:
            return 0.0
        return float((self.index_of(labels) != IGNORE).float().mean())

    def to_target(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., size] draft logits as [..., target_size] float32, -inf outside the vocabulary."""
        out = logits.new_full((*logits.shape[:-1], self.target_size), float("-inf"), dtype=torch.float32)
        out[..., self.ids.to(logits.device)] = logits.float()
        return out


def _by_count(ids: torch.Tensor, target_size: int) -> torch.Tensor:
    """The distinct ids in `ids`, the most frequent first (ties: the lower id first)."""
    counts = torch.bincount(ids.flatten().long(), minlength=target_size)
    # A stable sort on -counts keeps ascending ids among equal counts.
    order = torch.sort(-counts, stable=True).indices
    return order[: int((counts > 0).sum())]
