"""Where candidate tokens come from.

A drafter proposes up to k tokens that continue the context, with the draft
probabilities q they were drawn from (None when the proposal is deterministic, which
the verification rule treats as a one-hot q).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from speccli.autok.costs import CostCurve
from speccli.autok.policy import DraftLengthPolicy, FixedDraftLength, StepPlan
from speccli.backends.base import CausalLM
from speccli.config import SamplingConfig
from speccli.coupling import Noise, gumbel_argmax
from speccli.tree import Branch, TokenTree, TreeShape
from speccli.verify import sample, warp


@dataclass(frozen=True)
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), V_target] warped q, or None for one-hot

    def __len__(self) -> int:
        return len(self.tokens)


class Drafter:
    """Where guesses come from: everything the decoder may ask of a drafter.

    Every drafter implements `start`, `propose` and `rollback`. What else it can do it
    declares in the capability attributes below; the methods that go with a capability have
    defaults that do nothing, which is right for a drafter without it. The decoder calls
    the methods its step needs, without asking what the drafter is.
    """

    name: str = "drafter"
    # A draft model of its own: it catches up on the context before drafting (timed apart),
    # and one-time setup inside its passes (a CUDA graph capture) is kept out of timings.
    draft_model: CausalLM | None = None
    # Drafts from the target's hidden states (Medusa, EAGLE): the decoder makes the target
    # keep them and hands them over (`features_from`, `observe_features`).
    needs_hidden: bool = False
    # Which features: None for the target's last hidden state (the output layer's input);
    # else the inputs of these decoder layers, concatenated (EAGLE-3 reads three).
    feature_layers: tuple[int, ...] | None = None
    # Can propose a token tree (`propose_tree`), for `--tree`.
    drafts_trees: bool = False
    # Drafts what followed an earlier occurrence of the context's last n-gram: k auto keeps
    # acceptance apart by the length matched (`match_length`), starting for each length from
    # these acceptances by draft position. None: not such a drafter.
    match_acceptance: Mapping[int, tuple[float, ...]] | None = None
    # Every drafting step is a tree step of its own (lookahead, with a shape): the policy
    # plans each (`plan_step`), and a branch may ride in the pass (`branch`, `advance`).
    always_trees: bool = False
    # Prompt lookup's guess inside the last tree (lookahead), to count what it alone kept.
    guess: Sequence[int] = ()

    @property
    def keyed_by_match(self) -> bool:
        return self.match_acceptance is not None

    def start(self, context: Sequence[int]) -> None:
        """A new generation begins from `context` (state from an earlier one may be reused)."""
        raise NotImplementedError

    def propose(
        self,
        context: Sequence[int],
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        noise: Noise | None = None,
    ) -> Draft:
        """Up to k tokens continuing `context`.

        With `noise` (coupled sampling, speccli.coupling), a sampling drafter draws
        its i-th token as argmax(log q + noise(i)) instead of from `generator`: the noise
        the target's token at that position is drawn with, so the two agree as often as
        they can. A deterministic drafter ignores it."""
        raise NotImplementedError

    def rollback(self, length: int) -> None:
        """Only context[:length] is settled; forget anything drafted past it."""
        raise NotImplementedError

    def policy(
        self, k: int | str, measured: CostCurve | None, adaptive: Callable[[], DraftLengthPolicy]
    ) -> DraftLengthPolicy:
        """The draft-length policy for a generation with draft length `k` (a number, or
        "auto": `adaptive` builds k auto's), given the measured pass costs (or None)."""
        return FixedDraftLength(k) if isinstance(k, int) else adaptive()

    def catch_up(self, context: Sequence[int]) -> None:
        """Before a drafting step: read what of the context the drafter has not read."""

    def propose_tree(
        self,
        context: Sequence[int],
        shape: TreeShape,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        noise: Noise | None = None,
    ) -> TokenTree:
        """A tree of candidates within `shape` (drafters with `drafts_trees`)."""
        raise NotImplementedError(f"the {self.name} drafter does not draft trees")

    def settle_tree(self, path: Sequence[int], settled: int) -> None:
        """The target accepted `path` (node indices) of the last tree, and context[:settled] is settled."""
        self.rollback(settled)

    def match_length(self, context: Sequence[int]) -> int:
        """The length of the n-gram the coming draft continues (drafters `keyed_by_match`)."""
        return 0

    def features_from(self, context: Sequence[int]) -> int:
        """The first position of `context` whose feature this drafter lacks (`needs_hidden`)."""
        return len(context)

    def observe_features(self, start: int, features: torch.Tensor) -> None:
        """features [n, hidden]: the target's, at positions start .. start + n - 1, all settled."""

    def plan_step(self, plan: StepPlan) -> None:
        """The form the policy chose for the coming step (drafters with `always_trees`)."""

    def pool_candidates(self, context: Sequence[int]) -> int:
        """How many pooled guesses the coming step could offer (lookahead's n-grams)."""
        return 0

    def branch(self, context: Sequence[int]) -> Branch | None:
        """Tokens that ride in the coming tree pass without being drafts (lookahead's window)."""
        return None

    def advance(self, guesses: Sequence[int]) -> None:
        """The target's argmax at every token of the branch that rode in the last pass."""


def draw(
    row: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None, noise: torch.Tensor | None
) -> tuple[int, torch.Tensor | None, float]:
    """One draft token from logits `row` [V_target]: (token, the warped q it was drawn
    from or None when greedy, the draft's own probability of it). With `noise`, the
    coupled draw argmax(log q + noise) (speccli.coupling)."""
    if sampling.greedy:
        token, confidence = greedy_pick(row)
        return int(token), None, float(confidence)
    q = warp(row, sampling)
    token = int(sample(q, generator) if noise is None else gumbel_argmax(q, noise))
    return token, q, float(q[token])


def greedy_pick(row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The argmax of logits `row` [V] and the draft's own probability of it, both [1]."""
    token = torch.argmax(row, dim=-1, keepdim=True)
    return token, torch.exp(row.gather(-1, token) - torch.logsumexp(row, dim=-1, keepdim=True))


def align_vocab(logits: torch.Tensor, vocab_size: int, usable: int | None = None) -> torch.Tensor:
    """Bring a draft model's logits to the target's vocabulary size, keeping only the
    first ``usable`` ids (default: all the draft has) and giving the rest -inf.

    Embedding matrices are often padded to different sizes, and one tokenizer may know
    more ids than the other; a padded row is not a token, nor is an id only one side
    knows. The draft samples from the aligned distribution, so q is exactly what it
    drew from and the rule stays lossless.
    """
    size = logits.shape[-1]
    keep = min(size, vocab_size, size if usable is None else usable)
    if keep == size == vocab_size:
        return logits
    pad = logits.new_full((*logits.shape[:-1], vocab_size - keep), float("-inf"))
    return torch.cat([logits[..., :keep], pad], dim=-1)
