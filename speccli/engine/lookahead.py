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
into a tree (speccli.engine.tree), in the same pass, with what followed the text's last
tokens where they occurred before (prompt lookup's guess: n-grams are only N tokens long,
while code and rewrites copy longer runs). The lookahead branch and the tree
never see each other, and only the accepted path stays in the cache, so the output is
exactly the target's.

W, N and G (n-grams verified) are chosen from the measured pass costs: the shape with the
best expected tokens per second. Where none beats plain decoding, and with k auto while
`LookaheadGate` finds that prompt lookup's guess alone would do as well on the text at hand
(it tries lookahead steps again now and then), the steps are prompt lookup's with its own
k auto (`--draft ngram`): chains where the text repeats itself, plain steps
where it does not.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from speccli.config import SamplingConfig
from speccli.engine.backends import common_prefix_length
from speccli.engine.coupling import Noise
from speccli.engine.drafters import PromptLookupDrafter
from speccli.engine.events import StepEvent
from speccli.engine.policy import DraftLengthPolicy
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
# What a lookahead step is expected to gain over a plain one, in extra tokens, by the tokens
# in its pass: a prior, since what comes true depends on the text. Measured in bfloat16 over
# the 12 default prompts, the median over the lookahead steps (prompt lookup's guess
# included): on a 2-core Xeon with AMX, same code, same day, 0.33 with 7 tokens a pass
# (W 2, N 3, G 1) and 0.58 with 17 (W 5, N 3, G 3); on a 2-core AMD EPYC 0.23-0.37 with 7.
# The paper's GPU shape (121 tokens) is reported at 1.5-2x, about 1 extra. Between them, a
# line in log2(tokens).
GAIN_AT_7_TOKENS = 0.33
GAIN_PER_DOUBLING = 0.20
# A shape must promise this much over plain decoding's tokens per second to be chosen.
MIN_ADVANTAGE = 1.05
POOL_PER_TOKEN = 8  # n-grams kept per first token, the latest


def expected_gain(fed: int) -> float:
    """Extra tokens a lookahead step over `fed` tokens is expected to accept (the prior above)."""
    return max(0.0, GAIN_AT_7_TOKENS + GAIN_PER_DOUBLING * math.log2(fed / 7))


def pass_cost(pass_seconds: dict[int, float], fed: int) -> float | None:
    """Seconds of a pass over `fed` tokens: the cheapest measured pass over as many or more
    (a pass over more tokens is no cheaper; one measurement's noise is not trusted over
    a larger pass's); None when nothing that large was measured."""
    measured = [seconds for size, seconds in pass_seconds.items() if size >= fed]
    return min(measured) if measured else None


def choose_shape(pass_seconds: dict[int, float] | None) -> LookaheadShape | None:
    """The shape with the best expected tokens per second, (1 + expected_gain) / its pass's
    cost, from measured costs: small shapes where a pass grows with its tokens, large ones
    where passes are nearly flat. None (plain decoding) when no shape promises
    MIN_ADVANTAGE x plain decoding; the default without measurements."""
    if not pass_seconds or 1 not in pass_seconds:
        return DEFAULT_SHAPE
    best, best_rate = None, MIN_ADVANTAGE / pass_seconds[1]
    for shape in SHAPES:
        cost = pass_cost(pass_seconds, shape.fed)
        if cost is None:
            continue  # larger than anything measured: unknown, not assumed cheap
        rate = (1 + expected_gain(shape.fed)) / cost
        if rate > best_rate:
            best, best_rate = shape, rate
    return best


@dataclass(frozen=True)
class LookupOutcome:
    """What prompt lookup's guess in a lookahead step's tree would have given as a chain
    of its own: `length` tokens verified, `right` of them on the accepted path (the path
    follows the guess while it is right: the guess is one of the tree's branches)."""

    length: int
    right: int


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

    def __init__(self, shape: LookaheadShape | None = DEFAULT_SHAPE) -> None:
        self.shape = shape
        self.pool: dict[int, OrderedDict[tuple[int, ...], None]] = {}
        self.levels: list[list[int]] = []
        self._indexed = 0  # context n-grams starting before this are in the pool
        self.lookup = PromptLookupDrafter()
        self.lookup_length = self._shortest_lookup()
        self._last_lookup: tuple[int, list[int]] | None = None  # (context length, the guess) of the last step
        self._tree: tuple[int, TokenTree, list[int]] | None = None  # (context length, tree, lookup guess) of a tree step
        self.lookup_outcome: LookupOutcome | None = None  # of the latest lookahead step

    @property
    def verifies_trees(self) -> bool:
        """With a shape, a lookahead step verifies a tree (the pool's n-grams and prompt
        lookup's guess) and carries the lookahead branch; without one, steps are prompt
        lookup's (`propose`, `propose_tree`)."""
        return self.shape is not None

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

    def propose(self, context, k, sampling, generator, noise=None):  # noqa: ANN001 - the Drafter protocol
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
    ) -> TokenTree:
        """Prompt lookup's guess, then the pool's n-grams that start with the pending token,
        the latest first."""
        self.lookup_outcome = None
        if self.shape is None:
            tree = self.lookup.propose_tree(context, shape, sampling, generator, noise)  # `--tree` without lookahead
            self._tree = (len(context), tree, [])
            return tree
        if shape.max_depth <= 0:
            return TokenTree([], [])
        self._index(context)
        entries = self.pool.get(context[-1], {})
        latest = [list(c[: shape.max_depth]) for c in reversed(list(entries))][: self.shape.guesses]
        guess = self._lookup_guess(context, shape.max_nodes)
        tree = trie([guess, *latest], shape.max_nodes)
        self._tree = (len(context), tree, guess)
        return tree

    def settle_tree(self, path: Sequence[int]) -> None:
        """The target accepted `path` of the last tree: note what prompt lookup's guess
        alone would have had accepted (`lookup_outcome`, for LookaheadGate), and go back to
        the context plus that path."""
        if self._tree is None:
            return
        length, tree, guess = self._tree
        self._tree = None
        if self.shape is not None:
            right = common_prefix_length(guess, [tree.tokens[node] for node in path])
            self.lookup_outcome = LookupOutcome(len(guess), right)
        self.rollback(length + len(path))

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
        pending token: only the record of what text was pooled goes back. Back to nothing
        (a cold start) everything is forgotten, so no earlier generation's n-grams help."""
        self._tree = None
        self._indexed = min(self._indexed, max(0, length - (self.shape.ngram if self.shape else 0) + 1))
        self.lookup.rollback(length)
        if length == 0:
            self._forget()


class PassCosts(Protocol):
    def verify_seconds(self, fed: int) -> float | None:
        """Seconds of a target pass over `fed` tokens (None: nothing measured yet)."""
        ...


class LookaheadGate:
    """k auto for lookahead decoding: lookahead steps while they beat prompt lookup alone.

    A lookahead step verifies prompt lookup's guess and the pool's n-grams as one tree, the
    Jacobi window beside it: a larger pass than a chain of that guess alone. So each lookahead
    step is paired with what the guess alone would have given on the same text
    (`lookup_outcome`: its tokens on the accepted path, plus one, for a pass over the
    guess and the pending token), and with a plain step. When, over the last `window`
    lookahead steps, their tokens per second fall below `bar` x the better of those two,
    the `meanwhile` policy's steps follow (prompt lookup's k auto: chains of the text's own
    n-grams where they pay, else plain steps; plain steps without one); after `probe_every`
    of them (doubled after each probe that did not pay either, up to `max_backoff`
    doublings) lookahead steps are tried again, judged on a fresh window.

    Seconds are the cost curve (`costs`: the calibration, refined by the steps), not each
    step's clock: a shared CPU's steps are too noisy to judge a few by (a rule that compared
    moving averages of them turned lookahead off on a CPU where it paid, 1.16x plain
    decoding instead of 1.38x). Pairing on the same steps takes the text out of the
    comparison. The earlier bar, extra tokens against what the larger pass costs over a
    plain one, let lookahead run where prompt lookup alone was as fast: on a 2-core AMD EPYC
    (bfloat16, 7-token passes) the window and pool added 0.13 tokens a step to the guess's
    0.39, 1.02x its rate on the median prompt, 0.98x on some.
    """

    def __init__(
        self,
        k: int,
        costs: PassCosts | None = None,
        lookup_outcome: Callable[[], LookupOutcome | None] | None = None,
        window: int = 32,
        probe_every: int = 16,
        max_backoff: int = 3,
        bar: float = 1.0,
        meanwhile: DraftLengthPolicy | None = None,
    ) -> None:
        if k < 1 or window < 1 or bar <= 0:
            raise ValueError(f"need k >= 1, window >= 1 and bar > 0, got {k}, {window}, {bar}")
        self.k = k
        self.costs = costs if costs is not None else getattr(meanwhile, "costs", None)
        self.lookup_outcome = lookup_outcome
        self.bar = bar
        self.window = window
        self.probe_every = probe_every
        self.max_backoff = max_backoff
        self.meanwhile = meanwhile
        self.on = True
        # The latest lookahead steps: (tokens, seconds) of each, and of the guess alone.
        self._recent: deque[tuple[int, float, int, float]] = deque(maxlen=window)
        self._steps_off = 0  # steps without lookahead since it went off
        self._failed_runs = 0

    def next_k(self) -> int:
        interval = self.probe_every * 2 ** min(self._failed_runs - 1, self.max_backoff)
        if not self.on and self._steps_off >= interval:
            self.on = True
        if self.on:
            return self.k
        return self.meanwhile.next_k() if self.meanwhile is not None else 0

    @property
    def lookahead_step(self) -> bool:
        """Whether the step `next_k` was just asked for is a lookahead step."""
        return self.on

    def _seconds(self, fed: int) -> float:
        seconds = self.costs.verify_seconds(fed) if self.costs is not None else None
        return seconds if seconds else 1.0  # nothing measured: every pass alike

    def rates(self) -> tuple[float, float]:
        """Tokens per second over the latest lookahead steps, and the better of prompt
        lookup's guess alone and plain steps over the same steps."""
        tokens, seconds, alone, alone_seconds = (sum(column) for column in zip(*self._recent))
        return tokens / seconds, max(alone / alone_seconds, 1 / self._seconds(1))

    def observe(self, step: StepEvent) -> None:
        if not step.tree or step.fed <= 1:  # not a lookahead step
            self._steps_off += 1
            if self.meanwhile is not None:
                self.meanwhile.observe(step)
            return
        costs = getattr(self.meanwhile, "costs", None)
        if costs is not None:
            costs.observe(step)  # a pass's cost is the same whatever it verifies
        outcome = (self.lookup_outcome() if self.lookup_outcome else None) or LookupOutcome(0, 0)
        self._recent.append(
            (step.tokens, self._seconds(step.fed), outcome.right + 1, self._seconds(outcome.length + 1))
        )
        if len(self._recent) < self.window:
            return
        lookahead, alone = self.rates()
        if lookahead >= self.bar * alone:
            self._failed_runs = 0
        elif self.on:
            self.on, self._steps_off = False, 0
            self._failed_runs += 1
            self._recent.clear()
