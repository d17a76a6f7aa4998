"""Where candidate tokens come from.

A drafter proposes up to k tokens that continue the context, with the draft
probabilities q they were drawn from (None when the proposal is deterministic, which
the verification rule treats as a one-hot q).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from speccli.config import SamplingConfig
from speccli.engine.backends import CausalLM, common_prefix_length
from speccli.engine.coupling import Noise, gumbel_argmax
from speccli.engine.policy import DraftLengthPolicy, FixedDraftLength, StepPlan
from speccli.engine.sampling import sample, warp
from speccli.engine.tree import TokenTree, TreeShape
from speccli.engine.tree_drafters import GrownTree, grow_model_tree, trie

if TYPE_CHECKING:  # pragma: no cover
    from speccli.engine.lookahead import Branch

# Earlier occurrences of an n-gram prompt lookup remembers (the latest ones): each can
# offer a branch of a tree.
OCCURRENCES_KEPT = 4


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
    # Can propose a token tree (`propose_tree`), for `--tree`.
    drafts_trees: bool = False
    # Drafts what followed an earlier occurrence of the context's last n-gram: k auto keeps
    # acceptance apart by the length matched (`match_length`).
    keyed_by_match: bool = False
    # Every drafting step is a tree step of its own (lookahead, with a shape): the policy
    # plans each (`plan_step`), and a branch may ride in the pass (`branch`, `advance`).
    always_trees: bool = False
    # Prompt lookup's guess inside the last tree (lookahead), to count what it alone kept.
    guess: Sequence[int] = ()

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

        With `noise` (coupled sampling, speccli.engine.coupling), a sampling drafter draws
        its i-th token as argmax(log q + noise(i)) instead of from `generator`: the noise
        the target's token at that position is drawn with, so the two agree as often as
        they can. A deterministic drafter ignores it."""
        raise NotImplementedError

    def rollback(self, length: int) -> None:
        """Only context[:length] is settled; forget anything drafted past it."""
        raise NotImplementedError

    def policy(
        self, k: int | str, measured: dict[int, float] | None, adaptive: Callable[[], DraftLengthPolicy]
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
    coupled draw argmax(log q + noise) (speccli.engine.coupling)."""
    if sampling.greedy:
        token = int(torch.argmax(row))
        return token, None, float(torch.exp(row[token] - torch.logsumexp(row, dim=-1)))
    q = warp(row, sampling)
    token = int(sample(q, generator) if noise is None else gumbel_argmax(q, noise))
    return token, q, float(q[token])


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


# transformers' default for its assistant. On the offline Qwen pair here (bf16 target, int8 draft, k auto,
# 4 prompts x 64 tokens) thresholds 0 to 0.6 all gave 8.5-9.3 tok/s on average: within run-to-run noise,
# since the adaptive k already keeps drafts short where they fail. It matters more where k is fixed.
DEFAULT_STOP_CONFIDENCE = 0.4


class ModelDrafter(Drafter):
    """A smaller causal LM of the same tokenizer drafts autoregressively from its own cache.

    Only the first ``shared_vocab`` ids are tokens to both models (default: every id both
    models have rows for). The draft proposes only those, and is fed ``substitute_id``
    in place of any other id in the context, which it may not be able to read.
    """

    name = "model"
    drafts_trees = True

    def __init__(
        self,
        model: CausalLM,
        target_vocab_size: int,
        stop_confidence: float = 0.0,
        *,
        shared_vocab: int | None = None,
        substitute_id: int = 0,
    ) -> None:
        if not 0.0 <= stop_confidence < 1.0:
            raise ValueError(f"stop_confidence must be in [0, 1), got {stop_confidence}")
        self.model = model
        self.target_vocab_size = target_vocab_size
        readable = model.vocab_size if shared_vocab is None else shared_vocab
        self.shared_vocab = min(target_vocab_size, model.vocab_size, readable)
        if not 0 <= substitute_id < self.shared_vocab:
            raise ValueError(f"substitute_id must be below {self.shared_vocab}, got {substitute_id}")
        self.substitute_id = substitute_id
        # Drafting stops after a token the draft itself gave less than this probability:
        # the tokens after it would rarely survive, and each costs a draft pass.
        self.stop_confidence = stop_confidence
        self._grown: GrownTree | None = None

    @property
    def draft_model(self) -> CausalLM:
        return self.model

    def readable(self, ids: Sequence[int]) -> list[int]:
        """The ids as the draft is fed them (an id it may not know becomes `substitute_id`)."""
        limit, substitute = self.shared_vocab, self.substitute_id
        return [i if i < limit else substitute for i in ids]

    def aligned(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits over the target's vocabulary, -inf where it may not propose."""
        return align_vocab(logits, self.target_vocab_size, self.shared_vocab)

    def context_logits(self, context: Sequence[int]) -> torch.Tensor:
        """The draft's logits [V_draft] for the token after `context`, its cache brought
        up to the whole context (re-scoring the last token when already cached)."""
        cached = len(self.model.cached_tokens)
        if cached >= len(context):
            # The last context token's logits are not kept: score it again.
            self.model.rollback(len(context) - 1)
            cached = len(context) - 1
        return self.model.forward(self.readable(context[cached:]), all_logits=False)[-1]

    def start(self, context: Sequence[int]) -> None:
        """Reuse what the cache shares with the context. The rest is read only when a draft
        is first asked for (`catch_up`): where drafting never pays (k auto stays at 0), the
        draft model costs nothing, not even the prompt."""
        settled = self.readable(context[:-1])
        self.model.rollback(common_prefix_length(self.model.cached_tokens, settled))

    def catch_up(self, context: Sequence[int]) -> None:
        """Feed the draft, in one pass, the context it has not read (the prompt, the tokens of
        plain steps) but the last token, whose logits drafting computes. The decoder times
        this apart from drafting: it is a cost of the text, not of each drafted token."""
        settled = self.readable(context[:-1])
        cached = len(self.model.cached_tokens)
        if cached < len(settled):
            self.model.forward(settled[cached:], all_logits=False)

    def propose(
        self,
        context: Sequence[int],
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        noise: Noise | None = None,
    ) -> Draft:
        if k <= 0:
            return Draft([])
        logits = self.context_logits(context)
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        for i in range(k):
            row = self.aligned(logits)
            if generator is not None:
                row = row.to(generator.device)
            token, q, confidence = draw(row, sampling, generator, None if noise is None else noise(i))
            if q is not None:
                probs.append(q)
            tokens.append(token)
            if i + 1 == k or confidence < self.stop_confidence:
                break
            logits = self.model.forward([token], all_logits=False)[-1]
        return Draft(tokens, torch.stack(probs) if probs else None)

    def propose_tree(
        self,
        context: Sequence[int],
        shape: TreeShape,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        noise: Noise | None = None,
    ) -> TokenTree:
        """A tree of candidates, branching where the draft is unsure (see
        speccli.engine.tree_drafters). The draft's cache holds the nodes it was fed until
        `settle_tree` keeps the accepted path."""
        self._grown = grow_model_tree(self, context, shape, sampling, generator, noise)
        return self._grown.tree

    def settle_tree(self, path: Sequence[int], settled: int) -> None:
        """The target accepted `path` of the last tree: keep what the draft was fed of it
        (a prefix: the expanded nodes), forget the rest, so that the next step does not
        feed the draft those tokens again."""
        grown, self._grown = self._grown, None
        if grown is None:
            return
        offsets = []
        for node in path:
            if node not in grown.cached:
                break
            offsets.append(grown.cached[node])
        self.model.keep(grown.base, offsets)

    def rollback(self, length: int) -> None:
        if self._grown is not None:
            # A tree step that was not settled (interrupted): its nodes are not context.
            self.model.rollback(min(self._grown.base, len(self.model.cached_tokens)))
            self._grown = None
        self.model.rollback(min(length, len(self.model.cached_tokens)))


# What prompt lookup's drafts come true at, by the length of the n-gram matched: k auto's
# prior for each (speccli.engine.policy.DraftLengthByMatch), by draft position (the last
# standing for the later ones). Measured over the greedy answers of the 12 default prompts
# (Qwen2.5-Coder-1.5B, float32 and bfloat16 alike): the first drafted token was right 23%
# of the time after a 1-token match (8-13% on chat text), 40% after 2, 80% after 3; a
# token whose predecessors were right, 40%, 45-55% and 89-95%.
LOOKUP_ACCEPTANCE: dict[int, tuple[float, ...]] = {1: (0.25, 0.4), 2: (0.4, 0.5), 3: (0.8, 0.9, 0.95)}


class PromptLookupDrafter(Drafter):
    """Prompt lookup decoding: find the longest n-gram (max_ngram down to min_ngram) that
    ends the context and occurred earlier in it; the tokens that followed that earlier
    occurrence are the draft. Costs no model pass; q is one-hot.

    The n-gram index is built incrementally, so each step costs time proportional to the
    tokens added, not to the context length.
    """

    name = "ngram"
    drafts_trees = True
    keyed_by_match = True

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

    def start(self, context: Sequence[int]) -> None:
        self._reset()

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
        if match == 0:
            return Draft([])
        end = self._index[match][tuple(context[len(context) - match :])][-1]
        return Draft(list(context[end : end + k]))

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
    ) -> TokenTree:
        """The continuations of several earlier occurrences, the longest matching n-grams'
        and the latest first, merged into a tree."""
        if shape.max_depth <= 0:
            return TokenTree([], [])
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
        return trie(continuations, shape.max_nodes)

    def rollback(self, length: int) -> None:
        if length < self._indexed_upto:
            # Only settled context is indexed; a shorter one means a different text.
            self._reset()
