"""Pure tensor functions: warping logits, sampling, and the two verification rules.

Every function works on the last dimension (the vocabulary) and accepts leading batch
dimensions where that makes sense, so tests can draw hundreds of thousands of samples
through the very code the decoder uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speccli.config import SamplingConfig


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
    """One draw per row of `probs` ([..., V]); returns token ids shaped like probs[..., 0]."""
    flat = probs.reshape(-1, probs.shape[-1])
    draws = torch.multinomial(flat, 1, generator=generator)
    return draws.reshape(probs.shape[:-1])


def accept_mask(
    p_of_draft: torch.Tensor, q_of_draft: torch.Tensor, uniform: torch.Tensor
) -> torch.Tensor:
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
    """The outcome of verifying one draft: how many drafted tokens survive and the
    target's own next token (resampled after a rejection, or a bonus if all survived)."""

    accepted: int
    next_token: int

    def all_accepted(self, drafted: int) -> bool:
        return self.accepted == drafted


def verify_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> Verdict:
    """target_logits: [n+1, V] (row i scores the token after draft position i-1);
    draft_tokens: [n]. A draft token survives iff it equals the target's argmax."""
    best = torch.argmax(target_logits, dim=-1)
    n = draft_tokens.shape[0]
    mismatches = (best[:n] != draft_tokens).nonzero()
    accepted = int(mismatches[0, 0]) if mismatches.numel() else n
    return Verdict(accepted=accepted, next_token=int(best[accepted]))


def verify_sampled(
    p: torch.Tensor,
    draft_tokens: torch.Tensor,
    q: torch.Tensor | None,
    generator: torch.Generator | None,
) -> Verdict:
    """The lossless rule of Leviathan et al. / Chen et al.

    p: [n+1, V] warped target probabilities; draft_tokens: [n]; q: [n, V] warped draft
    probabilities, or None for a deterministic drafter (q one-hot at the drafted token).
    """
    n = draft_tokens.shape[0]
    if n:
        rows = torch.arange(n, device=p.device)
        p_of_draft = p[rows, draft_tokens]
        q_of_draft = torch.ones_like(p_of_draft) if q is None else q[rows, draft_tokens]
        uniform = torch.rand(n, generator=generator, device=p.device)
        rejected = (~accept_mask(p_of_draft, q_of_draft, uniform)).nonzero()
        accepted = int(rejected[0, 0]) if rejected.numel() else n
    else:
        accepted = 0
    if accepted == n:
        return Verdict(accepted=n, next_token=int(sample(p[n], generator)))
    if q is None:
        q_row = torch.zeros_like(p[accepted])
        q_row[draft_tokens[accepted]] = 1.0
    else:
        q_row = q[accepted]
    residual = residual_distribution(p[accepted], q_row)
    return Verdict(accepted=accepted, next_token=int(sample(residual, generator)))
