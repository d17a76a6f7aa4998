"""Coupled sampling: with a seed, the randomness of output position t is a function of (seed, t).

The target's token at position t is the Gumbel-max sample

    token_t = argmax(log p_warped + g_t),   g_t i.i.d. Gumbel(0, 1) over the vocabulary,

with g_t drawn from a generator seeded by a hash of (seed, t) alone: the same on every call,
whatever the batch shape, the draft length or the timing. Gumbel-max is an exact sample of
p_warped (a zero of top-k / top-p has log p = -inf, which finite noise never lifts), and the
noise of different positions is independent, so the output is distributed exactly as the
target's over seeds, and for one seed it is exactly what the target alone samples.

The draft samples with the same noise, argmax(log q_warped + g_t), so it lands on the
target's token as often as this coupling allows; a drafted token is accepted exactly when it
equals the target's token at its position, and at the first rejected position the target's
own token is emitted. Verification is then greedy verification over the perturbed scores.
"""

from __future__ import annotations

from typing import Callable

import torch

from speccli.config import SamplingConfig


MASK64 = (1 << 64) - 1

# The noise of one position, shaped [V]; a drafter gets it by draft index (0 = the first
# token it drafts), the decoder by output position.
Noise = Callable[[int], torch.Tensor]


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers that scatters nearby inputs."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & MASK64
    return x ^ (x >> 31)


def position_seed(seed: int, position: int) -> int:
    """The generator seed of output position `position` under `seed` (any Python ints)."""
    return _mix64((_mix64(seed & MASK64) + 0x9E3779B97F4A7C15 * (position + 1)) & MASK64)


def gumbel_noise(seed: int, position: int, vocab_size: int) -> torch.Tensor:
    """i.i.d. Gumbel(0, 1) noise over a vocabulary of `vocab_size`, float32 on the CPU,
    a function of (seed, position, vocab_size) only.

    g = -log(E) with E = -log(1 - W) ~ Exp(1), W uniform in [0, 1) drawn in float64 (53
    bits) and the logarithms taken in float64, so E keeps its precision near 0, where g is
    largest. E is 0 only when W is (probability 2^-53 per token); it is then clamped, so
    g is always finite.
    """
    generator = torch.Generator(device="cpu").manual_seed(position_seed(seed, position))
    w = torch.rand(vocab_size, generator=generator, dtype=torch.float64)
    exponential = torch.log1p(-w).neg_().clamp_min_(torch.finfo(torch.float64).tiny)
    return exponential.log_().neg_().float()


def gumbel_argmax(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(log probs + noise) over the last dimension: an exact sample of `probs` when
    the noise is Gumbel(0, 1). Tokens of probability 0 are never chosen."""
    return torch.argmax(perturbed(probs, noise), dim=-1)


def perturbed(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return torch.log(probs.float()) + noise.to(probs.device)


def coupled(sampling: SamplingConfig) -> bool:
    """Whether a generation samples by the coupled rule: with a seed, so that the output is
    the target's own sample for that seed, whatever the drafter, k or timing. Without one,
    the rejection rule of Leviathan et al., whose acceptance is the higher (see the README)."""
    return not sampling.greedy and sampling.seed is not None


class PositionNoise:
    """The Gumbel noise of one seeded generation, by output position, computed once per
    position (the draft and the verification of a step share it)."""

    def __init__(self, seed: int, vocab_size: int) -> None:
        self.seed = seed
        self.vocab_size = vocab_size
        self._cache: dict[int, torch.Tensor] = {}

    def __call__(self, position: int) -> torch.Tensor:
        noise = self._cache.get(position)
        if noise is None:
            noise = self._cache[position] = gumbel_noise(self.seed, position, self.vocab_size)
        return noise

    def rows(self, start: int, count: int) -> torch.Tensor:
        """[count, V]: the noise of positions start .. start + count - 1."""
        return torch.stack([self(start + i) for i in range(count)])

    def from_position(self, start: int) -> Noise:
        """The noise by draft index for a draft whose first token is output position `start`."""
        return lambda index: self(start + index)

    def forget_before(self, position: int) -> None:
        """Positions before `position` are settled: their noise is not needed again."""
        for key in [key for key in self._cache if key < position]:
            del self._cache[key]
