"""k auto over several drafters at once (speccli.drafters.candidates): each step, the one whose
own policy's plan promises the most tokens per second."""

from __future__ import annotations

from dataclasses import replace
from typing import Collection, Mapping

from speccli.autok.plan import DraftSignal, Graft, StepPlan
from speccli.autok.policy import DraftLengthPolicy, KAutoPolicy
from speccli.events import StepEvent


class MethodChooser(DraftLengthPolicy):
    """Each candidate keeps its own k auto (acceptance by position, or by the length of the
    n-gram matched), and every candidate's pass costs follow every step: the target's passes
    are the same whoever drafted. Each step, every candidate's policy plans the step as if it
    drafted alone; the plan with the most expected tokens per second of its modelled cost
    runs. A candidate's policy already plans k 0 where drafting does not pay for it, so a
    step is plain when no candidate's does. What a step says about acceptance reaches only
    the policy that planned it; a plain step reaches every one (their probes count it).

    A step another candidate drafts is priced with one more of the first candidate's draft
    passes: the first (a draft model, or heads) reads what that step settled before it
    drafts again, a cost of the other's step, not of its own.

    A `graftable` candidate (one whose guess costs no pass: prompt lookup, suffix drafting)
    that would draft too, but is not the one chosen, has its guess grafted into the chosen
    one's tree where the step is a tree (speccli.tree.graft): its own policy, the same that
    would have it draft alone, says the guess is worth a pass's room. What the guess did
    reaches that policy as a shadow; the chosen one learns from its own nodes alone."""

    def __init__(self, policies: Mapping[str, KAutoPolicy], graftable: Collection[str] = ()) -> None:
        if not policies:
            raise ValueError("a chooser needs at least one candidate")
        self.policies = dict(policies)
        self.graftable = frozenset(graftable)
        self._chosen: str | None = None
        self._last: str | None = None  # the candidate that drafted the last step (None: plain)

    def begin(self) -> None:
        self._last = None
        for policy in self.policies.values():
            policy.begin()

    def plan(self, signal: DraftSignal, room: int, trees: bool) -> StepPlan:
        best: StepPlan | None = None
        best_rate = -1.0
        graft: tuple[float, str, int, KAutoPolicy] | None = None  # the best graftable: rate, name, k, policy
        first = next(iter(self.policies.values()))
        for name, policy in self.policies.items():
            part = signal.part(name)
            if part.shadow is not None and name != self._last:
                policy.shadow(part.shadow)  # what its guess would have done in the step another drafted
            plan = policy.plan(part, room, trees)
            if plan.k == 0:
                continue
            seconds = policy.costs.step_seconds(plan.k)
            if seconds and policy is not first:
                seconds += first.costs.draft_per_token or 0.0
            # Without measured costs (the first steps of an uncalibrated run) the first
            # candidate that drafts runs, until the steps have measured them.
            rate = policy.expected(plan.k) / seconds if seconds else 0.0
            if rate > best_rate:
                best, best_rate = replace(plan, source=name), rate
            if name in self.graftable and (graft is None or rate > graft[0]):
                graft = (rate, name, plan.k, policy)
        self._chosen = best.source if best is not None else None
        if best is None:
            return StepPlan()
        if graft is not None and graft[1] != best.source:
            _, name, k, policy = graft
            survival = tuple(policy.expected(i + 1) - policy.expected(i) for i in range(k))
            best = replace(best, graft=Graft(name, k, survival, rate=max(best_rate, 0.0)))
        return best

    def plain_seconds(self) -> float | None:
        return next(iter(self.policies.values())).plain_seconds()

    def observe(self, step: StepEvent) -> None:
        chosen, self._chosen = self._chosen, None
        self._last = chosen if step.drafted else None
        for name, policy in self.policies.items():
            if chosen is None:
                policy.observe(step)
            elif name == chosen:
                own = step if step.own is None else replace(step, drafted=step.own[0], accepted=step.own[1])
                policy.observe(own)
            else:
                policy.costs.observe_pass(step)

    def next_k(self) -> int:
        raise TypeError("a MethodChooser plans whole steps (plan), not a draft length alone")
