"""Several drafters behind one: `--draft A+B` (a draft model and prompt lookup, say). Each step
the policy chooses which of them drafts (speccli.autok.chooser); the others only follow the
settled text, so that any of them can draft the next step."""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from speccli.autok.chooser import MethodChooser
from speccli.autok.costs import CostCurve
from speccli.autok.plan import DraftSignal, StepPlan
from speccli.autok.policy import (
    AdaptiveDraftLength,
    DraftLengthByMatch,
    DraftLengthPolicy,
    FixedDraftLength,
    KAutoFactory,
    KAutoPolicy,
)
from speccli.backends.base import CausalLM
from speccli.config import SamplingConfig
from speccli.coupling import Noise
from speccli.drafters.base import Draft, Drafter, FeatureReader, LearnsText, Settled, TreeDraft
from speccli.tree import TreeShape
from speccli.tree import graft as grafted

# A fixed k drafts with prompt lookup (a cheap candidate) where its match is at least this
# long (its drafts come true most often there: speccli.drafters.ngram.LOOKUP_ACCEPTANCE), and
# with the first candidate elsewhere.
LONG_MATCH = 3
CHEAP = ("suffix", "ngram")  # the candidates that draft from a match, at no model pass


class CandidateDrafter(Drafter):
    """Drafters that take turns: the plan's `source` names the one that drafts a step."""

    def __init__(self, candidates: Sequence[Drafter], graft: bool = True) -> None:
        """`graft`: a cheap candidate's guess may ride in another's tree (MethodChooser)."""
        names = [candidate.name for candidate in candidates]
        if len(candidates) < 2 or len(set(names)) != len(names):
            raise ValueError(f"candidates need two or more drafters of different names, got {names}")
        if sum(candidate.features is not None for candidate in candidates) > 1:
            raise ValueError("at most one candidate may draft from the target's features")
        self.candidates = {candidate.name: candidate for candidate in candidates}
        self.name = "+".join(names)
        # Trees where every candidate drafts them: a chain drafted from q is verified as one.
        self.drafts_trees = all(candidate.drafts_trees for candidate in candidates)
        self.graft = graft
        self._active: Drafter = candidates[0]
        self._plan = StepPlan()
        self._chooser: MethodChooser | None = None

    @property
    def draft_model(self) -> CausalLM | None:
        return next((c.draft_model for c in self.candidates.values() if c.draft_model is not None), None)

    @property
    def features(self) -> FeatureReader | None:
        return next((c.features for c in self.candidates.values() if c.features is not None), None)

    def start(self, context: Sequence[int]) -> None:
        for candidate in self.candidates.values():
            candidate.start(context)

    def policy(self, k: int | str, measured: CostCurve | None, adaptive: KAutoFactory) -> DraftLengthPolicy:
        """k auto: each candidate's own k auto (the first's is the one an earlier session's
        acceptance starts and the next one inherits), chosen between step by step. A fixed k:
        prompt lookup where its match is long, else the first candidate."""
        if isinstance(k, int):
            return LongMatchFirst(list(self.candidates), k)
        policies: dict[str, AdaptiveDraftLength | DraftLengthByMatch] = {}
        for index, (name, candidate) in enumerate(self.candidates.items()):
            own = adaptive if index == 0 else _keyed(adaptive, name)
            policy = candidate.policy(k, measured, own)
            if not isinstance(policy, (AdaptiveDraftLength, DraftLengthByMatch)):
                raise ValueError(f"the {name} drafter cannot take turns with others under k auto")
            policies[name] = policy
        kept = self._chooser
        if kept is None or list(kept.policies.values()) != list(policies.values()):
            # Kept while the candidates' policies are: what the decoder keeps over it (the measured
            # rates, the ways stopped) then carries from one generation to the next as well.
            graftable = [name for name in policies if name in CHEAP] if self.graft else []
            kept = self._chooser = MethodChooser(policies, graftable)
        return kept

    def signal(self, context: Sequence[int]) -> DraftSignal:
        parts = tuple((name, candidate.signal(context)) for name, candidate in self.candidates.items())
        return DraftSignal(
            match=max(part.match for _, part in parts), pooled=max(part.pooled for _, part in parts), parts=parts
        )

    def prepare(self, context: Sequence[int], plan: StepPlan) -> None:
        self._plan = plan
        self._active = self.candidates[plan.source] if plan.source is not None else next(iter(self.candidates.values()))
        self._active.prepare(context, plan)

    def propose(
        self,
        context: Sequence[int],
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        noise: Noise | None = None,
    ) -> Draft:
        return self._active.propose(context, k, sampling, generator, noise)

    def propose_tree(
        self,
        context: Sequence[int],
        shape: TreeShape,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        noise: Noise | None = None,
    ) -> TreeDraft:
        """The active candidate's tree, with the plan's graft (a cheap candidate's guess) in it."""
        drafted = self._active.propose_tree(context, shape, sampling, generator, noise)
        graft = self._plan.graft
        if graft is None or self.candidates[graft.source] is self._active or drafted.branch is not None:
            return drafted
        guess = self.candidates[graft.source].propose(context, graft.k, sampling, generator).tokens
        if not guess:
            return drafted

        def worth(position: int, nodes: int) -> bool:
            now, more = shape.pass_cost(nodes + 1), shape.pass_cost(nodes + 2)
            return graft.worth(position, None if now is None or more is None else more - now)

        tree = grafted(drafted.tree, guess, max(shape.max_nodes, len(drafted.tree)), worth)
        return TreeDraft(tree, guess=guess, own=len(drafted.tree))

    def settle(self, settled: Settled) -> None:
        for candidate in self.candidates.values():
            if candidate is self._active:
                candidate.settle(settled)
            else:
                candidate.rollback(settled.length)

    def rollback(self, length: int) -> None:
        for candidate in self.candidates.values():
            candidate.rollback(length)

    def learn_text(self, tokens: Sequence[int]) -> None:
        """A generation's prompt and answer, for the candidates that learn from texts."""
        for candidate in self.candidates.values():
            if isinstance(candidate, LearnsText):
                candidate.learn_text(tokens)


class LongMatchFirst(FixedDraftLength):
    """A fixed k over candidates: suffix drafting or prompt lookup (`ngram`) where its match is
    LONG_MATCH tokens or more, else the first candidate."""

    def __init__(self, names: Sequence[str], k: int) -> None:
        super().__init__(k)
        self.names = list(names)

    def plan(self, signal: DraftSignal, room: int, trees: bool) -> StepPlan:
        k = self.draft_length(signal, room)
        source = self.names[0]
        for cheap in CHEAP:
            if cheap in self.names and signal.part(cheap).match >= LONG_MATCH:
                source = cheap
                break
        return StepPlan(k, tree=trees and k > 0, source=source if k > 0 else None)


def _keyed(adaptive: KAutoFactory, name: str) -> KAutoFactory:
    """The factory of the k auto policies kept for candidate `name`, apart from the first's."""

    def factory(match_acceptance: Mapping[int, Sequence[float]] | None, key: str | None = None) -> KAutoPolicy:
        return adaptive(match_acceptance, key or name)

    return factory
