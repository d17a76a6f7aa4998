"""Where candidate tokens come from.

A drafter proposes up to k tokens that continue the context, with the draft
probabilities q they were drawn from (None when the proposal is deterministic, which
the verification rule treats as a one-hot q).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch

from speccli.autok.costs import CostCurve
from speccli.autok.plan import DraftSignal, StepPlan
from speccli.autok.policy import DraftLengthPolicy, FixedDraftLength, KAutoFactory
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


@dataclass(frozen=True)
class TreeDraft:
    """A drafted token tree, and what rides in its verification pass beside it."""

    tree: TokenTree
    # Tokens the pass carries without being drafts (lookahead's Jacobi window): the target's
    # argmax at each comes back to the drafter in `Settled.branch_guesses`.
    branch: Branch | None = None
    # Prompt lookup's guess inside the tree (lookahead, or grafted into another's), to count
    # what it alone kept.
    guess: Sequence[int] = ()
    # Where a guess was grafted in: how many of the tree's nodes (the first ones) are the
    # drafter's own.
    own: int | None = None


@dataclass(frozen=True)
class Settled:
    """What a step settled: context[:length], reached along `path` (node indices) of the last
    tree (None after a chain); `branch_guesses` when a branch rode in the pass."""

    length: int
    path: Sequence[int] | None = None
    branch_guesses: Sequence[int] | None = None


class FeatureReader(Protocol):
    """A drafter that drafts from the target's features (Medusa, EAGLE): the decoder makes
    the target keep them and hands them over."""

    # Which features: None for the target's last hidden state (the output layer's input);
    # else the inputs of these decoder layers, concatenated (EAGLE-3 reads three).
    @property
    def feature_layers(self) -> tuple[int, ...] | None: ...

    def features_from(self, context: Sequence[int]) -> int:
        """The first position of `context` whose feature this drafter lacks."""
        ...

    def observe_features(self, start: int, features: torch.Tensor) -> None:
        """features [n, hidden]: the target's, at positions start .. start + n - 1, all settled."""
        ...


@runtime_checkable
class LearnsText(Protocol):
    """A drafter that learns from whole texts (suffix drafting): after each generation, the
    Speculator hands it the prompt and the answer."""

    def learn_text(self, tokens: Sequence[int]) -> None: ...


class Drafter:
    """Where guesses come from: everything the decoder asks of a drafter.

    Every drafter implements `start`, `propose` and `rollback`. What else it can do it
    declares in the capability attributes below; the methods that go with a capability have
    defaults that do nothing, which is right for a drafter without it. What is particular
    to one method (lookahead's window, prompt lookup's match) lives with its drafter and
    reaches the decoder through these members alone: the policy reads the drafter's
    `signal`, returns a StepPlan, and the decoder carries it out.
    """

    name: str = "drafter"
    # Can propose a token tree (`propose_tree`), for `--tree`.
    drafts_trees: bool = False

    @property
    def draft_model(self) -> CausalLM | None:
        """A draft model of its own: one-time setup inside its passes (a CUDA graph capture)
        is kept out of the steps' timings."""
        return None

    @property
    def features(self) -> FeatureReader | None:
        """What reads the target's features, for a drafter that drafts from them."""
        return None

    def start(self, context: Sequence[int]) -> None:
        """A new generation begins from `context` (state from an earlier one may be reused)."""
        raise NotImplementedError

    def policy(
        self,
        k: int | str,
        measured: CostCurve | None,
        adaptive: KAutoFactory,
    ) -> DraftLengthPolicy:
        """The policy for a generation with draft length `k` (a number, or "auto": `adaptive`
        builds k auto's, for drafts whose acceptance is keyed by the length of the n-gram
        they continue given the acceptance such drafts start from), given the measured pass
        costs (or None)."""
        return FixedDraftLength(k) if isinstance(k, int) else adaptive(None)

    def signal(self, context: Sequence[int]) -> DraftSignal:
        """What the coming step's policy reads before it plans (prompt lookup's match)."""
        return DraftSignal()

    def prepare(self, context: Sequence[int], plan: StepPlan) -> None:
        """Before a drafting step: the plan it carries out; a draft model reads what of the
        context it has not (timed apart from drafting)."""

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

    def propose_tree(
        self,
        context: Sequence[int],
        shape: TreeShape,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        noise: Noise | None = None,
    ) -> TreeDraft:
        """A tree of candidates within `shape` (drafters with `drafts_trees`)."""
        raise NotImplementedError(f"the {self.name} drafter does not draft trees")

    def settle(self, settled: Settled) -> None:
        """The target settled context[:settled.length] (see Settled)."""
        self.rollback(settled.length)

    def rollback(self, length: int) -> None:
        """Only context[:length] is settled; forget anything drafted past it."""
        raise NotImplementedError


class PlainDecoding(Drafter):
    """No drafter: every step is a plain one."""

    name = "none"

    def start(self, context: Sequence[int]) -> None:
        pass

    def policy(
        self,
        k: int | str,
        measured: CostCurve | None,
        adaptive: KAutoFactory,
    ) -> DraftLengthPolicy:
        return FixedDraftLength(0)

    def propose(
        self,
        context: Sequence[int],
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        noise: Noise | None = None,
    ) -> Draft:
        return Draft([])

    def rollback(self, length: int) -> None:
        pass


def draw(
    row: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None, noise: torch.Tensor | None
) -> tuple[int, torch.Tensor | None, float]:
    """One draft token from logits `row` [V_target]: (token, the warped q it was drawn
    from or None when greedy, the draft's own probability of it). With `noise`, the
    coupled draw argmax(log q + noise) (speccli.coupling)."""
    if sampling.greedy:
        picked, confidence = greedy_pick(row)
        return int(picked), None, float(confidence)
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
