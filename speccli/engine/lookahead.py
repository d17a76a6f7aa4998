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
into a tree (speccli.engine.tree), in the same pass. The lookahead branch and the tree
never see each other, and only the accepted path stays in the cache, so the output is
exactly the target's.

W, N and G (n-grams verified) are chosen from the measured pass costs: the largest shape
whose pass costs little more than a one-token pass; where none does, plain decoding. With
k auto, `LookaheadGate` then runs plain steps while the pool finds nothing on the text at
hand (and tries lookahead again now and then).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch

from speccli.config import SamplingConfig
from speccli.engine.coupling import Noise
from speccli.engine.events import StepEvent
from speccli.engine.tree import TokenTree, TreeShape
from speccli.engine.tree_drafters import trie


@dataclass(frozen=True)
class LookaheadShape:
    window: int  # W: columns of the Jacobi window
    ngram: int  # N: tokens per n-gram (the window holds N - 1 levels)
    guesses: int  # G: pool n-grams verified per step

    @property
    def fed(self) -> int:
        """Tokens in one pass at most: the pending token, the window, the guesses."""
        return 1 + (self.window + self.guesses) * (self.ngram - 1)


# Largest first. The paper's GPU settings are larger (W 15, N 5, G 15); these fit the
# passes a CPU calibration measures (up to 17 tokens) and a GPU's flat region alike.
SHAPES = (
    LookaheadShape(10, 4, 6),  # 49 tokens
    LookaheadShape(7, 4, 4),  # 34
    LookaheadShape(5, 4, 3),  # 25
    LookaheadShape(5, 3, 3),  # 17
    LookaheadShape(4, 3, 2),  # 13
    LookaheadShape(3, 3, 2),  # 11
    LookaheadShape(2, 3, 1),  # 7
)
DEFAULT_SHAPE = LookaheadShape(5, 3, 3)
# A lookahead pass may cost this much more than a one-token pass: the tokens a step gains
# (about 1.3 to 2 per pass in the paper) must pay for it.
AFFORDABLE = 1.35
POOL_PER_TOKEN = 8  # n-grams kept per first token, the latest


def choose_shape(pass_seconds: dict[int, float] | None) -> LookaheadShape | None:
    """The largest shape whose pass costs at most AFFORDABLE x a one-token pass, from
    measured costs; None (plain decoding) when even the smallest costs more; the default
    without measurements."""
    if not pass_seconds or 1 not in pass_seconds:
        return DEFAULT_SHAPE
    one = pass_seconds[1]
    for shape in SHAPES:
        measured = [seconds for fed, seconds in pass_seconds.items() if fed >= shape.fed]
        if not measured:
            continue  # larger than anything measured: unknown, not assumed cheap
        if min(measured) <= AFFORDABLE * one:
            return shape
    return None


@dataclass(frozen=True)
class Branch:
    """The lookahead branch of one pass: its tokens, their positions past the pending
    token's, and which of them each sees ([m, m]; every one also sees the pending token)."""

    tokens: list[int]
    offsets: list[int]
    visible: torch.Tensor

    def __len__(self) -> int:
        return len(self.tokens)

    def beside(self, tree_visible: torch.Tensor) -> torch.Tensor:
        """The visibility of [pending, tree nodes, branch tokens]: the tree's block, this
        branch's block, and the pending token for every branch token."""
        n, m = tree_visible.shape[0], len(self.tokens)
        visible = torch.zeros((n + m, n + m), dtype=torch.bool)
        visible[:n, :n] = tree_visible
        visible[n:, 0] = True
        visible[n:, n:] = self.visible
        return visible


class LookaheadDrafter:
    """Lookahead decoding's guesses: a Jacobi window advanced inside each verification
    pass, and a pool of n-grams verified as a tree."""

    name = "lookahead"
    # Every step verifies a tree (the pool's n-grams) and carries the lookahead branch.
    verifies_trees = True

    def __init__(self, shape: LookaheadShape | None = DEFAULT_SHAPE) -> None:
        self.shape = shape
        self.pool: dict[int, OrderedDict[tuple[int, ...], None]] = {}
        self.levels: list[list[int]] = []
        self._indexed = 0  # context n-grams starting before this are in the pool

    def configure(self, shape: LookaheadShape | None) -> None:
        if shape != self.shape:
            self.shape = shape
            self.levels = []
            self.pool = {}  # its n-grams have the old shape's length
            self._indexed = 0

    def start(self, context: Sequence[int]) -> None:
        """Seed the pool with the context's own n-grams; the window starts again from the
        context's tokens (any tokens do: the window converges by itself)."""
        self.levels = []
        self._indexed = 0
        self._index(context)

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

    def propose(self, context, k, sampling, generator, noise=None):  # noqa: ANN001 - the Drafter protocol
        """As a chain: the latest pool n-gram that starts with the pending token (the
        decoder verifies trees with this drafter; this serves callers that want a chain)."""
        from speccli.engine.drafters import Draft

        entries = self.pool.get(context[-1]) if self.shape is not None else None
        return Draft(list(next(reversed(entries))[:k]) if entries and k > 0 else [])

    def propose_tree(
        self,
        context: Sequence[int],
        shape: TreeShape,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        noise: Noise | None = None,
    ) -> TokenTree:
        """The pool's n-grams that start with the pending token, the latest first."""
        if self.shape is None or shape.max_depth <= 0:
            return TokenTree([], [])
        self._index(context)
        entries = self.pool.get(context[-1], {})
        latest = list(reversed(list(entries)))[: self.shape.guesses]
        return trie([list(c[: shape.max_depth]) for c in latest], shape.max_nodes)

    def branch(self, context: Sequence[int]) -> Branch | None:
        """This pass's lookahead branch (None without a shape)."""
        if self.shape is None:
            return None
        width = self.shape.window
        if not self.levels:
            start = list(context[-width:])
            self.levels = [(start * width)[:width]]
        tokens: list[int] = []
        offsets: list[int] = []
        for level, row in enumerate(self.levels):
            tokens += row
            offsets += [1 + column + level for column in range(width)]
        visible = torch.zeros((len(tokens), len(tokens)), dtype=torch.bool)
        for level in range(len(self.levels)):
            for column in range(width):
                row = level * width + column
                visible[row, :column + 1] = True  # level 0, columns 0..j
                for earlier in range(1, level + 1):
                    visible[row, earlier * width + column] = True
        return Branch(tokens, offsets, visible)

    def advance(self, guesses: Sequence[int]) -> None:
        """The target's argmax for every branch token (in branch order): the newest level's
        become a new level, and full columns become n-grams."""
        width = self.shape.window
        newest = list(guesses[-width:])
        if len(self.levels) == self.shape.ngram - 1:
            for column in range(width):
                self._remember(tuple(row[column] for row in self.levels) + (newest[column],))
            self.levels = self.levels[1:]
        self.levels.append(newest)

    def rollback(self, length: int) -> None:
        """The pool holds guesses, right or wrong, and the window is relative to the
        pending token: only the record of what text was pooled goes back."""
        self._indexed = min(self._indexed, max(0, length - (self.shape.ngram if self.shape else 0) + 1))


class LookaheadGate:
    """k auto for lookahead decoding: lookahead steps, but plain steps while the pool's
    n-grams keep failing.

    A lookahead step's pass is larger than a plain step's (the window rides along). On text
    that never repeats itself the pool's guesses never come true and every step pays that
    extra for nothing (0.75x plain decoding on an H200 with random-weight models). After
    `patience` lookahead steps in a row that accepted nothing, plain steps follow; after
    `probe_every` of them (doubled after each probe that found nothing too, up to
    `max_backoff` doublings) lookahead steps are tried again. The rule counts tokens, not
    seconds: the choice of the window's shape already weighed the pass costs, and a
    step's seconds are too noisy on a shared CPU to judge a few steps by (a rule that
    compared moving averages of them turned lookahead off on a CPU where it paid, 1.16x
    plain decoding instead of 1.38x).
    """

    def __init__(self, k: int, patience: int = 8, probe_every: int = 16, max_backoff: int = 3) -> None:
        if k < 1 or patience < 1:
            raise ValueError(f"k and patience must be >= 1, got {k}, {patience}")
        self.k = k
        self.patience = patience
        self.probe_every = probe_every
        self.max_backoff = max_backoff
        self.on = True
        self._fruitless = 0  # lookahead steps in a row that accepted nothing
        self._plain_steps = 0  # plain steps since lookahead went off
        self._failed_runs = 0

    def next_k(self) -> int:
        interval = self.probe_every * 2 ** min(self._failed_runs - 1, self.max_backoff)
        if not self.on and self._plain_steps >= interval:
            self.on, self._fruitless = True, 0
        return self.k if self.on else 0

    def observe(self, step: StepEvent) -> None:
        if not step.tree or step.fed <= 1:  # a plain step
            self._plain_steps += 1
            return
        if step.accepted > 0:
            self._fruitless, self._failed_runs = 0, 0
            return
        self._fruitless += 1
        if self._fruitless >= self.patience and self.on:
            self.on, self._plain_steps = False, 0
            self._failed_runs += 1
