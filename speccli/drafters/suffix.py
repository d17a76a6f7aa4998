"""Suffix drafting (Oliaro et al., SuffixDecoding, arXiv 2411.04975): guesses from everything
the session has seen. The longest suffix of the context that occurred before, in the text so
far or in an earlier prompt or answer (the history: a chat's turns, a server's requests, and
with a store the earlier runs of `generate` and `bench`), and what followed its occurrences,
counted: the continuations most of them share form the draft (a chain, or a tree of the
frequent ones). No model pass; the proposal is deterministic (a one-hot q).

The confidence of a guess is the length of the suffix matched (k auto keeps acceptance
apart by it, in buckets: MATCH_BUCKETS) and how many occurrences agree on each token (a node
fewer than MIN_SHARE of them continue with is not drafted)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from speccli.autok.costs import CostCurve
from speccli.autok.plan import DraftSignal, ShadowGuess
from speccli.autok.policy import DraftLengthPolicy, FixedDraftLength, KAutoFactory
from speccli.config import SamplingConfig
from speccli.coupling import Noise
from speccli.drafters.base import Draft, Drafter, TreeDraft
from speccli.tree import ROOT, TokenTree, TreeShape

# The longest suffix of the context matched (longer matches say no more about what follows).
MAX_MATCH = 32
# Occurrences of the context's last two tokens examined for the longest match, the latest first.
SCANNED = 256
# Occurrences of the longest match whose continuations are counted, the latest first.
COUNTED = 64
# A token is drafted only where at least this share of the counted occurrences continue with it.
MIN_SHARE = 0.1
# k auto keeps acceptance apart by the length matched, in these buckets (a match of 5 counts
# as 4): a suffix of 16 tokens seen before is another thing than one of 2.
MATCH_BUCKETS = (1, 2, 3, 4, 8, 16)
# Where k auto's acceptance starts for each bucket, by draft position: prompt lookup's for the
# short matches (speccli.drafters.ngram.LOOKUP_ACCEPTANCE), higher for the longer ones,
# which k auto corrects from the steps it sees.
SUFFIX_ACCEPTANCE: dict[int, tuple[float, ...]] = {
    1: (0.25, 0.4),
    2: (0.4, 0.5),
    3: (0.8, 0.9, 0.95),
    4: (0.85, 0.92, 0.95),
    8: (0.9, 0.95, 0.97),
    16: (0.95, 0.97, 0.98),
}
# History kept, in tokens: the oldest texts go first past it.
HISTORY_TOKENS = 200_000
# Past the cap, the oldest texts go until the history is this share of it.
TRIMMED_TO = 0.9
# How far the guess reaches that `signal` keeps, to learn from where another drafter drafts.
SHADOW_LENGTH = 16


def bucket(match: int) -> int:
    """The bucket a match length counts in (0: no match)."""
    return max((b for b in MATCH_BUCKETS if b <= match), default=0)


class TokenIndex:
    """Texts as one run of tokens (each closed by a separator no match crosses), every
    position indexed by the token pair and the token that end there."""

    SEPARATOR = -1

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self.tokens: list[int] = list(tokens)
        self._pairs: dict[tuple[int, int], list[int]] = {}
        self._singles: dict[int, list[int]] = {}
        self._indexed = 0  # positions below this are indexed

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens (the text grows; nothing indexed until `index_upto`)."""
        self.tokens.extend(tokens)

    def close(self) -> None:
        """End the current text: what follows is another."""
        self.tokens.append(self.SEPARATOR)

    def index_upto(self, end: int) -> None:
        """Index the positions before `end`: a match ending at such a position has a continuation."""
        tokens = self.tokens
        for position in range(max(self._indexed, 1), min(end, len(tokens))):
            last = tokens[position - 1]
            if last == self.SEPARATOR:
                continue
            self._singles.setdefault(last, []).append(position)
            before = tokens[position - 2] if position >= 2 else self.SEPARATOR
            if before != self.SEPARATOR:
                self._pairs.setdefault((before, last), []).append(position)
        self._indexed = max(self._indexed, min(end, len(tokens)))

    def truncate(self, length: int) -> None:
        """Keep only the first `length` tokens. Positions are indexed in order, so each one cut
        off is the last entry of its lists: a rollback costs what it removes."""
        tokens = self.tokens
        for position in range(self._indexed - 1, max(length, 1) - 1, -1):
            last = tokens[position - 1]
            if last == self.SEPARATOR:
                continue
            self._pop(self._singles, last)
            before = tokens[position - 2] if position >= 2 else self.SEPARATOR
            if before != self.SEPARATOR:
                self._pop(self._pairs, (before, last))
        self._indexed = min(self._indexed, max(length, 0))  # positions >= length have no continuation
        del tokens[length:]

    @staticmethod
    def _pop(index: dict, key: object) -> None:
        positions = index[key]
        positions.pop()
        if not positions:
            del index[key]

    def matches(self, suffix: Sequence[int]) -> list[tuple[int, int]]:
        """(length matched, end) of the latest occurrences of `suffix`'s tail, longest first."""
        if not suffix:
            return []
        tokens, found = self.tokens, []
        if len(suffix) >= 2:
            ends = self._pairs.get((suffix[-2], suffix[-1]), [])
            for end in reversed(ends[-SCANNED:]):
                length = 2
                while (
                    length < len(suffix) and end - length - 1 >= 0 and tokens[end - length - 1] == suffix[-length - 1]
                ):
                    length += 1
                found.append((length, end))
        if not found:
            found = [(1, end) for end in reversed(self._singles.get(suffix[-1], [])[-SCANNED:])]
        found.sort(key=lambda item: -item[0])  # stable: the latest first among equal lengths
        return found

    def continuation(self, end: int, length: int) -> list[int]:
        """Up to `length` tokens from `end`, stopping at the end of its text."""
        out = []
        for token in self.tokens[end : end + length]:
            if token == self.SEPARATOR:
                break
            out.append(token)
        return out


class SuffixHistory:
    """Earlier texts (prompts and answers) of the session, at most `max_tokens` of them, the
    oldest dropped first; `texts` to start from (a store's), and `on_add` called with the
    history after each text joins it (to write the store: speccli.pipeline)."""

    def __init__(
        self,
        max_tokens: int = HISTORY_TOKENS,
        texts: Sequence[Sequence[int]] = (),
        on_add: Callable[[SuffixHistory], None] | None = None,
    ) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.on_add = on_add
        self.texts: list[list[int]] = []
        total = 0
        for text in reversed(texts):  # the latest kept within the cap
            if total + len(text) > max_tokens:
                break
            total += len(text)
            self.texts.insert(0, list(text))
        self.index = TokenIndex()
        self._reindex()

    def add(self, tokens: Sequence[int]) -> None:
        """Remember a text (kept whole, at most its last max_tokens); the oldest go past the cap.
        A text that goes on from the latest one (a chat's next turn: the conversation so far
        and the new answer) takes its place, so that no turn is counted twice."""
        text = [int(t) for t in tokens][-self.max_tokens :]
        if not text:
            return
        if self.texts and len(text) >= len(self.texts[-1]) and text[: len(self.texts[-1])] == self.texts[-1]:
            self.index.truncate(len(self.index) - len(self.texts.pop()) - 1)
        self.texts.append(text)
        total = self.tokens
        if total > self.max_tokens:
            # Down to TRIMMED_TO of the cap, so that the index is rebuilt (0.2 s at 200,000
            # tokens on a 2-core CPU) once in many generations, not after each.
            while total > TRIMMED_TO * self.max_tokens and len(self.texts) > 1:
                total -= len(self.texts.pop(0))
            self._reindex()
        else:
            self._index_text(text)
        if self.on_add is not None:
            self.on_add(self)

    @property
    def tokens(self) -> int:
        return sum(len(t) for t in self.texts)

    def _reindex(self) -> None:
        self.index = TokenIndex()
        for text in self.texts:
            self._index_text(text)

    def _index_text(self, text: list[int]) -> None:
        self.index.extend(text)
        self.index.close()
        self.index.index_upto(len(self.index))


@dataclass(frozen=True)
class Guess:
    """What the occurrences of the longest match continue with: the counted continuations."""

    match: int
    continuations: tuple[tuple[int, ...], ...]


class SuffixDrafter(Drafter):
    """Suffix drafting over the text so far and a SuffixHistory (see the module docstring)."""

    name = "suffix"
    drafts_trees = True

    def __init__(self, history: SuffixHistory | None = None) -> None:
        self.history = history if history is not None else SuffixHistory()
        self._context = TokenIndex()
        self._guessed: tuple[int, int, list[int]] | None = None
        self._last: tuple[tuple[int, int], Guess] | None = None  # the latest guess, by context and history length

    def start(self, context: Sequence[int]) -> None:
        self._context = TokenIndex()
        self._guessed = None
        self._last = None

    def policy(self, k: int | str, measured: CostCurve | None, adaptive: KAutoFactory) -> DraftLengthPolicy:
        """k auto keeps acceptance apart by the bucket of the length matched."""
        return FixedDraftLength(k) if isinstance(k, int) else adaptive(SUFFIX_ACCEPTANCE)

    def learn_text(self, tokens: Sequence[int]) -> None:
        """A generation ended: its prompt and answer join the history."""
        self.history.add(tokens)

    def _sync(self, context: Sequence[int]) -> None:
        """Index the context: it only grows between steps (a rollback cuts the index back)."""
        index = self._context
        if len(index) > len(context):
            index.truncate(len(context))
        index.extend(context[len(index) :])
        index.index_upto(len(context))

    def guess(self, context: Sequence[int]) -> Guess:
        """The longest match of the context's tail, and the continuations of its latest
        occurrences (in the text so far first, then the history)."""
        key = (len(context), len(self.history.index))
        if self._last is not None and self._last[0] == key:
            return self._last[1]  # the step's signal found it already
        self._sync(context)
        suffix = list(context[-MAX_MATCH:])
        found = [(length, end, self._context) for length, end in self._context.matches(suffix)]
        found += [(length, end, self.history.index) for length, end in self.history.index.matches(suffix)]
        if not found:
            self._last = (key, Guess(0, ()))
            return self._last[1]
        longest = max(length for length, _, _ in found)
        ends = [(end, index) for length, end, index in found if length == longest][:COUNTED]
        continuations = tuple(tuple(index.continuation(end, MAX_MATCH)) for end, index in ends)
        guess = Guess(longest, tuple(c for c in continuations if c))
        self._last = (key, guess)
        return guess

    def signal(self, context: Sequence[int]) -> DraftSignal:
        """The bucket of the match for the coming step, and how the guess it would have drafted
        for the last step fared (for k auto where drafters take turns)."""
        guess = self.guess(context)
        shadow = self._shadow_of(context)
        match = bucket(guess.match) if guess.continuations else 0
        self._guessed = (len(context), match, chain(guess, SHADOW_LENGTH)) if match else None
        return DraftSignal(match=match, shadow=shadow)

    def _shadow_of(self, context: Sequence[int]) -> ShadowGuess | None:
        if self._guessed is None:
            return None
        start, match, guessed = self._guessed
        return ShadowGuess.against(match, guessed, context[start:])

    def propose(
        self,
        context: Sequence[int],
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        noise: Noise | None = None,
    ) -> Draft:
        return Draft(chain(self.guess(context), k) if k > 0 else [])

    def propose_tree(
        self,
        context: Sequence[int],
        shape: TreeShape,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        noise: Noise | None = None,
    ) -> TreeDraft:
        """The continuations' most frequent tokens as a tree: the nodes the largest shares of
        the occurrences reach, at most shape.max_nodes of them and shape.max_depth deep."""
        if shape.max_depth <= 0 or shape.max_nodes <= 0:
            return TreeDraft(TokenTree([], []))
        return TreeDraft(frequent_tree(self.guess(context), shape.max_depth, shape.max_nodes))

    def rollback(self, length: int) -> None:
        if length < len(self._context):
            self._context.truncate(length)
            self._last = None


@dataclass(frozen=True)
class CountedTrie:
    """The continuations merged into a trie: each node's token, parent (ROOT: none), how many
    continuations reach it and its depth, in the order first reached; `children` by node
    (ROOT's too)."""

    tokens: list[int]
    parents: list[int]
    counts: list[int]
    depths: list[int]
    children: dict[int, list[int]]

    @classmethod
    def of(cls, guess: Guess, depth: int) -> CountedTrie:
        trie = cls([], [], [], [], {})
        child_of: dict[tuple[int, int], int] = {}
        for continuation in guess.continuations:
            node = ROOT
            for token in continuation[:depth]:
                found = child_of.get((node, token))
                if found is None:
                    found = child_of[(node, token)] = len(trie.tokens)
                    trie.tokens.append(token)
                    trie.parents.append(node)
                    trie.counts.append(0)
                    trie.depths.append(trie.depths[node] + 1 if node != ROOT else 1)
                    trie.children.setdefault(node, []).append(found)
                trie.counts[found] += 1
                node = found
        return trie


def chain(guess: Guess, k: int) -> list[int]:
    """Up to k tokens: from the root, each time the child most occurrences continue with (the
    latest occurrence's among equals), while at least MIN_SHARE of them do."""
    trie = CountedTrie.of(guess, k)
    least = MIN_SHARE * len(guess.continuations)
    out: list[int] = []
    node = ROOT
    while len(out) < k and trie.children.get(node):
        best = max(trie.children[node], key=lambda i: (trie.counts[i], -i))
        if trie.counts[best] < least:
            break
        out.append(trie.tokens[best])
        node = best
    return out


def frequent_tree(guess: Guess, depth: int, max_nodes: int) -> TokenTree:
    """The at most `max_nodes` nodes reached by the largest shares of the occurrences (each at
    least MIN_SHARE), parents before children."""
    trie = CountedTrie.of(guess, depth)
    least = MIN_SHARE * len(guess.continuations)
    # A child is reached by no more occurrences than its parent, and ties go to the shallower
    # and earlier node, so the nodes taken always include their parents.
    ranked = heapq.nsmallest(
        max_nodes,
        (i for i in range(len(trie.tokens)) if trie.counts[i] >= least),
        key=lambda i: (-trie.counts[i], trie.depths[i], i),
    )
    # Parents before children; siblings tried in order: the most frequent first.
    kept = sorted(ranked, key=lambda i: (trie.depths[i], -trie.counts[i], i))
    renumber = {old: new for new, old in enumerate(kept)}
    parents = [renumber[trie.parents[i]] if trie.parents[i] != ROOT else ROOT for i in kept]
    return TokenTree([trie.tokens[i] for i in kept], parents)
