"""A draft chain's tokens picked on the device (`CausalLM.chain`), as `draw` picks them on
the host: argmax when greedy; with a seed, the coupled draw argmax(log q + noise); else an
exact draw of q by inverting its distribution at a uniform number. The randomness of a
chain is drawn before it runs and kept in buffers that a CUDA graph of the chain reads, so
every token's pick stays on the device and the chain costs one copy to the host."""

from __future__ import annotations

from dataclasses import replace
from typing import Hashable

import torch

from speccli.config import SamplingConfig
from speccli.coupling import Noise, gumbel_argmax
from speccli.backends.base import Chain
from speccli.drafters.base import Draft, align_vocab, greedy_pick
from speccli.verify import sample_at, warp


class DevicePicker:
    """Picks a chain's tokens for one sampling configuration, for chains of up to `rows`
    tokens; a graph captured with it reads its buffers, so it is kept and reused."""

    def __init__(
        self,
        sampling: SamplingConfig,
        coupled: bool,
        target_vocab: int,
        shared_vocab: int,
        device: torch.device,
        rows: int,
    ) -> None:
        self.sampling = sampling
        self.coupled = coupled and not sampling.greedy
        self.target_vocab = target_vocab
        self.shared_vocab = shared_vocab
        self.rows = rows
        self.uniform = torch.zeros((rows, 1), dtype=torch.float64, device=device)
        self.noise = torch.zeros((rows, target_vocab), device=device) if self.coupled else None

    @property
    def key(self) -> Hashable:
        # The buffers are this picker's: a graph captured with it must not replay for another.
        return id(self), self.rows

    def load(self, steps: int, generator: torch.Generator | None, noise: Noise | None) -> None:
        """Draw the randomness of a chain of `steps` tokens (before it runs)."""
        if steps > self.rows:
            raise ValueError(f"this picker holds the randomness of {self.rows} tokens, not {steps}")
        if self.sampling.greedy:
            return
        if self.coupled:
            if noise is None or self.noise is None:
                raise ValueError("a coupled picker needs the noise of each position")
            self.noise[:steps].copy_(torch.stack([noise(i) for i in range(steps)]))
            return
        device = generator.device if generator is not None else self.uniform.device
        draws = torch.rand((steps, 1), generator=generator, dtype=torch.float64, device=device)
        self.uniform[:steps].copy_(draws)

    def pick(self, logits: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        row = align_vocab(logits, self.target_vocab, self.shared_vocab)
        if self.sampling.greedy:
            return (*greedy_pick(row), None)
        q = warp(row, self.sampling)
        if self.noise is not None:  # coupled
            token = gumbel_argmax(q, self.noise[index]).view(1)
        else:
            token = sample_at(q, self.uniform[index])
        return token, q.gather(-1, token), q


class Pickers:
    """A drafter's pickers: one per warp (the seed only selects what one is loaded with, not a
    picker or a graph of its own), grown to the longest chain asked for."""

    def __init__(self, target_vocab: int, shared_vocab: int, device: torch.device) -> None:
        self.target_vocab, self.shared_vocab, self.device = target_vocab, shared_vocab, device
        self._pickers: dict[tuple[SamplingConfig, bool], DevicePicker] = {}

    def loaded(
        self, sampling: SamplingConfig, steps: int, generator: torch.Generator | None, noise: Noise | None
    ) -> DevicePicker:
        """The picker for this warp, loaded with the randomness of a chain of `steps` tokens."""
        key = (replace(sampling, seed=None), noise is not None)
        picker = self._pickers.get(key)
        if picker is None or picker.rows < steps:
            rows = max(steps, 2 * picker.rows if picker is not None else 8)
            picker = DevicePicker(sampling, key[1], self.target_vocab, self.shared_vocab, self.device, rows)
            self._pickers[key] = picker
        picker.load(steps, generator, noise)
        return picker


def until_unsure(chain: Chain, stop_confidence: float) -> Draft:
    """The chain as the pass-by-pass loop would have drafted it: up to and including the
    first token the draft gave less than `stop_confidence`."""
    kept = next((i + 1 for i, c in enumerate(chain.confidence) if c < stop_confidence), len(chain.tokens))
    return Draft(chain.tokens[:kept], None if chain.probs is None else chain.probs[:kept])
