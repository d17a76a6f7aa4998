"""Drafting with a draft model of another tokenizer (docs/lossless.md, "Drafts across
tokenizers").

The draft reads the target's text: the settled target tokens as bytes, written with the
draft's own tokenizer (speccli.drafters.vocab_bridge). Its cache is kept by text: each
step the context is written again and the cache rolled back to what it shares with it, so
whatever a step settled (drafted, resampled, or cut inside a character) the draft reads the
same text as the target.

- Greedy: the draft drafts freely; its text is written with the target's tokenizer, and
  those target tokens are the guesses (string-level matching). The target keeps a guess
  only where it is its own argmax, so the output is the target's whatever the guesses.
- Sampling: the draft draws only tokens the target spells the same (the bridge's shared
  tokens), from its distribution restricted to them and renormalised: q is then a
  distribution over target tokens, and the usual rejection rule keeps the target's
  distribution exactly (token-level intersection). With coupled noise the draw uses the
  noise of the target token, as every drafter's does.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import torch

from speccli.autok.plan import StepPlan
from speccli.backends.base import CausalLM, common_prefix_length
from speccli.config import SamplingConfig
from speccli.coupling import Noise
from speccli.drafters.base import Draft, Drafter, draw, greedy_pick
from speccli.drafters.vocab_bridge import VocabBridge


class CrossVocabDrafter(Drafter):
    """A draft model whose tokenizer is not the target's (see the module's docstring)."""

    name = "model"

    def __init__(self, model: CausalLM, bridge: VocabBridge, target_vocab_size: int, stop_confidence: float = 0.0):
        if not 0.0 <= stop_confidence < 1.0:
            raise ValueError(f"stop_confidence must be in [0, 1), got {stop_confidence}")
        self.model = model
        self.bridge = bridge
        self.target_vocab_size = target_vocab_size
        self.stop_confidence = stop_confidence
        rows = min(model.vocab_size, len(bridge.draft_to_target))
        mapped = bridge.draft_to_target[:rows]
        shared = (mapped >= 0) & (mapped < target_vocab_size)
        self._shared_draft = torch.nonzero(shared).flatten().to(model.device)
        self._shared_target = mapped[shared].to(model.device)
        # Rows of the draft's output that are no token (padding): never its greedy pick.
        spelled = torch.tensor([data is not None for data in bridge.draft.table[:rows]], dtype=torch.bool)
        self._unspelled = torch.nonzero(~spelled).flatten().to(model.device)
        self._rows = rows

    @property
    def draft_model(self) -> CausalLM:
        return self.model

    def draft_ids(self, context: Sequence[int]) -> list[int]:
        """The draft's ids for the target's `context`: the same bytes, its tokenizer's way."""
        ids = self.bridge.draft.encode(self.bridge.target.bytes_of(context))
        prefix = list(self.bridge.draft.prefix)
        return ids if ids[: len(prefix)] == prefix else prefix + ids

    def start(self, context: Sequence[int]) -> None:
        """The cache is brought up to the text when a draft is first asked for (`prepare`)."""

    def prepare(self, context: Sequence[int], plan: StepPlan) -> None:
        """Feed the draft, in one pass, the text it has not read but its last token (timed
        apart from drafting, as a same-tokenizer draft's is)."""
        ids = self.draft_ids(context)
        limit = self.model.max_length
        if limit is None or len(ids) < limit:  # else there is no room to draft (propose drafts nothing)
            self._read(ids[:-1])

    def _read(self, ids: list[int]) -> torch.Tensor | None:
        """Bring the cache to `ids` (rolled back to what it shares with them); the last
        one's logits where anything was fed."""
        common = common_prefix_length(self.model.cached_tokens, ids)
        self.model.rollback(common)
        if common < len(ids):
            return self.model.forward(ids[common:], all_logits=False)[-1]
        return None

    def _context_logits(self, context: Sequence[int]) -> tuple[torch.Tensor | None, int]:
        """The draft's logits after the text of `context`, and how many ids it read; None
        where the text gives it nothing to read or no room to draft."""
        ids = self.draft_ids(context)
        limit = self.model.max_length
        if not ids or (limit is not None and len(ids) >= limit):
            return None, len(ids)
        cached = common_prefix_length(self.model.cached_tokens, ids)
        self.model.rollback(min(cached, len(ids) - 1))  # the last id is fed again for its logits
        return self._read(ids), len(ids)

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
        logits, read = self._context_logits(context)
        if logits is None:
            return Draft([])
        limit = self.model.max_length
        room = k if limit is None else min(k, limit - read)
        if sampling.greedy:
            return self._by_text(logits, room)
        return self._shared_tokens(logits, room, sampling, generator, noise)

    def _by_text(self, logits: torch.Tensor, k: int) -> Draft:
        """Greedy: up to k draft tokens, their text written as target tokens (at most k)."""
        drafted: list[int] = []
        for i in range(k):
            token, confidence = greedy_pick(self._spelled(logits))
            drafted.append(int(token))
            # After a special token (the end of a turn) the draft's text would be guessing past it.
            if i + 1 == k or float(confidence) < self.stop_confidence or drafted[-1] in self.bridge.draft.special:
                break
            logits = self.model.forward([drafted[-1]], all_logits=False)[-1]
        text = self.bridge.draft.bytes_of(drafted)
        guesses = self.bridge.target.encode(text, complete=True)[:k]
        return Draft(list(itertools.takewhile(lambda token: token < self.target_vocab_size, guesses)))

    def _spelled(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits over the ids its tokenizer spells (-inf on padded rows)."""
        row = logits[: self._rows]
        if len(self._unspelled):
            row = row.index_fill(0, self._unspelled, float("-inf"))
        return row

    def _shared_tokens(
        self,
        logits: torch.Tensor,
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        noise: Noise | None,
    ) -> Draft:
        """Sampling: k tokens drawn from q restricted to the shared tokens (as target ids)."""
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        for i in range(k):
            row = logits.new_full((self.target_vocab_size,), float("-inf"))
            row[self._shared_target] = logits[self._shared_draft]
            if generator is not None:
                row = row.to(generator.device)
            token, q, confidence = draw(row, sampling, generator, None if noise is None else noise(i))
            assert q is not None  # sampling
            tokens.append(token)
            probs.append(q)
            if i + 1 == k or confidence < self.stop_confidence:
                break
            logits = self.model.forward([int(self.bridge.target_to_draft[token])], all_logits=False)[-1]
        return Draft(tokens, torch.stack(probs))

    def rollback(self, length: int) -> None:
        """Nothing to forget here: the next step writes the settled text again and rolls
        the cache back to what it shares with it."""
