"""Pure tensor functions: warping logits, sampling, and the two verification rules.

Every function works on the last dimension (the vocabulary) and accepts leading batch
dimensions where that makes sense, so tests can draw hundreds of thousands of samples
through the very code the decoder uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speccli.config import SamplingConfig
from speccli.coupling import perturbed


def make_generator(device: torch.device, seed: int | None) -> torch.Generator:
    """The random source of one generation: seeded, or from the system's entropy."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def warp(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Logits -> probabilities under temperature, then top-k, then top-p (the order
    transformers uses). Not for greedy decoding, which compares argmaxes instead."""
    if sampling.greedy:
        raise ValueError("warp() is for sampling; greedy decoding uses argmax")
    scores = logits.float()
    # Subtracting the row max first keeps huge finite logits from overflowing when T < 1.
    scores = (scores - scores.amax(dim=-1, keepdim=True)) / sampling.temperature
    vocab = scores.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth_best = torch.topk(scores, sampling.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth_best, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        # Keep the smallest prefix whose mass reaches top_p; the best token always survives.
        drop_sorted = mass_before >= sampling.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of `probs` ([..., V]); returns token ids shaped like probs[..., 0].
    By inverting each row's distribution at a uniform number (`sample_at`): on the CPU
    `torch.multinomial` over a 151,936-id vocabulary draws an exponential per id (milliseconds
    a draw), where this reads each probability once."""
    flat = probs.reshape(-1, probs.shape[-1])
    device = generator.device if generator is not None else flat.device
    uniform = torch.rand((flat.shape[0], 1), generator=generator, dtype=torch.float64, device=device)
    return sample_at(flat, uniform.to(flat.device)).reshape(probs.shape[:-1])


SAMPLE_BLOCK = 1024  # ids per block of `sample_at`'s two-level search


def sample_at(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The token of each row of `probs` ([..., V], with mass) where its cumulative
    distribution first exceeds `uniform` ([..., 1], in [0, 1)) times the row's mass; shaped
    like `uniform`. An exact draw for a uniform `uniform`, and never a token of probability
    0 (the first index past the target adds mass). Device operations only (no host round
    trip), so that a CUDA graph can hold it.

    In two levels, in float64: the block of SAMPLE_BLOCK ids holding the target, from the
    blocks' masses, then the id inside it, so that only one block is summed id by id."""
    shape = uniform.shape
    rows = probs.reshape(-1, probs.shape[-1])
    count, vocab = rows.shape
    pad = (-vocab) % SAMPLE_BLOCK
    blocks = (torch.nn.functional.pad(rows, (0, pad)) if pad else rows).view(count, -1, SAMPLE_BLOCK)
    cdf = blocks.sum(dim=-1, dtype=torch.float64).cumsum(dim=-1)  # [rows, blocks]
    mass = cdf[:, -1:]
    # Strictly below the mass, even where the product rounds up to it.
    target = torch.minimum(uniform.reshape(count, 1).double() * mass, torch.nextafter(mass, torch.zeros_like(mass)))
    block = torch.searchsorted(cdf, target, right=True).clamp_max_(cdf.shape[-1] - 1)  # [rows, 1]
    before = torch.where(block > 0, cdf.gather(-1, (block - 1).clamp_min(0)), torch.zeros_like(target))
    inside = blocks.gather(1, block.unsqueeze(-1).expand(count, 1, SAMPLE_BLOCK)).squeeze(1)  # [rows, SAMPLE_BLOCK]
    offset = torch.searchsorted(inside.double().cumsum(dim=-1), target - before, right=True)
    # The block's own sum and its running sum may round apart: never past its last id with mass.
    last = SAMPLE_BLOCK - 1 - torch.argmax((inside.flip(-1) > 0).to(torch.uint8), dim=-1, keepdim=True)
    return (block * SAMPLE_BLOCK + torch.minimum(offset, last)).reshape(shape)


def accept_mask(p_of_draft: torch.Tensor, q_of_draft: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Accept each drafted x with probability min(1, p(x)/q(x)).

    Written as u * q < p so that q(x) = 0 (accept whenever p(x) > 0) and p(x) = 0
    (never accept) need no division and can never produce NaN.
    """
    return uniform * q_of_draft < p_of_draft


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last dimension.

    After a rejection the residual always has mass in exact arithmetic; where rounding
    leaves none (p == q), falling back to p is the correct limit.
    """
    residual = torch.clamp(p - q, min=0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(p.dtype).tiny), p)


@dataclass(frozen=True)
class Verdict:
    """The outcome of verifying a draft, chain or tree (speccli.tree): the accepted nodes,
    root to leaf (a chain's node i is its i-th token), and the target's own next token:
    `resampled` after a rejection, else a bonus (or the target's token, when nothing
    was drafted)."""

    path: list[int]
    next_token: int
    resampled: bool = False

    @property
    def accepted(self) -> int:
        return len(self.path)

    @classmethod
    def chain(cls, accepted: int, next_token: int, drafted: int) -> Verdict:
        """The verdict on a chain of `drafted` tokens whose first `accepted` survived."""
        return cls(list(range(accepted)), next_token, resampled=accepted < drafted)


def verify_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> Verdict:
    """target_logits: [n+1, V] (row i scores the token after draft position i-1);
    draft_tokens: [n]. A draft token survives iff it equals the target's argmax.

    Decided where the logits are (a GPU), with one copy of the outcome to the host."""
    best = torch.argmax(target_logits, dim=-1)
    n = draft_tokens.shape[0]
    survived = surviving(best[:n] == draft_tokens.to(best.device))
    accepted, token = _to_host(survived, best.gather(0, survived.view(1))[0])
    return Verdict.chain(accepted, token, n)


def surviving(accept: torch.Tensor) -> torch.Tensor:
    """How many leading entries of the bool vector `accept` are True (0-d, on its device)."""
    return accept.to(torch.int64).cumprod(0).sum()


def _to_host(*scalars: torch.Tensor) -> list[int]:
    """0-d tensors to Python ints in one device-to-host copy (one wait for the device)."""
    return torch.stack(scalars).tolist()


def verify_sampled(
    p: torch.Tensor,
    draft_tokens: torch.Tensor,
    q: torch.Tensor | None,
    generator: torch.Generator | None,
) -> Verdict:
    """The lossless rule of Leviathan et al. / Chen et al.

    p: [n+1, V] warped target probabilities; draft_tokens: [n]; q: [n, V] warped draft
    probabilities, or None for a deterministic drafter (q one-hot at the drafted token).

    Decided on p's device with one copy of the outcome to the host: the next token is drawn
    from norm(max(0, p - q)) at the first rejected position, or from p at the bonus position
    n, where q is taken as zero (the residual of p and nothing is p itself).
    """
    n = draft_tokens.shape[0]
    draft_tokens = draft_tokens.to(p.device)
    if n:
        rows = torch.arange(n, device=p.device)
        p_of_draft = p[rows, draft_tokens]
        q_of_draft = torch.ones_like(p_of_draft) if q is None else q[rows, draft_tokens]
        uniform = torch.rand(n, generator=generator, device=p.device)
        survived = surviving(accept_mask(p_of_draft, q_of_draft, uniform))
    else:
        survived = torch.zeros((), dtype=torch.int64, device=p.device)
    at = survived.view(1)
    rejected = (survived < n).to(p.dtype)
    if q is None:
        drafted = torch.cat([draft_tokens, draft_tokens.new_zeros(1)]).gather(0, at)
        q_row = torch.zeros_like(p[0]).scatter_(0, drafted, rejected.view(1))
    else:
        q_row = torch.cat([q.to(p.dtype), torch.zeros_like(p[:1])]).index_select(0, at)[0]
    residual = residual_distribution(p.index_select(0, at)[0], q_row)
    accepted, token = _to_host(survived, sample(residual, generator))
    return Verdict.chain(accepted, token, n)


def verify_coupled(p: torch.Tensor, draft_tokens: torch.Tensor, noise: torch.Tensor) -> Verdict:
    """p: [n+1, V] warped target probabilities; draft_tokens: [n]; noise: [n+1, V], row i
    the noise of the position p[i] decides. A drafted token survives iff it is the
    target's Gumbel-max token there; the next token is the target's own at the first
    position that did not survive (or the bonus position)."""
    return verify_greedy(perturbed(p, noise), draft_tokens)


def verify_chain(
    logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    noise: torch.Tensor | None = None,
) -> Verdict:
    """The rule the sampling settings call for: greedy; coupled, given the noise rows of the
    positions `logits` decide (a seeded generation, speccli.coupling); else the rejection rule."""
    if sampling.greedy:
        return verify_greedy(logits, draft_tokens)
    if noise is not None:
        return verify_coupled(warp(logits, sampling), draft_tokens, noise)
    q = None if draft_probs is None else draft_probs.to(logits.device)
    return verify_sampled(warp(logits, sampling), draft_tokens, q, generator)
