"""Drafting with a draft model: a smaller causal LM of the same tokenizer proposes tokens
autoregressively from its own cache, with the probabilities q it drew them from (a chain, or a
tree where it is unsure)."""

from __future__ import annotations

from typing import Sequence

import torch

from speccli.autok.plan import StepPlan
from speccli.backends.base import CausalLM, common_prefix_length
from speccli.config import SamplingConfig
from speccli.coupling import Noise
from speccli.drafters.base import Draft, Drafter, Settled, TreeDraft, align_vocab, draw
from speccli.drafters.chain import Pickers, until_unsure
from speccli.drafters.trees import GrownTree, TreeSource, feed_window, grow_tree
from speccli.tree import TreeShape

# transformers' default for its assistant (why: docs/k-auto.md, "Why it is built this way").
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
        # What picks the tokens of chains drafted on the device (`model.chains`).
        self._pickers = Pickers(target_vocab_size, self.shared_vocab, model.device)

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
        is first asked for (`prepare`): where drafting never pays (k auto stays at 0), the
        draft model costs nothing, not even the prompt."""
        settled = self.readable(context[:-1])
        self.model.rollback(common_prefix_length(self.model.cached_tokens, settled))

    def prepare(self, context: Sequence[int], plan: StepPlan) -> None:
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
        if self.model.chains:
            return self._chain(logits, k, sampling, generator, noise)
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

    def _chain(
        self,
        logits: torch.Tensor,
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        noise: Noise | None,
    ) -> Draft:
        """The k tokens drafted on the device in one call (`CausalLM.chain`), then cut after
        the first the draft was unsure of, as the pass-by-pass loop stops there."""
        chain = self.model.chain(logits, k, self._pickers.loaded(sampling, k, generator, noise))
        draft = until_unsure(chain, self.stop_confidence)
        if len(draft) < k:  # the cache holds every token but the last: keep those before the cut
            self.model.rollback(len(self.model.cached_tokens) - (k - len(draft)))
        return draft

    def propose_tree(
        self,
        context: Sequence[int],
        shape: TreeShape,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        noise: Noise | None = None,
    ) -> TreeDraft:
        """A tree of candidates, branching where the draft is unsure (see
        speccli.drafters.trees). The draft's cache holds the nodes it was fed until
        `settle` keeps the accepted path."""
        self._grown = grow_model_tree(self, context, shape, sampling, generator, noise)
        return TreeDraft(self._grown.tree)

    def settle(self, settled: Settled) -> None:
        """After a tree, the target accepted `settled.path` of it: keep what the draft was
        fed of it (a prefix: the expanded nodes), forget the rest, so that the next step
        does not feed the draft those tokens again."""
        if settled.path is None:
            self.rollback(settled.length)
            return
        grown, self._grown = self._grown, None
        if grown is None:
            return
        offsets = []
        for node in settled.path:
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


class DraftModelSource(TreeSource):
    """A draft model's distributions: the nodes chosen at each depth are fed together in
    one tree pass over the draft's own cache, after the whole context."""

    def __init__(self, drafter: ModelDrafter) -> None:
        self.drafter = drafter
        self.base = len(drafter.model.cached_tokens)
        self.window: dict[int, int] = {}  # node -> its offset among the draft's cached tree entries

    def root_logits(self, context: Sequence[int]) -> torch.Tensor:
        row = self.drafter.context_logits(context)
        self.base = len(self.drafter.model.cached_tokens)  # the whole context: the tree grows after it
        return self.drafter.aligned(row)

    def expand(
        self, nodes: Sequence[int], tokens: Sequence[int], parents: Sequence[int], depth: int
    ) -> list[torch.Tensor]:
        visible = feed_window(self.window, nodes, parents)
        positions = [self.base - 1 + depth] * len(nodes)
        readable = self.drafter.readable([tokens[n] for n in nodes])
        rows = self.drafter.model.forward_tree(readable, positions, visible, self.base)
        return [self.drafter.aligned(row) for row in rows]


def grow_model_tree(
    drafter: ModelDrafter,
    context: Sequence[int],
    shape: TreeShape,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    noise: Noise | None = None,
) -> GrownTree:
    """A tree from the draft model (see `grow_tree`), and where its cache holds the nodes."""
    source = DraftModelSource(drafter)
    tree, renumber = grow_tree(source, context, shape, sampling, generator, noise)
    cached = {renumber[n]: offset for n, offset in source.window.items() if n in renumber}
    return GrownTree(tree, source.base, cached)
