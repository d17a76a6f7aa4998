"""Medusa-1 heads: K heads on the target's last hidden state, head i guessing the token i
tokens past the one the target's own output layer predicts."""

from __future__ import annotations

import torch
from torch import nn


class ResBlock(nn.Module):
    """x + SiLU(W x + b), W zero at first so that a new head starts as the target's output layer."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    """`heads` heads of `layers` residual blocks each, and each its own output layer over the
    draft vocabulary, initialised from the target's rows for those ids."""

    def __init__(self, hidden: int, vocab_size: int, heads: int = 4, layers: int = 1) -> None:
        super().__init__()
        if heads < 1 or layers < 1:
            raise ValueError("Medusa needs at least one head of at least one layer")
        self.blocks = nn.ModuleList(nn.Sequential(*(ResBlock(hidden) for _ in range(layers))) for _ in range(heads))
        self.out = nn.ModuleList(nn.Linear(hidden, vocab_size, bias=False) for _ in range(heads))

    @property
    def heads(self) -> int:
        return len(self.blocks)

    def init_output(self, rows: torch.Tensor) -> None:
        """Copy the target's output rows [vocab_size, hidden] (the draft vocabulary's) into every head."""
        with torch.no_grad():
            for out in self.out:
                weight = out.weight
                assert isinstance(weight, torch.Tensor)
                weight.copy_(rows.to(weight.dtype))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., hidden] -> logits [heads, ..., vocab_size] over the draft vocabulary."""
        return torch.stack([out(block(hidden)) for block, out in zip(self.blocks, self.out)])
