"""The decode loop: draft, verify in one target pass, accept, roll the caches back, yield events.

Invariant between steps: the target's cache holds every context token but the last
(the "pending" token), so each verification pass feeds [pending] + draft and gets one
row of logits per position: k + 1 rows for k drafted tokens.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from speccli.autok.costs import CostCurve, PassTimes
from speccli.autok.policy import AcceptancePrior, DraftLengthPolicy, FixedDraftLength, KAuto
from speccli.backends.base import CausalLM, common_prefix_length
from speccli.config import SamplingConfig, SpecConfig
from speccli.context import check_fits
from speccli.coupling import PositionNoise, coupled
from speccli.drafters.base import Draft, Drafter
from speccli.events import (
    Event,
    EventStream,
    FinishEvent,
    FinishReason,
    PrefillEvent,
    Provenance,
    StepEvent,
    step_provenances,
)
from speccli.text import Detokenizer, OutputText
from speccli.tree import TreePass, TreeShape, kept_offsets, verify_tree
from speccli.verify import make_generator, verify_chain


@dataclass(frozen=True)
class StepOutcome:
    """What one step settled: the new tokens, where each came from, and the step's event."""

    tokens: list[int]
    provenances: list[Provenance]
    event: StepEvent


class SpeculativeDecoder:
    """Speculative decoding at batch size 1. With no drafter (or k = 0) it is plain
    target decoding through the same loop, which is what baselines are measured with."""

    def __init__(
        self,
        target: CausalLM,
        tokenizer: Detokenizer,
        eos_token_ids: Sequence[int],
        drafter: Drafter | None = None,
        costs: CostCurve | None = None,
        prior: AcceptancePrior | None = None,
    ) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.drafter = drafter
        # Measured pass costs (a calibration) to start `k=auto` from, instead of exploring;
        # the passes run since they were set, to check them against (`pass_times`).
        self.costs = costs
        # The draft's acceptance by position as an earlier session with this pair left it.
        self.prior = prior
        self.k_auto = KAuto()
        if self._needs_hidden:
            target.capture_hidden(drafter.feature_layers)

    @property
    def costs(self) -> CostCurve | None:
        return self._costs

    @costs.setter
    def costs(self, costs: CostCurve | None) -> None:
        self._costs = costs
        self.pass_times = PassTimes()

    @property
    def _needs_hidden(self) -> bool:
        """Whether the drafter drafts from the target's features (Medusa, EAGLE)."""
        return self.drafter is not None and self.drafter.needs_hidden

    def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingConfig,
        spec: SpecConfig,
        policy: DraftLengthPolicy | None = None,
    ) -> EventStream:
        """The events of one generation; see `EventStream` for a consumer that stops early."""
        output = OutputText(self.tokenizer, prompt_ids, spec.stop_strings)
        return EventStream(self._run(prompt_ids, sampling, spec, policy, output), output)

    def policy_for(self, spec: SpecConfig) -> DraftLengthPolicy:
        """The draft-length policy of a generation with these settings (the drafter's own
        for a fixed k; k auto's kept across generations)."""
        drafter = self.drafter
        if drafter is None:
            return FixedDraftLength(0)
        return drafter.policy(
            spec.k, self.costs, lambda: self.k_auto.policy(spec.max_k, self.costs, self.prior, drafter.match_acceptance)
        )

    def learned(self) -> AcceptancePrior | None:
        """What `k=auto` has learned about the draft's acceptance so far, for the next session."""
        return self.k_auto.learned()

    def _run(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingConfig,
        spec: SpecConfig,
        policy: DraftLengthPolicy | None,
        output: OutputText,
    ) -> Generator[Event, None, None]:
        if not prompt_ids:
            raise ValueError("the prompt must hold at least one token")
        max_length = self.target.max_length
        check_fits(len(prompt_ids), max_length)
        policy = policy or self.policy_for(spec)
        policy.begin()
        started = time.perf_counter()
        context = list(prompt_ids)
        reused = self._prefill(context)
        if self.drafter is not None:
            self.drafter.start(context)
        if self._needs_hidden and reused < len(context) - 1:
            self.drafter.observe_features(reused, self.target.last_hidden)
        yield PrefillEvent(len(context), reused, time.perf_counter() - started)

        generator = make_generator(self.target.device, sampling.seed)
        noise = PositionNoise(sampling.seed, self.target.vocab_size) if coupled(sampling) else None
        emitted = 0
        step = 0
        while True:
            room = spec.max_new_tokens - emitted - 1
            if max_length is not None:
                room = min(room, max_length - len(context))
            trees = spec.tree
            if self.drafter is not None:
                if self.drafter.keyed_by_match:
                    policy.expect(self.drafter.match_length(context))
                policy.offer(self.drafter.pool_candidates(context))
            k = max(0, min(policy.next_k(), room))
            if self.drafter is not None and self.drafter.always_trees:
                # Lookahead's steps are its own trees; those its policy holds back are prompt
                # lookup's, as `--draft ngram` drafts them: chains, or trees with --tree.
                plan = policy.plan()
                self.drafter.plan_step(plan)
                trees = plan.lookahead or spec.tree

            step += 1
            # The output position of the next token: the coupled rule's noise is chosen by it.
            position = len(context) - len(prompt_ids)
            if k > 0 and trees and self.drafter is not None and self.drafter.drafts_trees:
                outcome = self._tree_step(context, k, policy.tree_policy(), sampling, generator, noise, position, step)
            else:
                outcome = self._chain_step(context, k, sampling, generator, noise, position, step)
            policy.observe(outcome.event)
            self.pass_times.record(outcome.event.fed, outcome.event.verify_seconds)
            context.extend(outcome.tokens)
            if noise is not None:
                noise.forget_before(position + len(outcome.tokens))

            finish: FinishReason | None = None
            for index, token in enumerate(outcome.tokens):
                if token in self.eos_token_ids:
                    finish = FinishReason.EOS
                    break
                emitted += 1
                output.push(token, outcome.provenances[index], step, index)
                yield from output.take()
                if output.stopped_by is not None:
                    finish = FinishReason.STOP_STRING
                    break
                if emitted >= spec.max_new_tokens:
                    finish = FinishReason.LENGTH
                    break
            yield outcome.event
            if finish is None and max_length is not None and len(context) >= max_length:
                finish = FinishReason.CONTEXT
            if finish is not None:
                output.finish()
                if output.stopped_by is not None:
                    # Also when the stop string only showed in the last, incomplete character.
                    finish = FinishReason.STOP_STRING
                yield from output.take()
                seconds = time.perf_counter() - started
                yield FinishEvent(finish, emitted, step, seconds, stop_string=output.stopped_by)
                return

    def _chain_step(
        self,
        context: list[int],
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator,
        noise: PositionNoise | None,
        position: int,
        step: int,
    ) -> StepOutcome:
        draft_started = self._clock()
        caught_up = self._catch_up(context, k)
        draft = Draft([])
        if k > 0 and self.drafter is not None:
            draft_noise = None if noise is None else noise.from_position(position)
            draft = self.drafter.propose(context, k, sampling, generator, noise=draft_noise)
        verify_started = self._clock()
        logits = self.target.forward([context[-1], *draft.tokens])
        draft_ids = torch.tensor(draft.tokens, dtype=torch.long, device=logits.device)
        rows = None if noise is None else noise.rows(position, len(draft) + 1)
        verdict = verify_chain(logits, draft_ids, draft.probs, sampling, generator, rows)
        settled = len(context) + verdict.accepted
        self.target.rollback(settled)
        if self.drafter is not None:
            self.drafter.rollback(settled)
        if self._needs_hidden:
            self.drafter.observe_features(len(context) - 1, self.target.last_hidden[: verdict.accepted + 1])
        tokens = draft.tokens[: verdict.accepted] + [verdict.next_token]
        event = StepEvent(
            step=step,
            drafted=len(draft),
            accepted=verdict.accepted,
            draft_seconds=verify_started - draft_started,
            verify_seconds=self._clock() - verify_started,
            catch_up_seconds=caught_up,
        )
        return StepOutcome(tokens, step_provenances(verdict.accepted, len(draft), verdict.resampled), event)

    def _tree_step(
        self,
        context: list[int],
        k: int,
        policy: DraftLengthPolicy,
        sampling: SamplingConfig,
        generator: torch.Generator,
        noise: PositionNoise | None,
        position: int,
        step: int,
    ) -> StepOutcome:
        """Draft a tree k deep, verify it in one pass (speccli.tree), keep the
        accepted path in the target's cache."""
        draft_started = self._clock()
        caught_up = self._catch_up(context, k)
        draft_noise = None if noise is None else noise.from_position(position)
        live = policy.costs.curve if policy.costs is not None else None
        shape = TreeShape.for_costs(k, live, self.costs)
        if self.target.max_length is not None:
            # The pass holds the pending token and every node until the path is kept.
            shape = replace(shape, max_nodes=min(shape.max_nodes, self.target.max_length - len(context)))
        tree = self.drafter.propose_tree(context, shape, sampling, generator, noise=draft_noise)
        verify_started = self._clock()
        cached = len(self.target.cached_tokens)
        branch = self.drafter.branch(context)  # lookahead decoding's Jacobi window
        if branch is not None and not self._branch_fits(cached, len(tree) + 1 + len(branch)):
            branch = None
        fed = TreePass.of(context[-1], tree, cached, branch)
        logits = self.target.forward_tree(fed.tokens, fed.positions, fed.visible, cached)
        if branch is not None:
            self.drafter.advance(torch.argmax(logits[fed.tree_rows :], dim=-1).tolist())
            logits = logits[: fed.tree_rows]
        rows = None if noise is None else noise.rows(position, tree.depth + 1)[tree.fed_depths()]
        verdict = verify_tree(logits, tree, sampling, generator, rows)
        kept = kept_offsets(verdict.path)
        self.target.keep(cached, kept)
        if self._needs_hidden:
            self.drafter.observe_features(len(context) - 1, self.target.last_hidden[kept])
        self.drafter.settle_tree(verdict.path, len(context) + verdict.accepted)
        tokens = [tree.tokens[node] for node in verdict.path] + [verdict.next_token]
        guess = self.drafter.guess  # lookahead's: prompt lookup's guess in the tree
        event = StepEvent(
            step=step,
            drafted=tree.depth,
            accepted=verdict.accepted,
            draft_seconds=verify_started - draft_started,
            verify_seconds=self._clock() - verify_started,
            fed=len(fed.tokens),
            tree=True,
            catch_up_seconds=caught_up,
            guessed=len(guess),
            guessed_kept=common_prefix_length(guess, tokens[:-1]),
        )
        return StepOutcome(tokens, step_provenances(verdict.accepted, len(tree), verdict.resampled), event)

    def _branch_fits(self, cached: int, fed: int) -> bool:
        """Whether the lookahead branch may ride in a pass of `fed` tokens (the tree's and
        its own) after `cached` ones: within the target's context, and no larger than the
        largest pass measured. Past that its cost is unknown, and the tree
        has filled the measured pass itself (prompt lookup's guess on a run of copied text,
        worth more this step than the window's n-grams for later ones); the window then
        waits a step."""
        if self.target.max_length is not None and cached + fed > self.target.max_length:
            return False
        return self.costs is None or fed <= self.costs.largest

    def _clock(self) -> float:
        """Seconds on a clock that stands still during one-time work inside the models'
        passes (a CUDA graph captured on first use): the steps' timings teach k auto what a
        pass costs, and a capture is not part of that."""
        setup = self.target.setup_seconds
        if self.drafter is not None and self.drafter.draft_model is not None:
            setup += self.drafter.draft_model.setup_seconds
        return time.perf_counter() - setup

    def _catch_up(self, context: list[int], k: int) -> float:
        """Before a step that drafts: let a draft model read what it has not (see
        ModelDrafter.catch_up). Returns the seconds it took."""
        if k <= 0 or self.drafter is None or self.drafter.draft_model is None:
            return 0.0
        started = self._clock()
        self.drafter.catch_up(context)
        return self._clock() - started

    def _prefill(self, context: list[int]) -> int:
        """Bring all but the last prompt token into the target's cache, reusing what a
        previous generation left there. Returns the number of tokens reused."""
        settled = context[:-1]
        reused = common_prefix_length(self.target.cached_tokens, settled)
        if self._needs_hidden:
            # Features are only computed by a pass: feed again what the drafter lacks.
            reused = min(reused, self.drafter.features_from(context))
        self.target.rollback(reused)
        if reused < len(settled):
            self.target.forward(settled[reused:], all_logits=False)
        return reused
