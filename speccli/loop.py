"""The decode loop: draft, verify in one target pass, accept, roll the caches back, yield events.

Invariant between steps: the target's cache holds every context token but the last
(the "pending" token), so each verification pass feeds [pending] + draft and gets one
row of logits per position: k + 1 rows for k drafted tokens.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass, replace
from typing import Iterable, Mapping, Sequence, TypeGuard

import torch

from speccli.autok.costs import CostCurve, PassTimes
from speccli.autok.measured import MeasuredChoice, MethodRates
from speccli.autok.plan import StepPlan
from speccli.autok.policy import AcceptancePrior, DraftLengthPolicy, KAuto, KAutoPolicy
from speccli.backends.base import CausalLM, FeatureLM, common_prefix_length
from speccli.config import SamplingConfig, SpecConfig
from speccli.context import check_fits
from speccli.coupling import PositionNoise, coupled
from speccli.drafters.base import Draft, Drafter, FeatureReader, PlainDecoding, Settled
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
from speccli.tree import TreePass, TreeShape, kept_offsets, own_share, verify_tree
from speccli.verify import make_generator, verify_chain


@dataclass(frozen=True)
class StepOutcome:
    """What one step settled: the new tokens, where each came from, and the step's event."""

    tokens: list[int]
    provenances: list[Provenance]
    event: StepEvent


@dataclass(frozen=True)
class FeatureFeed:
    """The target's features, handed to a drafter that drafts from them (Medusa, EAGLE)."""

    target: FeatureLM
    reader: FeatureReader

    def start(self, context: Sequence[int], reused: int) -> int:
        """Of the `reused` cached tokens, how many the prefill may skip: features are only
        computed by a pass, so what the drafter lacks is fed again."""
        return min(reused, self.reader.features_from(context))

    def hand_over(self, start: int, rows: slice | list[int]) -> None:
        """The features of the last pass at `rows`, for the settled positions from `start`."""
        self.reader.observe_features(start, self.target.last_hidden[rows])


class SpeculativeDecoder:
    """Speculative decoding at batch size 1. With no drafter (or k = 0) it is plain
    target decoding through the same loop, which is what baselines are measured with."""

    def __init__(
        self,
        target: CausalLM,
        tokenizer: Detokenizer,
        eos_token_ids: Iterable[int],
        drafter: Drafter | None = None,
        costs: CostCurve | None = None,
        prior: AcceptancePrior | None = None,
    ) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.drafter = drafter
        # What each step asks for guesses: plain decoding's where there is no drafter.
        self._source: Drafter = drafter if drafter is not None else PlainDecoding()
        # Measured pass costs (a calibration) to start `k=auto` from, instead of exploring;
        # the passes run since they were set, to check them against (`pass_times`).
        self.costs = costs
        # The draft's acceptance by position as an earlier session with this pair left it.
        self.prior = prior
        self.k_auto = KAuto()
        # k auto of the candidates after the first, where drafters take turns (by name).
        self._candidate_k_autos: dict[str, KAuto] = {}
        self._free_drafts: tuple[CostCurve, CostCurve] | None = None
        # What each way of drafting gave against plain decoding (k auto), with the prior it began from.
        self._rates: tuple[AcceptancePrior | None, MethodRates] | None = None
        self._measured: MeasuredChoice | None = None
        self._features: FeatureFeed | None = None
        reader = self._source.features
        if reader is not None:
            feature_target = features_of(target)
            feature_target.capture_hidden(reader.feature_layers)
            self._features = FeatureFeed(feature_target, reader)

    @property
    def costs(self) -> CostCurve | None:
        return self._costs

    @costs.setter
    def costs(self, costs: CostCurve | None) -> None:
        self._costs = costs
        self.pass_times = PassTimes()

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
        """The policy of a generation with these settings (the drafter's own for a fixed k;
        k auto's kept across generations, under the measured rates of each way of drafting)."""

        def adaptive(match_acceptance: Mapping[int, Sequence[float]] | None, key: str | None = None) -> KAutoPolicy:
            if key is None:
                return self.k_auto.policy(spec.max_k, self.costs, self.prior, match_acceptance)
            # The candidates after the first need no model: their drafts cost nothing to draw.
            k_auto = self._candidate_k_autos.setdefault(key, KAuto())
            return k_auto.policy(spec.max_k, self._pass_costs(), None, match_acceptance)

        policy = self._source.policy(spec.k, self.costs, adaptive)
        if isinstance(spec.k, int) or self.drafter is None:
            return policy
        kept = self._measured
        if kept is None or kept.inner is not policy or kept.rates is not self.method_rates or kept.asked != spec.tree:
            trees = self._source.drafts_trees
            kept = MeasuredChoice(policy, self.method_rates, self._source.name, trees, spec.tree)
            self._measured = kept
        return kept

    @property
    def method_rates(self) -> MethodRates:
        """The measured rates k auto's steps keep, from the prior's while it is the same."""
        if self._rates is None or self._rates[0] is not self.prior:
            methods = self.prior.methods if self.prior is not None else ()
            self._rates = (self.prior, MethodRates.seeded(methods))
        return self._rates[1]

    def learned(self) -> AcceptancePrior | None:
        """What `k=auto` has learned about the draft's acceptance so far (and how each way of
        drafting paid), for the next session."""
        learned = self.k_auto.learned()
        if learned is None or self._rates is None:
            return learned
        return replace(learned, methods=self._rates[1].learned())

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
        self._source.start(context)
        if self._features is not None and reused < len(context) - 1:
            self._features.hand_over(reused, slice(None))
        yield PrefillEvent(len(context), reused, time.perf_counter() - started)

        generator = make_generator(self.target.device, sampling.seed)
        seed = sampling.seed if coupled(sampling) else None
        noise = None if seed is None else PositionNoise(seed, self.target.vocab_size)
        emitted = 0
        step = 0
        while True:
            room = spec.max_new_tokens - emitted - 1
            if max_length is not None:
                room = min(room, max_length - len(context))
            plan = policy.plan(self._source.signal(context), room, bool(spec.tree))

            step += 1
            # The output position of the next token: the coupled rule's noise is chosen by it.
            position = len(context) - len(prompt_ids)
            if plan.tree and self._source.drafts_trees:
                outcome = self._tree_step(context, plan, sampling, generator, noise, position, step)
            else:
                outcome = self._chain_step(context, plan, sampling, generator, noise, position, step)
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
        plan: StepPlan,
        sampling: SamplingConfig,
        generator: torch.Generator,
        noise: PositionNoise | None,
        position: int,
        step: int,
    ) -> StepOutcome:
        draft_started = self._clock()
        prepared = self._prepare(context, plan)
        draft = Draft([])
        if plan.k > 0:
            draft_noise = None if noise is None else noise.from_position(position)
            draft = self._source.propose(context, plan.k, sampling, generator, noise=draft_noise)
        verify_started = self._clock()
        logits = self.target.forward([context[-1], *draft.tokens])
        draft_ids = torch.tensor(draft.tokens, dtype=torch.long, device=logits.device)
        rows = None if noise is None else noise.rows(position, len(draft) + 1)
        verdict = verify_chain(logits, draft_ids, draft.probs, sampling, generator, rows)
        settled = len(context) + verdict.accepted
        self.target.rollback(settled)
        self._source.settle(Settled(settled))
        if self._features is not None:
            self._features.hand_over(len(context) - 1, slice(None, verdict.accepted + 1))
        tokens = draft.tokens[: verdict.accepted] + [verdict.next_token]
        event = StepEvent(
            step=step,
            drafted=len(draft),
            accepted=verdict.accepted,
            draft_seconds=verify_started - draft_started,
            verify_seconds=self._clock() - verify_started,
            catch_up_seconds=prepared,
            method=self._method(plan, drafted=len(draft)),
        )
        return StepOutcome(tokens, step_provenances(verdict.accepted, len(draft), verdict.resampled), event)

    def _tree_step(
        self,
        context: list[int],
        plan: StepPlan,
        sampling: SamplingConfig,
        generator: torch.Generator,
        noise: PositionNoise | None,
        position: int,
        step: int,
    ) -> StepOutcome:
        """Draft a tree k deep, verify it in one pass (speccli.tree), keep the
        accepted path in the target's cache."""
        draft_started = self._clock()
        prepared = self._prepare(context, plan)
        draft_noise = None if noise is None else noise.from_position(position)
        shape = TreeShape.for_costs(plan.k, plan.costs, self.costs)
        if self.target.max_length is not None:
            # The pass holds the pending token and every node until the path is kept.
            shape = replace(shape, max_nodes=min(shape.max_nodes, self.target.max_length - len(context)))
        draft = self._source.propose_tree(context, shape, sampling, generator, noise=draft_noise)
        tree = draft.tree
        verify_started = self._clock()
        cached = len(self.target.cached_tokens)
        branch = draft.branch  # lookahead decoding's Jacobi window
        if branch is not None and not self._branch_fits(cached, len(tree) + 1 + len(branch)):
            branch = None
        fed = TreePass.of(context[-1], tree, cached, branch)
        logits = self.target.forward_tree(fed.tokens, fed.positions, fed.visible, cached)
        branch_guesses = None
        if branch is not None:
            branch_guesses = torch.argmax(logits[fed.tree_rows :], dim=-1).tolist()
            logits = logits[: fed.tree_rows]
        rows = None if noise is None else noise.rows(position, tree.depth + 1)[tree.fed_depths()]
        verdict = verify_tree(logits, tree, sampling, generator, rows)
        kept = kept_offsets(verdict.path)
        self.target.keep(cached, kept)
        if self._features is not None:
            self._features.hand_over(len(context) - 1, kept)
        self._source.settle(Settled(len(context) + verdict.accepted, verdict.path, branch_guesses))
        tokens = [tree.tokens[node] for node in verdict.path] + [verdict.next_token]
        own = None if draft.own is None else own_share(tree, draft.own, verdict.path)
        method = self._method(plan, drafted=tree.depth)
        if own is not None and plan.graft is not None:
            method += f"+{plan.graft.source}"
        event = StepEvent(
            step=step,
            drafted=tree.depth,
            accepted=verdict.accepted,
            draft_seconds=verify_started - draft_started,
            verify_seconds=self._clock() - verify_started,
            fed=len(fed.tokens),
            tree=True,
            catch_up_seconds=prepared,
            guessed=len(draft.guess),
            guessed_kept=common_prefix_length(draft.guess, tokens[:-1]),
            own=own,
            method=method,
        )
        return StepOutcome(tokens, step_provenances(verdict.accepted, len(tree), verdict.resampled), event)

    def _pass_costs(self) -> CostCurve | None:
        """The calibration's pass costs without the draft model's (one curve kept per
        calibration: k auto keeps its policy while the curve it was built from is the same)."""
        if self.costs is None:
            return None
        if self._free_drafts is None or self._free_drafts[0] is not self.costs:
            self._free_drafts = (self.costs, CostCurve(self.costs.verify_seconds, None))
        return self._free_drafts[1]

    def _method(self, plan: StepPlan, drafted: int) -> str:
        """The step's method as --stats counts it: plain where nothing was drafted."""
        return "plain" if drafted == 0 and plan.lookahead is None else plan.way(self._source.name)

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
        if self._source.draft_model is not None:
            setup += self._source.draft_model.setup_seconds
        return time.perf_counter() - setup

    def _prepare(self, context: list[int], plan: StepPlan) -> float:
        """Before a step that drafts: hand the drafter its plan, and let a draft model read
        what it has not (see ModelDrafter.prepare). Returns the seconds it took."""
        if plan.k <= 0:
            return 0.0
        started = self._clock()
        self._source.prepare(context, plan)
        return self._clock() - started

    def _prefill(self, context: list[int]) -> int:
        """Bring all but the last prompt token into the target's cache, reusing what a
        previous generation left there. Returns the number of tokens reused."""
        settled = context[:-1]
        reused = common_prefix_length(self.target.cached_tokens, settled)
        if self._features is not None:
            reused = self._features.start(context, reused)
        self.target.rollback(reused)
        if reused < len(settled):
            self.target.forward(settled[reused:], all_logits=False)
        return reused


def features_of(target: CausalLM) -> FeatureLM:
    """The target as a model that hands out its features, for a drafter that reads them."""
    if not hands_out_features(target):
        raise ValueError(f"{type(target).__name__} cannot hand out its hidden states, which this drafter reads")
    return target


def hands_out_features(target: CausalLM) -> TypeGuard[FeatureLM]:
    return all(callable(getattr(target, name, None)) for name in ("capture_hidden", "input_embedding", "output_rows"))
