"""The decode loop: draft, verify in one target pass, accept, roll the caches back, yield events.

Invariant between steps: the target's cache holds every context token but the last
(the "pending" token), so each verification pass feeds [pending] + draft and gets one
row of logits per position: k + 1 rows for k drafted tokens.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from speccli.autok.costs import CostProfile, PassTimes
from speccli.autok.policy import (
    AcceptancePrior,
    AdaptiveDraftLength,
    DraftLengthByMatch,
    DraftLengthPolicy,
    FixedDraftLength,
)
from speccli.backends.base import CausalLM, common_prefix_length
from speccli.config import SamplingConfig, SpecConfig
from speccli.context import check_fits
from speccli.coupling import PositionNoise, perturbed, verify_coupled
from speccli.drafters.base import Draft, Drafter
from speccli.drafters.ngram import LOOKUP_ACCEPTANCE
from speccli.events import (
    Event,
    FinishEvent,
    FinishReason,
    PrefillEvent,
    Provenance,
    StepEvent,
    TokenEvent,
)
from speccli.text import Detokenizer, OutputText
from speccli.tree import TreeShape, kept_offsets, verify_tree_greedy, verify_tree_sampled
from speccli.verify import Verdict, verify_greedy, verify_sampled, warp


# Nodes of a tree verified in one pass when no costs were measured (a fixed k, no calibration).
DEFAULT_TREE_NODES = 8


@dataclass(frozen=True)
class StepOutcome:
    """What one step settled: the new tokens, where each came from, and the step's event."""

    tokens: list[int]
    provenances: list[Provenance]
    event: StepEvent


def provenance_of(position: int, drafted: int, accepted: int) -> Provenance:
    if position < accepted:
        return Provenance.ACCEPTED
    if drafted == 0:
        return Provenance.TARGET
    return Provenance.BONUS if accepted == drafted else Provenance.RESAMPLED


def coupled(sampling: SamplingConfig) -> bool:
    """Whether a generation samples by the coupled rule (speccli.coupling): with a
    seed, so that the output is the target's own sample for that seed, whatever the drafter,
    k or timing. Without one, the rejection rule of Leviathan et al., whose acceptance is
    the higher (see the README)."""
    return not sampling.greedy and sampling.seed is not None


def _make_generator(device: torch.device, seed: int | None) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


class EventStream(Iterator[Event]):
    """The events of one generation, as `SpeculativeDecoder.generate` returns them.

    A generation that runs to its end releases every token's event, its FinishEvent last.
    A consumer that stops before the end (Ctrl-C, whether it lands in the engine or in the
    consumer's own code, or a break) calls `flush()`: it ends the generation and returns
    the token events still held back, so that the joined text of all token events is the
    tokenizer's decode of their ids, an incomplete character at the end included (U+FFFD).
    Held back are tokens whose text might begin a stop string and tokens ending in an
    incomplete multi-byte character. They are tokens like the others (count them, show
    them). After a generation that finished, `flush()` returns [].
    """

    def __init__(self, events: Generator[Event, None, None], output: OutputText) -> None:
        self._events = events
        self._output = output

    def __iter__(self) -> "EventStream":
        return self

    def __next__(self) -> Event:
        return next(self._events)

    def close(self) -> None:
        self._events.close()

    def flush(self) -> list[TokenEvent]:
        self._events.close()
        self._output.finish()
        return list(self._output.take())


class SpeculativeDecoder:
    """Speculative decoding at batch size 1. With no drafter (or k = 0) it is plain
    target decoding through the same loop, which is what baselines are measured with."""

    def __init__(
        self,
        target: CausalLM,
        tokenizer: Detokenizer,
        eos_token_ids: Sequence[int],
        drafter: Drafter | None = None,
        costs: CostProfile | None = None,
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
        # Kept across generations: what it learned about this machine's costs and the
        # draft's acceptance carries over from one prompt (or chat turn) to the next.
        self._adaptive: AdaptiveDraftLength | DraftLengthByMatch | None = None
        self._adaptive_from: tuple = ()
        if self._needs_hidden:
            target.capture_hidden()

    @property
    def costs(self) -> CostProfile | None:
        return self._costs

    @costs.setter
    def costs(self, costs: CostProfile | None) -> None:
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
        policy = policy or self._policy_for(spec)
        policy.begin()
        started = time.perf_counter()
        context = list(prompt_ids)
        reused = self._prefill(context)
        if self.drafter is not None:
            self.drafter.start(context)
        if self._needs_hidden and reused < len(context) - 1:
            self.drafter.observe_features(reused, self.target.last_hidden)
        yield PrefillEvent(len(context), reused, time.perf_counter() - started)

        generator = _make_generator(self.target.device, sampling.seed)
        noise = PositionNoise(sampling.seed, self.target.vocab_size) if coupled(sampling) else None
        emitted = 0
        step = 0
        while True:
            room = spec.max_new_tokens - emitted - 1
            if max_length is not None:
                room = min(room, max_length - len(context))
            if self.drafter is not None:
                if self.drafter.keyed_by_match:
                    policy.expect(self.drafter.match_length(context))
                policy.offer(self.drafter.pool_candidates(context))
            k = max(0, min(policy.next_k(), room))

            # The output position of the next token: the coupled rule's noise is chosen by it.
            next_position = len(context) - len(prompt_ids)
            step += 1
            trees = spec.tree
            if self.drafter is not None and self.drafter.always_trees:
                # Lookahead's steps are its own trees; those its policy holds back are prompt
                # lookup's, as `--draft ngram` drafts them: chains, or trees with --tree.
                plan = policy.plan()
                self.drafter.plan_step(plan)
                trees = plan.lookahead or spec.tree
            if k > 0 and trees and self.drafter is not None and self.drafter.drafts_trees:
                outcome = self._tree_step(context, k, policy.tree_policy(), sampling, generator, noise, next_position, step)
            else:
                outcome = self._chain_step(context, k, sampling, generator, noise, next_position, step)
            step_event = outcome.event
            policy.observe(step_event)
            self.pass_times.record(step_event.fed, step_event.verify_seconds)
            new_tokens = outcome.tokens
            context.extend(new_tokens)
            if noise is not None:
                noise.forget_before(next_position + len(new_tokens))

            finish: FinishReason | None = None
            for position, token in enumerate(new_tokens):
                if token in self.eos_token_ids:
                    finish = FinishReason.EOS
                    break
                emitted += 1
                output.push(token, outcome.provenances[position], step, position)
                yield from output.take()
                if output.stopped_by is not None:
                    finish = FinishReason.STOP_STRING
                    break
                if emitted >= spec.max_new_tokens:
                    finish = FinishReason.LENGTH
                    break
            yield step_event
            if finish is None and max_length is not None and len(context) >= max_length:
                finish = FinishReason.CONTEXT
            if finish is not None:
                output.finish()
                if output.stopped_by is not None:
                    # Also when the stop string only showed in the last, incomplete character.
                    finish = FinishReason.STOP_STRING
                yield from output.take()
                yield FinishEvent(
                    reason=finish,
                    new_tokens=emitted,
                    steps=step,
                    seconds=time.perf_counter() - started,
                    stop_string=output.stopped_by,
                )
                return

    def _policy_for(self, spec: SpecConfig) -> DraftLengthPolicy:
        if self.drafter is None:
            return FixedDraftLength(0)
        measured = self.costs.verify_seconds if self.costs else None
        return self.drafter.policy(spec.k, measured, lambda: self._adaptive_policy(spec))

    def _adaptive_policy(self, spec: SpecConfig) -> AdaptiveDraftLength | DraftLengthByMatch:
        """k auto's policy, kept across generations while the costs and the prior it started from hold."""
        started_from = (spec.max_k, self.costs, self.prior)
        same = len(self._adaptive_from) == 3 and self._adaptive_from[0] == spec.max_k and all(
            a is b for a, b in zip(self._adaptive_from[1:], started_from[1:])
        )
        if self._adaptive is None or not same:
            # Built here, and again when the costs change (a calibration arrived): the
            # policy always starts from the costs and the prior the decoder was given.
            # Drafts are at most as long as the calibration measured passes for.
            max_k = spec.max_k
            if self.costs is not None:
                max_k = max(1, min(max_k, max(self.costs.verify_seconds) - 1))
            if self.drafter.keyed_by_match:
                # Prompt lookup: acceptance kept by the length of the n-gram matched.
                self._adaptive = DraftLengthByMatch(lambda match: self._lookup_policy(max_k, match))
            else:
                prior = {}
                if self.prior is not None and self.prior.acceptance:
                    prior = {"prior_acceptance": self.prior.acceptance, "prior_steps": self.prior.steps}
                    if self.prior.opening is not None:
                        prior["opening_prior"] = self.prior.opening.acceptance[0]
                        prior["opening_prior_steps"] = self.prior.opening.steps
                self._adaptive = AdaptiveDraftLength(max_k=max_k, **prior)
            self._adaptive_from = started_from
            if self.costs is not None:
                self._adaptive.costs.seed(self.costs.verify_seconds, self.costs.draft_seconds)
        return self._adaptive

    def _lookup_policy(self, max_k: int, match: int) -> AdaptiveDraftLength:
        """k auto for prompt lookup's drafts after a match of this length: from what an
        earlier session learned of them, else from what such drafts measured."""
        learned = self.prior.for_match(match) if self.prior is not None else None
        if learned is not None:
            return AdaptiveDraftLength(max_k=max_k, prior_acceptance=learned.acceptance, prior_steps=learned.steps)
        prior = LOOKUP_ACCEPTANCE.get(match, LOOKUP_ACCEPTANCE[max(LOOKUP_ACCEPTANCE)])
        return AdaptiveDraftLength(max_k=max_k, prior_acceptance=prior)

    def _chain_step(
        self,
        context: list[int],
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator,
        noise: PositionNoise | None,
        next_position: int,
        step: int,
    ) -> StepOutcome:
        draft_started = self._clock()
        caught_up = self._catch_up(context, k)
        draft = Draft([])
        if k > 0 and self.drafter is not None:
            draft_noise = None if noise is None else noise.from_position(next_position)
            draft = self.drafter.propose(context, k, sampling, generator, noise=draft_noise)
        verify_started = self._clock()
        verdict = self._verify(context[-1], draft, sampling, generator, noise, next_position)
        self._settle(len(context) + verdict.accepted)
        if self._needs_hidden:
            self.drafter.observe_features(len(context) - 1, self.target.last_hidden[: verdict.accepted + 1])
        tokens = draft.tokens[: verdict.accepted] + [verdict.next_token]
        return StepOutcome(
            tokens=tokens,
            provenances=[provenance_of(i, len(draft), verdict.accepted) for i in range(len(tokens))],
            event=StepEvent(
                step=step,
                drafted=len(draft),
                accepted=verdict.accepted,
                draft_seconds=verify_started - draft_started,
                verify_seconds=self._clock() - verify_started,
                catch_up_seconds=caught_up,
            ),
        )

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

    def _tree_step(
        self,
        context: list[int],
        k: int,
        policy: DraftLengthPolicy,
        sampling: SamplingConfig,
        generator: torch.Generator,
        noise: PositionNoise | None,
        next_position: int,
        step: int,
    ) -> StepOutcome:
        """Draft a tree k deep, verify it in one pass (speccli.tree), keep the
        accepted path in the target's cache."""
        draft_started = self._clock()
        caught_up = self._catch_up(context, k)
        draft_noise = None if noise is None else noise.from_position(next_position)
        shape = self._tree_shape(k, policy)
        if self.target.max_length is not None:
            # The pass holds the pending token and every node until the path is kept.
            shape = replace(shape, max_nodes=min(shape.max_nodes, self.target.max_length - len(context)))
        tree = self.drafter.propose_tree(context, shape, sampling, generator, noise=draft_noise)
        verify_started = self._clock()
        cached = len(self.target.cached_tokens)
        depths = tree.fed_depths()
        fed = [context[-1], *tree.tokens]
        positions = [cached + d for d in depths]
        visible = tree.visibility()
        branch = self.drafter.branch(context)
        if branch is not None and self._branch_fits(cached, len(fed) + len(branch)):
            # Lookahead decoding's Jacobi window rides along: it sees the pending token and
            # itself, the tree does not see it, and none of it stays in the cache.
            fed += branch.tokens
            positions += [cached + offset for offset in branch.offsets]
            visible = branch.beside(visible)
        else:
            branch = None
        logits = self.target.forward_tree(fed, positions, visible, cached)
        if branch is not None:
            self.drafter.advance(torch.argmax(logits[len(tree) + 1 :], dim=-1).tolist())
            logits = logits[: len(tree) + 1]
        if sampling.greedy:
            verdict = verify_tree_greedy(logits, tree)
        elif noise is not None:
            rows = noise.rows(next_position, tree.depth + 1)[depths]
            verdict = verify_tree_greedy(perturbed(warp(logits, sampling), rows), tree)
        else:
            verdict = verify_tree_sampled(warp(logits, sampling), tree, generator)
        kept = kept_offsets(verdict.path)
        self.target.keep(cached, kept)
        if self._needs_hidden:
            self.drafter.observe_features(len(context) - 1, self.target.last_hidden[kept])
        self.drafter.settle_tree(verdict.path, len(context) + len(verdict.path))
        tokens = [tree.tokens[node] for node in verdict.path] + [verdict.next_token]
        guess = self.drafter.guess  # lookahead's: prompt lookup's guess in the tree
        last = Provenance.RESAMPLED if verdict.resampled else Provenance.BONUS
        if not tree:
            last = Provenance.TARGET
        return StepOutcome(
            tokens=tokens,
            provenances=[Provenance.ACCEPTED] * len(verdict.path) + [last],
            event=StepEvent(
                step=step,
                drafted=tree.depth,
                accepted=len(verdict.path),
                draft_seconds=verify_started - draft_started,
                verify_seconds=self._clock() - verify_started,
                fed=len(fed),
                tree=True,
                catch_up_seconds=caught_up,
                guessed=len(guess),
                guessed_kept=common_prefix_length(guess, tokens[:-1]),
            ),
        )

    def _branch_fits(self, cached: int, fed: int) -> bool:
        """Whether the lookahead branch may ride in a pass of `fed` tokens (the tree's and
        its own) after `cached` ones: within the target's context, and no larger than the
        largest pass measured. Past that its cost is unknown, and the tree
        has filled the measured pass itself (prompt lookup's guess on a run of copied text,
        worth more this step than the window's n-grams for later ones); the window then
        waits a step."""
        if self.target.max_length is not None and cached + fed > self.target.max_length:
            return False
        return self.costs is None or fed <= max(self.costs.verify_seconds)

    def _tree_shape(self, k: int, policy: DraftLengthPolicy) -> TreeShape:
        """How large a tree may grow: k deep, with as many nodes as the measured costs
        say pay (up to the largest pass measured, and at least DEFAULT_TREE_NODES)."""
        costs = policy.costs
        if costs is not None and costs.verify:
            # Unmeasured sizes are guessed optimistically, so that they get tried and measured.
            largest = max(max(costs.verify), k + 1, DEFAULT_TREE_NODES + 1)
            seconds = [None, *(costs.verify_seconds(fed) for fed in range(1, largest + 1))]
            return TreeShape(k, largest - 1, seconds, costs.draft_per_token)
        if self.costs is not None:
            largest = max(self.costs.verify_seconds)
            seconds = [None, *(self.costs.verify_seconds.get(fed) for fed in range(1, largest + 1))]
            return TreeShape(k, max(k, largest - 1), seconds, self.costs.draft_seconds)
        return TreeShape(k, max(k, DEFAULT_TREE_NODES))

    def _settle(self, settled: int) -> None:
        self.target.rollback(settled)
        if self.drafter is not None:
            self.drafter.rollback(settled)

    def learned(self) -> AcceptancePrior | None:
        """What `k=auto` has learned about the draft's acceptance so far (with the prior it
        started from), for the next session; None before it drafted."""
        return self._adaptive.learned() if self._adaptive is not None else None

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

    def _verify(
        self,
        pending: int,
        draft: Draft,
        sampling: SamplingConfig,
        generator: torch.Generator,
        noise: PositionNoise | None = None,
        position: int = 0,
    ) -> Verdict:
        logits = self.target.forward([pending, *draft.tokens])
        draft_ids = torch.tensor(draft.tokens, dtype=torch.long, device=logits.device)
        if sampling.greedy:
            return verify_greedy(logits, draft_ids)
        if noise is not None:
            return verify_coupled(warp(logits, sampling), draft_ids, noise.rows(position, len(draft) + 1))
        q = None if draft.probs is None else draft.probs.to(logits.device)
        return verify_sampled(warp(logits, sampling), draft_ids, q, generator)
