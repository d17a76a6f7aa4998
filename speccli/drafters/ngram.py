"""Prompt lookup: the draft is what followed an earlier occurrence of the n-gram that ends
the context. No model pass; the proposal is deterministic (a one-hot q)."""

from __future__ import annotations

from typing import Sequence

import torch

from speccli.autok.costs import CostCurve
from speccli.autok.plan import DraftSignal, ShadowGuess
from speccli.autok.policy import DraftLengthPolicy, FixedDraftLength, KAutoFactory
from speccli.config import SamplingConfig
from speccli.coupling import Noise
from speccli.drafters.base import Draft, Drafter, TreeDraft
from speccli.drafters.trees import trie
from speccli.tree import TokenTree, TreeShape

# Earlier occurrences of an n-gram prompt lookup remembers (the latest ones): each can
# offer a branch of a tree.
OCCURRENCES_KEPT = 4

# What prompt lookup's drafts come true at, by the length of the n-gram matched: k auto's
# prior for each (speccli.autok.policy.DraftLengthByMatch), by draft position (the last
# standing for the later ones). Rounded from what came true over the default target's
# greedy answers to the default prompts (float32 and bfloat16 alike): far more often after
# a longer match; on chat text, less often still after a 1-token match.
LOOKUP_ACCEPTANCE: dict[int, tuple[float, ...]] = {1: (0.25, 0.4), 2: (0.4, 0.5), 3: (0.8, 0.9, 0.95)}

# How far the guess reaches that `signal` keeps, to learn from where another drafter drafts.
SHADOW_LENGTH = 16


class PromptLookupDrafter(Drafter):
    """Prompt lookup decoding: find the longest n-gram (max_ngram down to min_ngram) that
    ends the context and occurred earlier in it; the tokens that followed that earlier
    occurrence are the draft. Costs no model pass; q is one-hot.

    The n-gram index is built incrementally, so each step costs time proportional to the
    tokens added, not to the context length.
    """

    name = "ngram"
    drafts_trees = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._reset()

    def _reset(self) -> None:
        # For each n: n-gram -> end indices (exclusive) of its latest occurrences that have a
        # continuation, the latest last.
        self._index: dict[int, dict[tuple[int, ...], list[int]]] = {
            n: {} for n in range(self.min_ngram, self.max_ngram + 1)
        }
        self._indexed_upto = 0
        # The guess `signal` saw for the coming step: (context length then, match, guess).
        self._guessed: tuple[int, int, list[int]] | None = None

    def start(self, context: Sequence[int]) -> None:
        self._reset()

    def policy(
        self,
        k: int | str,
        measured: CostCurve | None,
        adaptive: KAutoFactory,
    ) -> DraftLengthPolicy:
        """k auto keeps acceptance apart by the length matched (DraftLengthByMatch)."""
        return FixedDraftLength(k) if isinstance(k, int) else adaptive(LOOKUP_ACCEPTANCE)

    def signal(self, context: Sequence[int]) -> DraftSignal:
        """The match for the coming step, and how the guess it would have drafted for the last
        step fared against what that step settled (for k auto where drafters take turns)."""
        match = self.match_length(context)
        shadow = self._shadow_of(context)
        guess = self._continuation(context, match, SHADOW_LENGTH) if match else []
        self._guessed = (len(context), match, guess)
        return DraftSignal(match=match, shadow=shadow)

    def _shadow_of(self, context: Sequence[int]) -> ShadowGuess | None:
        if self._guessed is None:
            return None
        start, match, guess = self._guessed
        return ShadowGuess.against(match, guess, context[start:])

    def _continuation(self, context: Sequence[int], match: int, k: int) -> list[int]:
        end = self._index[match][tuple(context[len(context) - match :])][-1]
        return list(context[end : end + k])

    def _extend_index(self, context: Sequence[int]) -> None:
        # An n-gram ending at `end` has a continuation iff end < len(context).
        for end in range(max(self._indexed_upto, 1), len(context)):
            for n, table in self._index.items():
                if end >= n:
                    ends = table.setdefault(tuple(context[end - n : end]), [])
                    ends.append(end)
                    if len(ends) > OCCURRENCES_KEPT:
                        del ends[0]
        self._indexed_upto = max(self._indexed_upto, len(context))

    def propose(
        self,
        context: Sequence[int],
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        noise: Noise | None = None,
    ) -> Draft:
        match = self.match_length(context) if k > 0 else 0
        return Draft(self._continuation(context, match, k) if match else [])

    def match_length(self, context: Sequence[int]) -> int:
        """The length of the longest n-gram ending the context that occurred earlier (0:
        none): the draft is what followed it."""
        self._extend_index(context)
        for n in range(min(self.max_ngram, len(context)), self.min_ngram - 1, -1):
            if self._index[n].get(tuple(context[len(context) - n :])):
                return n
        return 0

    def propose_tree(
        self,
        context: Sequence[int],
        shape: TreeShape,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        noise: Noise | None = None,
    ) -> TreeDraft:
        """The continuations of several earlier occurrences, the longest matching n-grams'
        and the latest first, merged into a tree."""
        if shape.max_depth <= 0:
            return TreeDraft(TokenTree([], []))
        self._extend_index(context)
        length = len(context)
        continuations: list[list[int]] = []
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if length < n:
                continue
            for end in reversed(self._index[n].get(tuple(context[length - n :]), [])):
                continuation = list(context[end : end + shape.max_depth])
                if continuation not in continuations:
                    continuations.append(continuation)
        return TreeDraft(trie(continuations, shape.max_nodes))

    def rollback(self, length: int) -> None:
        if length < self._indexed_upto:
            # Only settled context is indexed; a shorter one means a different text.
            self._reset()
