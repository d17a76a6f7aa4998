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
`LookaheadGate` finds that lookahead's steps accept too little on the text at hand to pay
for their larger passes (it tries them again now and then), the steps are prompt lookup's
with its own k auto (`--draft ngram`): chains where the text repeats itself, plain steps
where it does not.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Sequence

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


def break_even_gain(pass_seconds: dict[int, float] | None, shape: LookaheadShape) -> float:
    """Extra tokens per step a shape's steps must accept to pay for their larger pass (0
    without measurements)."""
    if not pass_seconds or 1 not in pass_seconds:
        return 0.0
    cost = pass_cost(pass_seconds, shape.fed)
    return 0.0 if cost is None else max(0.0, cost / pass_seconds[1] - 1)


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
        self.held = False  # this step is prompt lookup's: k auto's gate holds lookahead back

    @property
    def verifies_trees(self) -> bool:
        """With a shape, a lookahead step verifies a tree (the pool's n-grams and prompt
        lookup's guess) and carries the lookahead branch; without one, steps are prompt
        lookup's (`propose`, `propose_tree`)."""
        return self.shape is not None

    def hold(self, held: bool) -> None:
        """Whether the next step is prompt lookup's (`LookaheadGate` holds lookahead back):
        its tree, with `--tree`, is prompt lookup's, and no window rides along."""
        self.held = held

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

    def match_length(self, context: Sequence[int]) -> int:
        """Prompt lookup's match, for the steps without lookahead (see PromptLookupDrafter)."""
        return self.lookup.match_length(context)

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
        if self.shape is None or self.held:
            return self.lookup.propose_tree(context, shape, sampling, generator, noise)  # `--tree` without lookahead
        if shape.max_depth <= 0:
            return TokenTree([], [])
        self._index(context)
        entries = self.pool.get(context[-1], {})
        latest = [list(c[: shape.max_depth]) for c in reversed(list(entries))][: self.shape.guesses]
        return trie([self._lookup_guess(context, shape.max_nodes), *latest], shape.max_nodes)

    def branch(self, context: Sequence[int]) -> Branch | None:
        """This pass's lookahead branch (None without a shape, or while held)."""
        if self.shape is None or self.held:
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
        self._indexed = min(self._indexed, max(0, length - (self.shape.ngram if self.shape else 0) + 1))
        self.lookup.rollback(length)
        if length == 0:
            self._forget()


class LookaheadGate:
    """k auto for lookahead decoding: lookahead steps, but other steps while they do not pay.

    A lookahead step's pass is larger than a plain step's (the window rides along), so its
    guesses must accept `break_even` extra tokens per step on average to pay for it (from
    the measured pass costs). On text that never repeats itself they accept nothing and
    every step pays that extra for nothing (0.75x plain decoding on an H200 with
    random-weight models). When the last `window` lookahead steps accepted no more than
    `margin` x `break_even` extra tokens per step, the `meanwhile` policy's steps follow
    (prompt lookup's k auto: chains of the text's own n-grams where they pay, trees of them
    with `--tree`, else plain steps; plain steps without one); after `probe_every` of them
    (doubled after each probe that did not pay either, up to `max_backoff` doublings)
    lookahead steps are tried again, judged on a fresh window. The rule counts accepted
    tokens, not seconds: a step's seconds are too noisy on a shared CPU to judge a few
    steps by (a rule that compared moving averages of them turned lookahead off on a CPU
    where it paid, 1.16x plain decoding instead of 1.38x). Over a window, not a run of
    failures: on chat text the window's n-grams come true now and then. A window's mean is
    a noisy estimate, hence the margin and the 32 steps: with 16 steps and the break-even
    itself as the bar, chat text that brought 0.36 extra tokens per step against a
    break-even of 0.16 (a Xeon with AMX) fell below it now and then, and a third of its
    steps ran plain; text that brings nothing still turns lookahead off after 32 steps.
    """

    def __init__(
        self,
        k: int,
        break_even: float = 0.0,
        window: int = 32,
        probe_every: int = 16,
        max_backoff: int = 3,
        margin: float = 0.5,
        meanwhile: DraftLengthPolicy | None = None,
    ) -> None:
        if k < 1 or window < 1 or break_even < 0 or not 0 < margin <= 1:
            raise ValueError(
                f"need k >= 1, window >= 1, break_even >= 0 and 0 < margin <= 1, got {k}, {window}, {break_even}, {margin}"
            )
        self.k = k
        self.break_even = break_even
        self.margin = margin
        self.window = window
        self.probe_every = probe_every
        self.max_backoff = max_backoff
        self.meanwhile = meanwhile
        self.on = True
        self._recent: deque[int] = deque(maxlen=window)  # tokens accepted by the latest lookahead steps
        self._steps_off = 0  # steps without lookahead since it went off
        self._failed_runs = 0

    def next_k(self) -> int:
        interval = self.probe_every * 2 ** min(self._failed_runs - 1, self.max_backoff)
        if not self.on and self._steps_off >= interval:
            self.on = True
        if self.on:
            return self.k
        return self.meanwhile.next_k() if self.meanwhile is not None else 0

    def expect(self, match: int) -> None:
        """The length of prompt lookup's match for the coming step, for the `meanwhile` policy."""
        if hasattr(self.meanwhile, "expect"):
            self.meanwhile.expect(match)

    @property
    def lookahead_step(self) -> bool:
        """Whether the step `next_k` was just asked for is a lookahead step."""
        return self.on

    def observe(self, step: StepEvent) -> None:
        if not self.on or not step.tree or step.fed <= 1:  # not a lookahead step
            self._steps_off += 1
            if self.meanwhile is not None:
                self.meanwhile.observe(step)
            return
        costs = getattr(self.meanwhile, "costs", None)
        if costs is not None:
            costs.observe(step)  # a pass's cost is the same whatever it verifies
        self._recent.append(step.accepted)
        if len(self._recent) < self.window:
            return
        if sum(self._recent) / self.window > self.margin * self.break_even:
            self._failed_runs = 0
        elif self.on:
            self.on, self._steps_off = False, 0
            self._failed_runs += 1
            self._recent.clear()
