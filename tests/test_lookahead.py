"""Lookahead decoding (speccli.drafters.lookahead): the Jacobi window's shape and masks, how
it advances and fills the n-gram pool, the choice of its size from measured costs, and
greedy output identical to the target's own."""

from __future__ import annotations

import re

import pytest
import torch

from conftest import tiny_llama, wrap, wrap_static
from speccli.autok.costs import CostCurve
from speccli.autok.lookahead import DEFAULT_SHAPE, LookaheadGate, LookaheadShape, choose_shape, window_gain
from speccli.autok.policy import DraftLengthPolicy
from speccli.config import SamplingConfig, SpecConfig
from speccli.drafters.lookahead import LookaheadDrafter
from speccli.events import StepEvent, TokenEvent
from speccli.loop import SpeculativeDecoder
from speccli.tree import ROOT, TokenTree, TreeShape
from test_decoder_greedy import EOS, MAX_NEW, PROMPTS, emitted, encode


def drafter_with_levels(levels: list[list[int]], ngram: int = 3) -> LookaheadDrafter:
    drafter = LookaheadDrafter(LookaheadShape(window=len(levels[0]), ngram=ngram, guesses=2))
    drafter.levels = [list(row) for row in levels]
    return drafter


class TestWindow:
    def test_each_token_sees_level_zero_up_to_its_column_and_its_own_column_above(self):
        branch = drafter_with_levels([[1, 2, 3], [4, 5, 6]]).branch([9])
        assert branch.tokens == [1, 2, 3, 4, 5, 6]
        assert branch.offsets == [1, 2, 3, 2, 3, 4]
        expected = torch.tensor(
            [
                [1, 0, 0, 0, 0, 0],
                [1, 1, 0, 0, 0, 0],
                [1, 1, 1, 0, 0, 0],
                [1, 0, 0, 1, 0, 0],  # level 1, column 0: level 0 column 0, itself
                [1, 1, 0, 0, 1, 0],
                [1, 1, 1, 0, 0, 1],
            ],
            dtype=torch.bool,
        )
        assert torch.equal(branch.visible, expected)

    def test_an_empty_window_starts_from_the_context(self):
        drafter = LookaheadDrafter(LookaheadShape(window=4, ngram=3, guesses=2))
        assert drafter.branch([7, 8]).tokens == [7, 8, 7, 8]

    def test_levels_fill_then_columns_become_ngrams_and_the_oldest_level_goes(self):
        drafter = drafter_with_levels([[1, 2]], ngram=3)
        drafter.advance([10, 11])  # one level held, N - 1 = 2 wanted: keep both
        assert drafter.levels == [[1, 2], [10, 11]]
        assert drafter.pool == {}
        drafter.advance([0, 0, 20, 21])  # guesses for all 4 tokens; the newest level's are the last 2
        assert drafter.levels == [[10, 11], [20, 21]]
        assert {first: list(grams) for first, grams in drafter.pool.items()} == {1: [(10, 20)], 2: [(11, 21)]}

    @pytest.mark.parametrize("backend", [wrap, wrap_static], ids=["dynamic-cache", "static-cache"])
    def test_each_window_token_is_scored_as_the_sequence_it_sees(self, backend):
        model = tiny_llama(40, seed=4, logit_scale=5.0)
        context = [5, 6, 7, 8]
        levels = [[11, 12, 13], [21, 22, 23]]
        branch = drafter_with_levels(levels).branch(context)
        tree = TokenTree([30, 31], [ROOT, 0])
        lm = backend(model)
        lm.forward(context[:-1])
        cached = len(lm.cached_tokens)
        fed = [context[-1], *tree.tokens, *branch.tokens]
        positions = [cached + d for d in tree.fed_depths()] + [cached + o for o in branch.offsets]
        logits = lm.forward_tree(fed, positions, branch.beside(tree.visibility()), cached)
        for index in range(len(branch)):
            level, column = divmod(index, 3)
            sequence = levels[0][: column + 1] + [levels[m][column] for m in range(1, level + 1)]
            reference = backend(model)
            reference.forward(context[:-1])
            chain = reference.forward([context[-1], *sequence])
            torch.testing.assert_close(logits[len(tree) + 1 + index], chain[-1], atol=1e-5, rtol=1e-5)
        # The tree's rows are untouched by the window.
        reference = backend(model)
        reference.forward(context[:-1])
        torch.testing.assert_close(
            logits[: len(tree) + 1], reference.forward([context[-1], 30, 31]), atol=1e-5, rtol=1e-5
        )


class TestPool:
    def test_start_seeds_the_pool_with_the_prompts_ngrams_and_the_tree_offers_the_latest(self):
        drafter = LookaheadDrafter(LookaheadShape(window=2, ngram=3, guesses=2))
        drafter.start([1, 2, 3, 1, 2, 4, 1, 5, 6, 1])
        tree = drafter.propose_tree([9, 1], TreeShape(max_depth=2, max_nodes=8), SamplingConfig(), None).tree
        # n-grams after 1: (2, 3), (2, 4), (5, 6); the latest two, the latest first, merged.
        assert (tree.tokens, tree.parents) == ([5, 6, 2, 4], [ROOT, 0, ROOT, 2])

    def test_the_tree_also_offers_what_followed_the_texts_last_tokens_before(self):
        drafter = LookaheadDrafter(LookaheadShape(window=2, ngram=3, guesses=1))
        context = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
        drafter.start(context)
        tree = drafter.propose_tree(context, TreeShape(max_depth=2, max_nodes=16), SamplingConfig(), None).tree
        assert tree.tokens[:2] == [3, 4] and tree.parents[:2] == [ROOT, 0]

    def test_the_lookup_guess_grows_while_it_comes_true_whole_and_shrinks_when_it_fails(self):
        drafter = LookaheadDrafter(LookaheadShape(window=2, ngram=3, guesses=1))  # from 2 tokens
        text = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
        shape = TreeShape(max_depth=2, max_nodes=6)

        def guess(context: list[int]) -> list[int]:
            tree = drafter.propose_tree(context, shape, SamplingConfig(), None).tree
            path, node = [], ROOT
            while node in tree.parents:  # the lookup guess is the first chain of the trie
                node = tree.parents.index(node)
                path.append(tree.tokens[node])
            return path

        context = text + [1, 2]
        drafter.start(context)
        assert guess(context) == [3, 4]
        context += [3, 4, 5]  # both right, and the target's next token
        assert guess(context) == [6, 7, 8, 9]
        context += [6, 7, 8, 9, 10]
        assert guess(context) == [11, 12, 1, 2, 3, 4]  # at most the tree's 6 nodes
        context += [11, 99]  # one of six right
        assert drafter.lookup_length == 6 and guess(context) == []  # 99 never occurred before
        assert drafter.lookup_length == 3

    def test_a_cold_start_forgets_the_pool_and_the_window(self):
        drafter = LookaheadDrafter(LookaheadShape(window=2, ngram=3, guesses=1))
        drafter.start([1, 2, 3, 1, 2, 4])
        drafter.advance([7, 8])
        drafter.rollback(3)  # an earlier point of the same text: the pool stays
        assert drafter.pool and drafter.levels
        drafter.rollback(0)
        assert drafter.pool == {} and drafter.levels == []
        tree = drafter.propose_tree([5, 1], TreeShape(max_depth=2, max_nodes=8), SamplingConfig(), None).tree
        assert tree.tokens == []  # nothing of the text before is offered


# Pass cost by tokens fed, x one token: a 2-core AMD EPYC in bfloat16 on 2026-12-03.
AMD_BFLOAT16 = {
    1: 1.0,
    2: 1.0,
    3: 1.04,
    4: 1.06,
    5: 1.11,
    6: 1.16,
    7: 1.16,
    8: 1.2,
    9: 1.25,
    10: 1.41,
    11: 1.31,
    12: 1.43,
    13: 1.39,
    14: 1.41,
    15: 1.43,
    16: 1.44,
    17: 1.69,
}


class TestShapeChoice:
    def test_flat_costs_take_the_largest_measured_shape(self):
        costs = {fed: 0.170 for fed in range(1, 18)}
        assert choose_shape(CostCurve(costs, None)) == LookaheadShape(5, 3, 3)

    def test_a_gpu_like_curve_takes_a_shape_larger_than_a_cpu_calibration_measures(self):
        # An H200 with CUDA graphs: 9.2 ms for 1 token, 11.2 for 2, 11.9 for 16, then slowly more.
        costs = {1: 0.0092, 2: 0.0112, **{fed: 0.0119 + 0.00002 * (fed - 16) for fed in range(3, 35)}}
        assert choose_shape(CostCurve(costs, None)) == LookaheadShape(7, 4, 4)  # 34 tokens

    def test_a_jump_after_one_token_means_plain_decoding(self):
        costs = {1: 0.404, **{fed: 1.0 for fed in range(2, 18)}}
        assert choose_shape(CostCurve(costs, None)) is None

    def test_a_curve_that_grows_with_every_token_takes_a_small_shape(self):
        # A 2-core AMD EPYC in bfloat16: 184 ms for 1 token, 222 for 7, 255 for 11, 289 for 16.
        costs = {fed: 0.2 * (1 + 0.025 * (fed - 1)) for fed in range(1, 18)}  # 17 tokens: 1.4x
        assert choose_shape(CostCurve(costs, None)) == LookaheadShape(2, 2, 1)  # 4 tokens: 1.075x, for 0.11 more tokens

    def test_where_a_few_tokens_cost_what_one_does_a_small_window(self):
        # The AMD EPYC in bfloat16 on 2026-12-03 (one-token products as two rows): 4 tokens
        # 1.06x one, 7 tokens 1.16x; the 7-token shape promises 1.14 tokens for 1.16x a pass.
        assert choose_shape(CostCurve({fed: 0.162 * r for fed, r in AMD_BFLOAT16.items()}, None)) == LookaheadShape(
            2, 2, 1
        )

    def test_the_smallest_window_where_its_pass_is_the_cheaper(self):
        costs = {1: 0.1, 2: 0.1, 3: 0.1, **{fed: 0.11 + 0.01 * fed for fed in range(4, 18)}}
        assert choose_shape(CostCurve(costs, None)) == LookaheadShape(1, 2, 1)

    def test_a_nearly_flat_cpu_curve_takes_the_largest_measured_shape(self):
        # A 2-core Xeon with AMX in bfloat16 (scripts/pass_costs.py): 16 tokens cost 1.14x one.
        ms = {1: 170, 2: 166, 3: 168, 4: 170, 6: 174, 8: 176, 12: 183, 16: 193, 17: 194}
        assert choose_shape(CostCurve({fed: t / 1000 for fed, t in ms.items()}, None)) == LookaheadShape(5, 3, 3)

    def test_float32_here_means_plain_decoding(self):
        # The float32 calibration of this CPU: 270 ms, 355, 328 (4), 405 (8), 555 (16), 572 (17).
        costs = {1: 0.270, 2: 0.355, 4: 0.328, 8: 0.405, 16: 0.555, 17: 0.572}
        assert choose_shape(CostCurve(costs, None)) is None

    def test_a_noisy_small_pass_is_not_trusted_over_a_larger_one(self):
        # 7 tokens measured slow once, 9 cheaper: a 7-token pass costs at most what 9 do.
        costs = {1: 0.2, 7: 0.5, 9: 0.22}
        assert choose_shape(CostCurve(costs, None)) == LookaheadShape(2, 3, 1)

    def test_a_one_token_pass_is_priced_as_the_gate_prices_it(self):
        # The AMD EPYC in bfloat16 (a benchmark's calibration, ms): one token measured dearer than
        # two. At 170 ms the 7-token shape would pay where prompt lookup guesses nothing; at 162,
        # as the gate prices a one-token pass, its window would not ride there: none.
        ms = {
            1: 170,
            2: 162,
            3: 190,
            4: 182,
            5: 195,
            6: 195,
            7: 187,
            8: 212,
            9: 216,
            10: 244,
            11: 258,
            12: 224,
            13: 236,
            14: 239,
            15: 253,
            16: 278,
            17: 247,
        }
        assert choose_shape(CostCurve({fed: t / 1000 for fed, t in ms.items()}, None)) is None

    def test_without_measurements_the_default(self):
        assert choose_shape(None) == DEFAULT_SHAPE

    def test_the_windows_prior_gain_grows_with_the_pass(self):
        assert window_gain(7) == pytest.approx(0.14)
        assert window_gain(14) == pytest.approx(0.34)
        assert window_gain(2) == 0.0
        assert window_gain(3) == pytest.approx(0.08)  # measured, where the line says nothing
        assert window_gain(4) == pytest.approx(0.11)


# Flat measured costs: the largest shape. The AMD EPYC's bfloat16 curve: a small one (W 2, N 2, G 1).
AUTO_COSTS = {
    "auto": {fed: 0.1 for fed in range(1, 18)},
    "auto-steep": {fed: 0.1 * r for fed, r in AMD_BFLOAT16.items()},
}


@pytest.mark.parametrize("k", [1, 2, 3, "auto", "auto-steep"])
@pytest.mark.parametrize("pair_index", [0, 1])
def test_lookahead_equals_target_greedy(pairs, tokenizer, pair_index, k):
    from test_decoder_greedy import target_greedy

    pair = pairs[pair_index]
    decoder = SpeculativeDecoder(wrap(pair.target), tokenizer, [EOS], LookaheadDrafter())
    if k in AUTO_COSTS:
        decoder.costs = CostCurve(AUTO_COSTS[k], None)
        shape = choose_shape(decoder.costs)
        assert shape == (LookaheadShape(2, 2, 1) if k == "auto-steep" else LookaheadShape(5, 3, 3))
        k = "auto"
    accepted = 0
    for prompt in PROMPTS:
        ids = encode(tokenizer, prompt)
        events = list(decoder.generate(ids, SamplingConfig(), SpecConfig(k=k, max_new_tokens=MAX_NEW)))
        assert emitted(events) == target_greedy(pair.target, ids), prompt
        steps = [e for e in events if isinstance(e, StepEvent)]
        if k == "auto":  # lookahead steps where the window pays, prompt lookup's chains where those do
            assert any(e.tree and e.fed > 1 for e in steps)
        else:  # every step carries the window, but a last one with room for a single token
            assert sum(e.tree and e.fed > 1 for e in steps) >= len(steps) - 1
        accepted += sum(e.accepted for e in steps)
    # Random models repeat themselves: the pool's n-grams were accepted.
    assert accepted > 0


def step_record(events) -> list[tuple[int, int, int, bool]]:
    return [(e.fed, e.drafted, e.accepted, e.tree) for e in events if isinstance(e, StepEvent)]


def virtual_clock(decoder: SpeculativeDecoder, seconds: dict[int, float]) -> None:
    """The decoder's clock advances by `seconds` of each pass the target makes, and only
    then: k auto's choices follow the steps alone, the same in every run."""
    now = [0.0]
    target = decoder.target
    for name in ("forward", "forward_tree"):

        def timed(tokens, *args, _real=getattr(target, name), **kwargs):
            now[0] += seconds[min(len(tokens), max(seconds))]
            return _real(tokens, *args, **kwargs)

        setattr(target, name, timed)
    decoder._clock = lambda: now[0]


def beside_prompt_lookup(target, tokenizer, costs: CostCurve) -> dict[str, SpeculativeDecoder]:
    """A lookahead decoder and a `--draft ngram` one over the same target, costs and virtual clock."""
    from speccli.drafters.ngram import PromptLookupDrafter

    decoders = {}
    for name, drafter in (("lookahead", LookaheadDrafter()), ("ngram", PromptLookupDrafter())):
        decoders[name] = SpeculativeDecoder(wrap(target), tokenizer, [EOS], drafter)
        decoders[name].costs = costs
        virtual_clock(decoders[name], costs.verify_seconds)
    return decoders


def same_passes_as_prompt_lookup(decoders, target, tokenizer, spec: SpecConfig) -> list[tuple[int, int, int, bool]]:
    """On every prompt, lookahead's output is the target's greedy one and its steps are the
    `--draft ngram` decoder's, step for step; returns those steps."""
    from test_decoder_greedy import target_greedy

    steps = []
    for prompt in PROMPTS:
        ids = encode(tokenizer, prompt)
        runs = {name: list(d.generate(ids, SamplingConfig(), spec)) for name, d in decoders.items()}
        assert emitted(runs["lookahead"]) == target_greedy(target, ids), prompt
        assert step_record(runs["lookahead"]) == step_record(runs["ngram"]), prompt
        steps += step_record(runs["lookahead"])
    return steps


def test_where_no_shape_pays_lookahead_makes_the_passes_prompt_lookup_makes(pairs, tokenizer):
    from speccli.autok.policy import DraftLengthByMatch

    # Passes over 2-17 tokens cost 1.6x one: no lookahead shape pays, drafts that come true do.
    costs = CostCurve({1: 0.1, **{fed: 0.16 for fed in range(2, 18)}}, None)
    assert choose_shape(costs) is None
    target = pairs[0].target
    decoders = beside_prompt_lookup(target, tokenizer, costs)
    auto = SpecConfig(k="auto", max_new_tokens=MAX_NEW)
    assert isinstance(decoders["lookahead"].policy_for(auto).inner, DraftLengthByMatch)
    steps = same_passes_as_prompt_lookup(decoders, target, tokenizer, auto)
    assert sum(drafted for _, drafted, _, _ in steps) > 0  # the text's own n-grams were drafted, not only plain steps


def test_where_neither_lookahead_nor_prompt_lookup_pays_plain_decoding(pairs, tokenizer):
    pair = pairs[0]
    decoder = SpeculativeDecoder(wrap(pair.target), tokenizer, [EOS], LookaheadDrafter())
    decoder.costs = CostCurve({1: 0.4, **{fed: 1.0 for fed in range(2, 18)}}, None)
    events = list(
        decoder.generate(encode(tokenizer, "hello"), SamplingConfig(), SpecConfig(k="auto", max_new_tokens=8))
    )
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert all(e.fed == 1 and not e.tree for e in steps)
    assert all(e.provenance.value == "target" for e in events if isinstance(e, TokenEvent))


def test_with_tree_the_steps_the_gate_holds_back_are_prompt_lookups_trees(pairs, tokenizer):
    # Nearly flat costs, each token a little dearer (so the window is never free): lookahead's
    # shape pays, and its gate is made to hold it back throughout.
    costs = CostCurve({fed: 0.1 + 0.001 * fed for fed in range(1, 18)}, None)
    target = pairs[0].target
    decoders = beside_prompt_lookup(target, tokenizer, costs)
    tree_auto = SpecConfig(k="auto", max_new_tokens=MAX_NEW, tree=True)
    gate = decoders["lookahead"].policy_for(tree_auto).inner
    assert isinstance(gate, LookaheadGate)
    gate.window_value, gate.prior_gain, gate.probe_every = 0.0, 0.0, 10**6  # neither the window nor the pool pays
    decoders["lookahead"].policy_for = lambda spec: gate
    # The passes `--draft ngram --tree` makes: its trees, no window beside them.
    steps = same_passes_as_prompt_lookup(decoders, target, tokenizer, tree_auto)
    assert any(tree and fed > 1 for fed, _, _, tree in steps)
    assert gate._gain_steps == 0  # its trees were not taken for lookahead's


def test_no_pass_is_larger_than_the_largest_measured(pairs, tokenizer):
    from test_decoder_greedy import target_greedy

    # Measured up to 13 tokens: the window (W 4, N 3: 8 tokens) rides along only beside a
    # tree of at most 4 nodes; where prompt lookup's guess on a copied run is worth more than
    # the window beside a cut one, it is verified alone, as --draft ngram verifies it.
    pair = pairs[0]
    decoder = SpeculativeDecoder(wrap(pair.target), tokenizer, [EOS], LookaheadDrafter())
    decoder.costs = CostCurve({fed: 0.1 for fed in range(1, 14)}, None)
    assert choose_shape(decoder.costs) == LookaheadShape(4, 3, 2)
    steps = []
    for prompt in PROMPTS:
        ids = encode(tokenizer, prompt)
        spec = SpecConfig(k="auto", max_new_tokens=MAX_NEW, tree=False)  # chains where the window does not ride
        events = list(decoder.generate(ids, SamplingConfig(), spec))
        assert emitted(events) == target_greedy(pair.target, ids), prompt
        steps += [e for e in events if isinstance(e, StepEvent)]
    assert max(e.fed for e in steps) <= 13
    assert any(e.tree and e.fed > 9 for e in steps)  # the window beside a tree of 4 nodes
    assert any(not e.tree and e.drafted > 4 for e in steps)  # a long guess, no window


class LookupStub(DraftLengthPolicy):
    """Prompt lookup's k auto as the gate sees it: a fixed draft length and expectation,
    measured costs, and a record of what it learned."""

    def __init__(self, k: int, expected: float, verify: dict[int, float]) -> None:
        from speccli.autok.policy import StepCosts

        self.k, self._expected = k, expected
        self.costs = StepCosts()
        self.costs.seed(verify, None)
        self.observed: list[StepEvent] = []
        self.learned: list[StepEvent] = []

    def next_k(self) -> int:
        return self.k

    def expected(self, k: int) -> float:
        return self._expected if k == self.k else 1.0 + 0.5 * k

    def observe(self, step: StepEvent) -> None:
        self.observed.append(step)

    def learn(self, step: StepEvent) -> None:
        self.learned.append(step)


SHAPE = LookaheadShape(2, 3, 1)  # the window and the pool: 6 tokens beside the guess


def make_gate(k: int, expected: float, pass_seconds: dict[int, float], **kwargs) -> LookaheadGate:
    """A gate over prompt lookup's k auto drafting k, expecting `expected` tokens, on this cost curve."""
    return LookaheadGate(SHAPE, LookupStub(k, expected, pass_seconds), CostCurve(dict(pass_seconds), None), **kwargs)


class TestGate:
    @staticmethod
    def run(gate: LookaheadGate, gains: list[int]) -> str:
        """Feed the gate steps, lookahead ones gaining the next of `gains` beyond the guess: L or . per step."""
        chosen = []
        for i, gain in enumerate(gains):
            k = gate.next_k()
            chosen.append("L" if gate.lookahead_step else ".")
            if gate.lookahead_step:
                gate.observe(StepEvent(i, k, gain, 0.0, 0.13, fed=1 + k + gate.extra, tree=True))
            else:
                gate.observe(StepEvent(i, k, 0, 0.0, 0.10, fed=k + 1))
        return "".join(chosen)

    def test_the_window_rides_where_its_measured_worth_pays_for_its_tokens(self):
        flat = make_gate(0, 1.0, {fed: 0.1 for fed in range(1, 18)}, window_value=0.05)
        assert flat.window_pays(0)  # any worth, at no cost
        # 5 tokens (the window beside the pending one) cost 1.2x one: 0.25 tokens a step pay, 0.15 do not.
        costs = {1: 0.10, 5: 0.12, 17: 0.2}
        assert make_gate(0, 1.0, costs, window_value=0.25).window_pays(0)
        assert not make_gate(0, 1.0, costs, window_value=0.15).window_pays(0)
        # Its worth is what it brought riding every step (the prior), not what steps measure as they come.
        assert make_gate(0, 1.0, costs).window_value == pytest.approx(window_gain(SHAPE.fed))

    def test_the_pools_ngrams_pay_for_their_own_tokens_beside_the_window(self):
        # The window rides free (5 tokens cost what one does); each n-gram adds 2 tokens, 7 cost 1.1x.
        costs = {1: 0.1, 5: 0.1, 7: 0.11, 17: 0.2}
        assert make_gate(0, 1.0, costs, prior_gain=0.15).pool_pays(0, window=True, candidates=1)
        assert not make_gate(0, 1.0, costs, prior_gain=0.05).pool_pays(0, window=True, candidates=1)
        assert not make_gate(0, 1.0, costs, prior_gain=5.0).pool_pays(0, window=True, candidates=0)
        # Without the window, an n-gram's pass is 3 tokens, priced as 5 are: free.
        assert make_gate(0, 1.0, costs, prior_gain=0.01).pool_pays(0, window=False, candidates=1)

    def test_both_steps_are_priced_by_the_calibration_not_by_what_one_size_measured_since(self):
        # One-token passes measured slower since (0.2 s): against the window's size, still at
        # its calibrated cost, the window would look nearly free.
        costs = {1: 0.10, 5: 0.12, 17: 0.2}
        gate = make_gate(0, 1.0, costs, window_value=0.15)
        gate.meanwhile.costs.verify[1] = 0.2
        assert not gate.window_pays(0)

    def test_without_measured_costs_every_step_carries_the_window_and_the_pool(self):
        gate = LookaheadGate(SHAPE, LookupStub(3, 2.0, {1: 0.1}), None, prior_gain=0.0, window_value=0.0)
        assert gate.window_pays(3) and gate.pool_pays(3, window=True)
        assert gate.next_k() == 3 and gate.guess_length == 3 and gate.window_step and gate.pool_step

    def test_prompt_lookups_own_step_wins_where_its_guess_brings_more_than_the_window(self):
        # Its 2-token guess, 2.5 tokens expected in a 3-token pass, against the same guess
        # beside the window (7 tokens) and the pool (9), which cost 1.5x as much.
        costs = {1: 0.10, 3: 0.10, 9: 0.15, 17: 0.2}
        gate = make_gate(2, 2.5, costs, prior_gain=1.0, window_value=1.0)
        assert gate.next_k() == 2 and not gate.lookahead_step and gate.guess_length == 2
        gate = make_gate(2, 2.5, costs, prior_gain=1.5, window_value=1.5)
        assert gate.next_k() == 2 and gate.window_step and gate.pool_step and gate.guess_length == 2

    def test_the_guess_is_cut_to_what_fits_beside_the_window(self):
        gate = make_gate(5, 3.0, {fed: 0.1 for fed in range(1, 10)}, prior_gain=5.0)
        assert gate.cut(5) == 2  # 1 + 2 + 6 = 9 tokens, the largest pass measured
        assert gate.next_k() == 2 and gate.lookahead_step and gate.guess_length == 2
        # Without a guess the tree still holds the pool's n-grams, N - 1 deep.
        gate = make_gate(0, 1.0, {fed: 0.1 for fed in range(1, 10)}, prior_gain=5.0)
        assert gate.next_k() == 2 and gate.guess_length == 0

    def test_a_lookahead_step_teaches_prompt_lookup_its_guess_and_the_gate_the_gain(self):
        stub = LookupStub(3, 2.0, {fed: 0.1 for fed in range(1, 18)})
        gate = LookaheadGate(SHAPE, stub, CostCurve(dict(stub.costs.verify), None), prior_gain=0.5, prior_steps=1.0)
        gate.next_k()
        step = StepEvent(0, 3, 3, 0.0, 0.14, fed=10, tree=True, guessed=3, guessed_kept=1)
        gate.observe(step)
        assert stub.observed == []  # the cost is blended as its own steps' are, and the guess learned as a chain
        assert stub.costs.verify[10] == pytest.approx(0.7 * 0.1 + 0.3 * 0.14)
        assert [(e.drafted, e.accepted, e.fed, e.tree) for e in stub.learned] == [(3, 1, 4, False)]
        assert gate.gain == pytest.approx((2 + 0.5) / 2)  # two tokens beyond the guess, with the prior

    def test_prompt_lookups_own_steps_reach_it_whole(self):
        stub = LookupStub(2, 2.5, {1: 0.1, 3: 0.1, 9: 0.3, 17: 0.4})
        gate = LookaheadGate(SHAPE, stub, CostCurve(dict(stub.costs.verify), None), prior_gain=0.0)
        gate.next_k()
        gate.observe(StepEvent(0, 2, 1, 0.0, 0.1))
        assert [e.step for e in stub.observed] == [0] and stub.learned == []

    def test_where_the_window_does_not_pay_runs_of_probes_measure_it_and_back_off(self):
        # Nothing gained: off, then a 4-step probe run (N - 1 = 2 levels to fill, twice) after
        # 8 steps, 16, 32, then 32 again (two doublings at most).
        gate = make_gate(0, 1.0, {1: 0.1, 7: 0.2, 17: 0.3}, prior_gain=0.0, probe_every=8, max_backoff=2)
        steps = 8 + 4 + 16 + 4 + 32 + 4 + 32 + 4
        assert self.run(gate, [0] * steps) == (
            "." * 8 + "LLLL" + "." * 16 + "LLLL" + "." * 32 + "LLLL" + "." * 32 + "LLLL"
        )

    def test_a_probe_that_finds_a_gain_keeps_lookahead_on_and_resets_the_backoff(self):
        gate = make_gate(0, 1.0, {1: 0.1, 7: 0.12, 17: 0.3}, prior_gain=0.0, probe_every=8)
        assert self.run(gate, [0] * 20) == "." * 8 + "LLLL" + "." * 8
        # The next probe comes after 16 steps (one failed probe) and finds a token a step.
        assert self.run(gate, [0] * 8 + [1] * 10) == "." * 8 + "L" * 10
        # Once that fades, off again; probed after 8 steps, not 32, then after 16.
        assert re.fullmatch(r"L+\.{8}LLLL\.{16}LLLL\.+", self.run(gate, [0] * 60))

    @staticmethod
    def run_offered(gate: LookaheadGate, offers: list[int], gain: int = 0) -> str:
        """Feed the gate steps with `offers` pool n-grams each: W (the window alone rides),
        P (the window and the pool's n-grams), p (the pool alone) or . (prompt lookup's step)."""
        chosen = []
        for i, candidates in enumerate(offers):
            gate.offer(candidates)
            k = gate.next_k()
            chosen.append(
                {(True, True): "P", (True, False): "W", (False, True): "p", (False, False): "."}[
                    (gate.window_step, gate.pool_step)
                ]
            )
            fed = 1 + gate.guess_length + gate.window_tokens * gate.window_step + 2 * candidates * gate.pool_step
            gate.observe(StepEvent(i, k, gain * gate.pool_step, 0.0, 0.1, fed=fed, tree=gate.lookahead_step))
        return "".join(chosen)

    def test_a_free_window_rides_every_step_and_the_pool_is_offered_where_it_has_ngrams_that_pay(self):
        # Passes over up to 5 tokens cost what one does (the window: 4), 7 cost 1.1x.
        costs = {1: 0.1, 5: 0.1, 7: 0.11, 17: 0.2}
        gate = make_gate(0, 1.0, costs, prior_gain=0.15)
        assert self.run_offered(gate, [1, 0, 1, 0]) == "PWPW"
        gate.offer(1)
        assert gate.next_k() == 2 and gate.guess_length == 0  # the pool's n-grams, 2 deep
        gate = make_gate(0, 1.0, costs, prior_gain=0.05)
        assert self.run_offered(gate, [1, 0, 1]) == "WWW"
        assert gate.next_k() == 1 and gate.guess_length == 0  # a tree step with no nodes: the window's pass
        # Beside a 2-token guess the window (7 tokens, 1.1x) does not pay for its 0.05 tokens; an n-gram does.
        gate = make_gate(2, 2.0, costs, prior_gain=1.0, window_value=0.05)
        assert self.run_offered(gate, [1, 0]) == "p."

    def test_probes_offer_the_pool_again_and_steps_without_ngrams_neither_count_nor_probe(self):
        gate = make_gate(0, 1.0, {1: 0.1, 5: 0.1, 7: 0.12, 17: 0.3}, prior_gain=0.0, probe_every=4)
        # Probes of the pool (N - 1 = 2 steps, twice): after 4 steps that could have offered it, then 8.
        offers = [1, 0] * 4 + [1] * 4 + [0] * 5 + [1] * 8 + [1] * 4
        assert self.run_offered(gate, offers) == "WW" * 4 + "PPPP" + "W" * 5 + "W" * 8 + "PPPP"
        # The next probe after 16; its n-grams were accepted, which keeps the pool on.
        assert self.run_offered(gate, [1] * 22, gain=1) == "W" * 16 + "P" * 6

    def test_a_gate_needs_a_sensible_prior_and_probe_interval(self):
        stub = LookupStub(0, 1.0, {1: 0.1})
        with pytest.raises(ValueError):
            LookaheadGate(SHAPE, stub, prior_gain=-0.1)
        with pytest.raises(ValueError):
            LookaheadGate(SHAPE, stub, prior_steps=0)
        with pytest.raises(ValueError):
            LookaheadGate(SHAPE, stub, probe_every=0)
        with pytest.raises(ValueError):
            LookaheadGate(SHAPE, stub, window_value=-0.1)


def test_k_auto_gates_lookahead_and_a_fixed_k_does_not(pairs, tokenizer):
    from speccli.autok.policy import FixedDraftLength

    decoder = SpeculativeDecoder(wrap(pairs[0].target), tokenizer, [EOS], LookaheadDrafter())
    decoder.costs = CostCurve({1: 0.1, **{fed: 0.12 for fed in range(2, 18)}}, None)
    gate = decoder.policy_for(SpecConfig(k="auto", max_new_tokens=8)).inner
    assert isinstance(gate, LookaheadGate) and gate.shape == DEFAULT_SHAPE
    assert gate.extra == 16 and gate.prior_gain == pytest.approx(window_gain(17))
    assert gate.meanwhile is decoder.k_auto.kept  # prompt lookup's k auto, as --draft ngram's
    fixed = decoder.policy_for(SpecConfig(k=3, max_new_tokens=8))
    assert isinstance(fixed, FixedDraftLength) and fixed.k == 3


def test_where_the_window_pays_beside_no_guess_it_rides_every_step_there(pairs, tokenizer):
    # The AMD EPYC's bfloat16 curve (W 2, N 2, G 1): the window's 2 tokens beside the pending
    # one cost 1.04x a one-token pass, less than its 0.11 tokens a step are worth.
    decoder = SpeculativeDecoder(wrap(pairs[0].target), tokenizer, [EOS], LookaheadDrafter())
    decoder.costs = CostCurve(AUTO_COSTS["auto-steep"], None)
    steps = []
    chains = SpecConfig(k="auto", max_new_tokens=MAX_NEW, tree=False)  # trees: lookahead's steps alone
    for prompt in PROMPTS:
        events = list(decoder.generate(encode(tokenizer, prompt), SamplingConfig(), chains))
        steps += [e for e in events if isinstance(e, StepEvent)][:-1]  # a last step may have room for one token
    unguessed = [e for e in steps if e.tree and e.guessed == 0]
    assert unguessed and all(
        e.fed >= 3 for e in unguessed
    )  # the pending token, the window, and the pool where it has n-grams
    assert not [e for e in steps if e.fed == 1]  # no plain step
    assert any(e.tree and e.fed == 3 for e in steps)  # the window alone, where the pool has nothing to offer
