"""Lookahead decoding (Fu et al. 2024): guesses from the target itself, no draft model.

Each verification pass also carries a *lookahead branch*: a window of W columns by up to
N - 1 levels of Jacobi guesses for the tokens after the pending one. The token at level l,
column j sits at position (pending + 1 + j + l) and attends to the pending token, to level
0's columns 0..j and to its own column's levels 1..l: one causal sequence, so its logits
guess the token after it (a Jacobi iteration). The newest level's guesses become the next
step's newest level (the oldest is dropped once N - 1 levels are held), and every column,
read down its levels plus the new guess, is an n-gram the target itself suggested:
(level 0, ..., level N-2, guess). Those n-grams, and the text's own (prompt and output),
fill a pool keyed by first token; the pool's n-grams that start with the pending token are verified, merged
into a tree (speccli.tree), in the same pass, with what followed the text's last
tokens where they occurred before (prompt lookup's guess: n-grams are only N tokens long,
while code and rewrites copy longer runs). The lookahead branch and the tree
never see each other, and only the accepted path stays in the cache, so the output is
exactly the target's.

Which shape (W, N, G), and in which steps the window and the pool ride, is k auto's choice:
speccli.autok.lookahead.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace
from typing import Sequence

import torch

from speccli.autok.costs import CostCurve
from speccli.autok.lookahead import DEFAULT_SHAPE, FixedLookahead, LookaheadGate, LookaheadShape, choose_shape
from speccli.autok.plan import DraftSignal, StepPlan
from speccli.autok.policy import DraftLengthPolicy, FixedDraftLength, KAutoFactory
from speccli.backends.base import common_prefix_length
from speccli.config import SamplingConfig
from speccli.coupling import Noise
from speccli.drafters.base import Draft, Drafter, Settled, TreeDraft
from speccli.drafters.ngram import LOOKUP_ACCEPTANCE, PromptLookupDrafter
from speccli.drafters.trees import trie
from speccli.tree import Branch, TokenTree, TreeShape

POOL_PER_TOKEN = 8  # n-grams kept per first token, the latest


class LookaheadDrafter(Drafter):
    """Lookahead decoding's guesses: a Jacobi window advanced inside each verification
    pass, and a pool of n-grams verified as a tree."""

    name = "lookahead"
    drafts_trees = True

    def __init__(self, shape: LookaheadShape | None = DEFAULT_SHAPE) -> None:
        self.shape = shape
        self.pool: dict[int, OrderedDict[tuple[int, ...], None]] = {}
        self.levels: list[list[int]] = []
        self._indexed = 0  # context n-grams starting before this are in the pool
        self.lookup = PromptLookupDrafter()
        self.lookup_length = self._shortest_lookup()
        self._last_lookup: tuple[int, list[int]] | None = None  # (context length, the guess) of the last step
        self.held = False  # this step is prompt lookup's: k auto's gate holds lookahead back
        self.pool_verified = True  # this lookahead step's tree offers the pool's n-grams
        self.window_rides = True  # and the window rides along it
        self.guess_length: int | None = None  # prompt lookup's guess in a lookahead step (None: see _lookup_guess)

    def policy(
        self,
        k: int | str,
        measured: CostCurve | None,
        adaptive: KAutoFactory,
    ) -> DraftLengthPolicy:
        """The shape comes from the measured costs (k auto) or from k (the n-gram's
        continuation length); no shape: plain decoding with k 0, prompt lookup's steps with
        k auto (`adaptive`: prompt lookup's k auto, as `--draft ngram` drafts), so that
        lookahead is never below prompt lookup. Where a shape pays, k auto adds the window
        and the pool to prompt lookup's steps where they pay (LookaheadGate). With a shape, a
        lookahead step verifies a tree (the pool's n-grams and prompt lookup's guess) and
        carries the lookahead branch."""
        if isinstance(k, int):
            shape = replace(DEFAULT_SHAPE, ngram=k + 1) if k > 0 else None
            self.configure(shape)
            return FixedLookahead(shape.ngram - 1) if shape else FixedDraftLength(0)
        shape = choose_shape(measured)
        self.configure(shape)
        lookup = adaptive(LOOKUP_ACCEPTANCE)  # prompt lookup's k auto, its acceptance by match
        if shape is None:
            return lookup
        return LookaheadGate(shape, lookup, measured)

    def prepare(self, context: Sequence[int], plan: StepPlan) -> None:
        """Whether the step is prompt lookup's (no `plan.lookahead`: `LookaheadGate` holds
        lookahead back): its tree, with `--tree`, is prompt lookup's, and no window rides
        along. For a lookahead step, `guess_length` is how long a guess prompt lookup's k
        auto drafts (None: the guess's length follows what came true, see `_lookup_guess`),
        `pool` whether its tree offers the pool's n-grams beside the guess and `window`
        whether the window rides along."""
        lookahead = plan.lookahead
        self.held = lookahead is None
        if lookahead is not None:
            self.guess_length = lookahead.guess_length
            self.pool_verified = lookahead.pool
            self.window_rides = lookahead.window

    def signal(self, context: Sequence[int]) -> DraftSignal:
        """Prompt lookup's match, and how many of the pool's n-grams a lookahead step would
        offer now: those that start with the pending token, up to G."""
        pooled = 0
        if self.shape is not None:
            self._index(context)
            pooled = min(self.shape.guesses, len(self.pool.get(context[-1], ())))
        return DraftSignal(match=self.lookup.match_length(context), pooled=pooled)

    def configure(self, shape: LookaheadShape | None) -> None:
        if shape != self.shape:
            self.shape = shape
            self._forget()  # the pool's n-grams have the old shape's length

    def _forget(self) -> None:
        """Drop the pool, the window and what the lookup guess learned."""
        self.pool, self.levels, self._indexed = {}, [], 0
        self._last_lookup = None
        self.lookup_length = self._shortest_lookup()

    def start(self, context: Sequence[int]) -> None:
        """Seed the pool with the context's own n-grams; the window starts again from the
        context's tokens (any tokens do: the window converges by itself)."""
        self.levels = []
        self._indexed = 0
        self._index(context)
        self.lookup.start(context)
        self._last_lookup = None

    def _shortest_lookup(self) -> int:
        return self.shape.ngram - 1 if self.shape else 0

    def _lookup_guess(self, context: Sequence[int], longest: int) -> list[int]:
        """Prompt lookup's guess, `lookup_length` tokens long. The length doubles (up to
        `longest`, the tree's nodes) after a guess that came true whole and halves after one
        that came true less than half, so runs of copied text are taken in long strides and
        other text costs the pass little."""
        if self._last_lookup is not None:
            start, guess = self._last_lookup
            if start < len(context):
                right = common_prefix_length(guess, context[start:])
                if right == len(guess):
                    self.lookup_length = min(max(self._shortest_lookup(), longest), 2 * self.lookup_length)
                elif 2 * right < len(guess):
                    self.lookup_length = max(self._shortest_lookup(), self.lookup_length // 2)
        guess = self.lookup.propose(context, self.lookup_length, SamplingConfig(), None).tokens
        self._last_lookup = (len(context), guess) if guess else None
        return guess

    def _index(self, context: Sequence[int]) -> None:
        """Pool the context's n-grams not pooled yet (the prompt's, then the text's as it grows)."""
        if self.shape is None:
            return
        n = self.shape.ngram
        for i in range(self._indexed, len(context) - n + 1):
            self._remember(tuple(context[i : i + n]))
        self._indexed = max(self._indexed, len(context) - n + 1)

    def _remember(self, ngram: tuple[int, ...]) -> None:
        entries = self.pool.setdefault(ngram[0], OrderedDict())
        entries.pop(ngram[1:], None)
        entries[ngram[1:]] = None  # the latest last
        if len(entries) > POOL_PER_TOKEN:
            entries.popitem(last=False)

    def propose(
        self,
        context: Sequence[int],
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        noise: Noise | None = None,
    ) -> Draft:
        """As a chain, for the steps without lookahead (no shape pays, or the gate holds
        lookahead back): prompt lookup's draft, k tokens, as `--draft ngram` drafts."""
        return self.lookup.propose(context, k, sampling, generator, noise)

    def propose_tree(
        self,
        context: Sequence[int],
        shape: TreeShape,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        noise: Noise | None = None,
    ) -> TreeDraft:
        """Prompt lookup's guess, then the pool's n-grams that start with the pending token,
        the latest first, and the window to ride along (`branch`)."""
        if self.shape is None or self.held:
            return self.lookup.propose_tree(context, shape, sampling, generator, noise)  # `--tree` without lookahead
        if shape.max_depth <= 0:
            return TreeDraft(TokenTree([], []), self.branch(context))
        self._index(context)
        entries: Sequence[tuple[int, ...]] = list(self.pool.get(context[-1], {})) if self.pool_verified else []
        latest = [list(c[: shape.max_depth]) for c in reversed(entries)][: self.shape.guesses]
        if self.guess_length is None:
            guess = self._lookup_guess(context, shape.max_nodes)
        else:
            guess = self.lookup.propose(context, self.guess_length, SamplingConfig(), None).tokens
        return TreeDraft(trie([guess, *latest], shape.max_nodes), self.branch(context), guess)

    def branch(self, context: Sequence[int]) -> Branch | None:
        """This pass's lookahead branch (None without a shape, while held, or where the window does not ride)."""
        if self.shape is None or self.held or not self.window_rides:
            return None
        width = self.shape.window
        if not self.levels:
            start = list(context[-width:])
            self.levels = [(start * width)[:width]]
        tokens: list[int] = []
        offsets: list[int] = []
        for level, guesses in enumerate(self.levels):
            tokens += guesses
            offsets += [1 + column + level for column in range(width)]
        visible = torch.zeros((len(tokens), len(tokens)), dtype=torch.bool)
        for level in range(len(self.levels)):
            for column in range(width):
                row = level * width + column
                visible[row, : column + 1] = True  # level 0, columns 0..j
                for earlier in range(1, level + 1):
                    visible[row, earlier * width + column] = True
        return Branch(tokens, offsets, visible)

    def advance(self, guesses: Sequence[int]) -> None:
        """The target's argmax for every branch token (in branch order): the newest level's
        become a new level, and full columns become n-grams."""
        if self.shape is None:
            raise ValueError("lookahead without a shape has no window to advance")
        width = self.shape.window
        newest = list(guesses[-width:])
        if len(self.levels) == self.shape.ngram - 1:
            for column in range(width):
                self._remember(tuple(row[column] for row in self.levels) + (newest[column],))
            self.levels = self.levels[1:]
        self.levels.append(newest)

    def settle(self, settled: Settled) -> None:
        """The window advances by what the target guessed at it, where it rode in the pass."""
        if settled.branch_guesses is not None:
            self.advance(settled.branch_guesses)
        self.rollback(settled.length)

    def rollback(self, length: int) -> None:
        """The pool holds guesses, right or wrong, and the window is relative to the
        pending token: only the record of what text was pooled goes back. Back to nothing
        (a cold start) everything is forgotten, so no earlier generation's n-grams help."""
        self._indexed = min(self._indexed, max(0, length - (self.shape.ngram if self.shape else 0) + 1))
        self.lookup.rollback(length)
        if length == 0:
            self._forget()
