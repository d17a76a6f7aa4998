"""Token trees (speccli.tree): their shape, the backends' tree passes and cache
compaction, greedy verification, and the multi-candidate rule's exactness (chi-square,
with demonstrated power)."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama, wrap, wrap_static
from speccli.autok.costs import CostCurve
from speccli.config import SamplingConfig
from speccli.drafters.trees import _candidates, trie
from speccli.tree import (
    ROOT,
    TokenTree,
    TreeShape,
    best_node_count,
    graft,
    kept_offsets,
    own_share,
    verify_tree_greedy,
    verify_tree_sampled,
)
from test_sampling import POWER_P, assert_follows, fit, normalised

# 0 -> 1 -> 3
#   -> 2
# 4 (a second child of the root)
SHAPED = TokenTree([10, 11, 12, 13, 14], [ROOT, 0, 0, 1, ROOT])


class TestShape:
    def test_depths_children_and_paths(self):
        assert SHAPED.depths == [1, 2, 2, 3, 1]
        assert SHAPED.depth == 3
        assert SHAPED.children == {ROOT: [0, 4], 0: [1, 2], 1: [3], 2: [], 3: [], 4: []}
        assert SHAPED.path_to(3) == [0, 1, 3]
        assert SHAPED.fed_depths() == [0, 1, 2, 2, 3, 1]
        assert kept_offsets([0, 1, 3]) == [0, 1, 2, 4]

    def test_each_fed_token_sees_itself_and_its_ancestors_only(self):
        expected = torch.tensor(
            [
                [1, 0, 0, 0, 0, 0],  # the pending token
                [1, 1, 0, 0, 0, 0],  # node 0
                [1, 1, 1, 0, 0, 0],  # node 1
                [1, 1, 0, 1, 0, 0],  # node 2: not its sibling 1
                [1, 1, 1, 0, 1, 0],  # node 3
                [1, 0, 0, 0, 0, 1],  # node 4: not node 0's subtree
            ],
            dtype=torch.bool,
        )
        assert torch.equal(SHAPED.visibility(), expected)

    def test_a_chain_is_a_tree_of_single_children(self):
        chain = TokenTree.chain([5, 6, 7])
        assert chain.parents == [ROOT, 0, 1]
        assert torch.equal(chain.visibility(), torch.ones(4, 4, dtype=torch.bool).tril())

    def test_parents_must_come_first(self):
        with pytest.raises(ValueError, match="node 1's parent 1 does not come before it"):
            TokenTree([1, 2], [ROOT, 1])

    def test_siblings_hold_distinct_tokens(self):
        with pytest.raises(ValueError, match="node 2 repeats a sibling's token 7"):
            TokenTree([7, 8, 7], [ROOT, ROOT, ROOT])

    def test_trie_merges_shared_prefixes_and_stops_at_the_node_budget(self):
        tree = trie([[1, 2, 3], [1, 2, 4], [5, 6]], max_nodes=10)
        assert (tree.tokens, tree.parents) == ([1, 2, 3, 4, 5, 6], [ROOT, 0, 1, 1, ROOT, 4])
        small = trie([[1, 2, 3], [1, 2, 4], [5, 6]], max_nodes=4)
        assert (small.tokens, small.parents) == ([1, 2, 3, 4], [ROOT, 0, 1, 1])


class TestBackends:
    @pytest.mark.parametrize("backend", [wrap, wrap_static], ids=["dynamic-cache", "static-cache"])
    def test_a_tree_pass_scores_each_node_as_its_own_chain_would_and_keep_leaves_the_path(self, backend):
        model = tiny_llama(40, seed=3, logit_scale=5.0)
        context = [5, 6, 7, 8, 9]
        lm = backend(model)
        lm.forward(context[:-1])
        cached = len(lm.cached_tokens)
        logits = lm.forward_tree(
            [context[-1], *SHAPED.tokens], [cached + d for d in SHAPED.fed_depths()], SHAPED.visibility(), cached
        )
        assert logits.shape == (len(SHAPED) + 1, 40)
        for node in range(len(SHAPED)):
            reference = backend(model)
            reference.forward(context[:-1])
            chain = reference.forward([context[-1], *(SHAPED.tokens[n] for n in SHAPED.path_to(node))])
            torch.testing.assert_close(logits[node + 1], chain[-1], atol=1e-5, rtol=1e-5)

        lm.keep(cached, kept_offsets([0, 1, 3]))
        assert list(lm.cached_tokens) == [5, 6, 7, 8, 9, 10, 11, 13]
        after = lm.forward([20, 21])
        fresh = backend(model)
        fresh.forward([5, 6, 7, 8, 9, 10, 11, 13])
        torch.testing.assert_close(after, fresh.forward([20, 21]), atol=1e-5, rtol=1e-5)

    def test_keep_refuses_offsets_it_does_not_hold(self):
        lm = wrap(tiny_llama(40, seed=3))
        lm.forward([1, 2, 3])
        with pytest.raises(ValueError, match=r"cannot keep offsets \[0, 5\] past 1 of 3 cached entries"):
            lm.keep(1, [0, 5])


class TestGreedy:
    def test_follows_the_argmax_child_and_stops_where_none_matches(self):
        scores = torch.zeros(len(SHAPED) + 1, 16)
        scores[0, 10] = 1  # root: node 0
        scores[1, 12] = 1  # node 0: node 2 (not node 1)
        scores[3, 9] = 1  # node 2 has no children: 9 is the bonus
        verdict = verify_tree_greedy(scores, SHAPED)
        assert (verdict.path, verdict.next_token, verdict.resampled) == ([0, 2], 9, False)

    def test_a_root_argmax_no_child_holds_is_a_resample(self):
        scores = torch.zeros(len(SHAPED) + 1, 16)
        scores[0, 3] = 1
        verdict = verify_tree_greedy(scores, SHAPED)
        assert (verdict.path, verdict.next_token, verdict.resampled) == ([], 3, True)


P = normalised([0.30, 0.05, 0.20, 0.02, 0.13, 0.10, 0.15, 0.05])
Q = normalised([0.05, 0.30, 0.25, 0.10, 0.02, 0.08, 0.10, 0.10])
DRAWS = 20_000


def first_tokens(make_tree, draws: int, seed: int) -> torch.Tensor:
    """The first emitted token of `draws` one-level trees verified against P."""
    generator = torch.Generator().manual_seed(seed)
    p = P.expand(5, -1)  # the root's row, then rows for up to 4 children (never reached)
    firsts = torch.empty(draws, dtype=torch.long)
    for i in range(draws):
        tree = make_tree(generator)
        verdict = verify_tree_sampled(p[: len(tree) + 1], tree, generator)
        firsts[i] = tree.tokens[verdict.path[0]] if verdict.path else verdict.next_token
    return firsts


def sampled_siblings(generator: torch.Generator, count: int = 3, exclude: bool = True) -> TokenTree:
    chosen = _candidates(Q, SamplingConfig(temperature=1.0), generator, None)[:count]
    excluded = {} if exclude else {node: () for node in range(count)}
    return TokenTree(chosen, [ROOT] * count, Q[None], {ROOT: 0}, excluded)


class TestMultiCandidateRule:
    def test_siblings_drawn_without_replacement_give_the_target_distribution(self):
        firsts = first_tokens(sampled_siblings, DRAWS, seed=1)
        assert_follows(torch.bincount(firsts, minlength=8), P, "3 sampled siblings")

    def test_deterministic_siblings_give_the_target_distribution(self):
        firsts = first_tokens(lambda _generator: TokenTree([1, 3, 0], [ROOT] * 3), DRAWS, seed=2)
        assert_follows(torch.bincount(firsts, minlength=8), P, "3 fixed siblings")

    def test_the_sibling_draws_are_what_the_rule_expects(self):
        # Gumbel top-k is successive sampling without replacement: its first pick is a draw of Q.
        generator = torch.Generator().manual_seed(3)
        picks = torch.tensor(
            [_candidates(Q, SamplingConfig(temperature=1.0), generator, None)[0] for _ in range(DRAWS)]
        )
        assert_follows(torch.bincount(picks, minlength=8), Q, "first sibling")

    @pytest.mark.parametrize("guess", [4, 1])
    def test_a_guess_grafted_after_sampled_siblings_gives_the_target_distribution(self, guess):
        # Token 4 (P 0.13, Q 0.02) is new to the siblings wherever they fall; token 1 is Q's likeliest, so the
        # guess often follows a drawn sibling instead of adding one.
        firsts = first_tokens(lambda g: graft(sampled_siblings(g, count=2), [guess], max_nodes=4), DRAWS, seed=4)
        assert_follows(torch.bincount(firsts, minlength=8), P, f"2 sampled siblings and a guess of {guess}")

    def test_power_a_grafted_guess_taken_as_drawn_from_q_is_caught(self):
        def as_drawn(generator):
            tree = graft(sampled_siblings(generator, count=2), [4], max_nodes=4)
            # The grafted node treated as a third draw from Q, not as the one-hot guess it is.
            return TokenTree(tree.tokens, tree.parents, tree.dists, tree.dist_rows, {})

        firsts = first_tokens(as_drawn, DRAWS, seed=4)
        pvalue, _ = fit(torch.bincount(firsts, minlength=8), P)
        assert pvalue < POWER_P

    def test_power_ignoring_that_siblings_were_drawn_without_replacement_is_caught(self):
        firsts = first_tokens(lambda g: sampled_siblings(g, exclude=False), DRAWS, seed=1)
        pvalue, _ = fit(torch.bincount(firsts, minlength=8), P)
        assert pvalue < POWER_P


class TestGraft:
    def test_a_guess_follows_the_trees_nodes_then_hangs_below_the_last_one_reached(self):
        tree = graft(SHAPED, [10, 12, 7, 8], max_nodes=16)
        assert tree.tokens == [10, 11, 12, 13, 14, 7, 8] and tree.parents == [ROOT, 0, 0, 1, ROOT, 2, 5]
        assert tree.children[2] == [5] and tree.fixed == frozenset()  # deterministic tree: nothing to mark

    def test_a_guess_the_tree_already_holds_adds_nothing(self):
        assert graft(SHAPED, [10, 11, 13], max_nodes=16) is SHAPED

    def test_a_new_sibling_comes_after_the_drafted_ones(self):
        tree = graft(SHAPED, [10, 9], max_nodes=16)
        assert tree.children[0] == [1, 2, 5] and tree.tokens[5] == 9

    def test_the_graft_stops_at_max_nodes(self):
        tree = graft(SHAPED, [15, 16, 17], max_nodes=6)
        assert tree.tokens == [10, 11, 12, 13, 14, 15] and tree.parents[5] == ROOT

    def test_new_nodes_stop_where_they_no_longer_pay(self):
        # Following the tree's nodes costs nothing; the second new node (position 3) does not pay.
        asked = []

        def worth(position, nodes):
            asked.append((position, nodes))
            return position < 3

        tree = graft(SHAPED, [10, 12, 7, 8, 9], max_nodes=16, worth=worth)
        assert tree.tokens[5:] == [7] and asked == [(2, 5), (3, 6)]

    def test_a_guess_token_pays_where_its_chance_per_added_second_beats_the_steps_rate(self):
        from speccli.autok.plan import Graft

        graft_plan = Graft("suffix", 3, survival=(0.9, 0.5, 0.1), rate=20.0)  # 20 tokens/s expected without it
        assert graft_plan.worth(0, 0.01) and graft_plan.worth(1, 0.02)  # 0.9 >= 0.2, 0.5 >= 0.4
        assert not graft_plan.worth(2, 0.01)  # 0.1 < 0.2
        assert not graft_plan.worth(3, 0.001)  # past the guess's known survival
        assert graft_plan.worth(2, None) and graft_plan.worth(2, -0.003)  # unmeasured, or no dearer: it pays
        assert Graft("suffix", 3).worth(2, 0.5)  # no rate known: every node

    def test_in_a_sampled_tree_the_new_nodes_are_one_hot(self):
        sampled = TokenTree([2, 1], [ROOT, ROOT], Q[None], {ROOT: 0}, {0: (), 1: (2,)})
        tree = graft(sampled, [5, 6], max_nodes=8)
        assert tree.fixed == frozenset({2, 3}) and tree.excluded == sampled.excluded
        assert torch.equal(tree.drawn_from(2, torch.device("cpu")), torch.eye(8)[5])
        assert torch.allclose(tree.drawn_from(1, torch.device("cpu")), sampled.drawn_from(1, torch.device("cpu")))

    def test_the_drafters_own_share_of_the_tree_and_of_the_accepted_path(self):
        tree = graft(SHAPED, [10, 12, 7, 8], max_nodes=16)
        assert own_share(tree, len(SHAPED), [0, 2, 5, 6]) == (3, 2)
        assert own_share(tree, len(SHAPED), [4]) == (3, 1)


class TestNodeCount:
    def test_stops_where_a_larger_pass_costs_more_than_its_expected_tokens(self):
        # A pass costs 1 s up to 4 tokens fed, then 2 s: three nodes (path probabilities
        # 0.9, 0.5, 0.3) fit in 4 tokens; a fourth at 0.2 would double the cost.
        shape = TreeShape(
            max_depth=4, max_nodes=8, costs=CostCurve({1: 1, 2: 1, 3: 1, 4: 1, 5: 2, 6: 2, 7: 2, 8: 2, 9: 2}, None)
        )
        assert best_node_count([0.9, 0.5, 0.3, 0.2, 0.1], shape, draft_spent=0.1) == 3

    def test_flat_costs_take_every_candidate_up_to_the_budget(self):
        shape = TreeShape(max_depth=4, max_nodes=4, costs=CostCurve({fed: 1.0 for fed in range(1, 10)}, None))
        assert best_node_count([0.9, 0.5, 0.3, 0.2, 0.1], shape, draft_spent=0.1) == 4

    def test_without_costs_takes_the_budget(self):
        assert best_node_count([0.9, 0.5, 0.3], TreeShape(max_depth=2, max_nodes=2), draft_spent=0.0) == 2


def test_the_draft_keeps_the_accepted_path_it_was_fed(pairs, tokenizer):
    from speccli.config import SpecConfig
    from speccli.drafters.model import ModelDrafter
    from speccli.events import TokenEvent
    from speccli.loop import SpeculativeDecoder

    pair = pairs[0]
    draft_lm = wrap(pair.draft)
    drafter = ModelDrafter(draft_lm, len(tokenizer))
    decoder = SpeculativeDecoder(wrap(pair.target), tokenizer, [], drafter)
    ids = tokenizer("hello world", add_special_tokens=False)["input_ids"]
    events = list(decoder.generate(ids, SamplingConfig(), SpecConfig(k=4, max_new_tokens=24, tree=True)))
    context = ids + [e.token_id for e in events if isinstance(e, TokenEvent)]
    cached = list(draft_lm.cached_tokens)
    # Past the prompt: accepted paths stayed instead of being fed again; and only context.
    assert len(ids) < len(cached) <= len(context) and cached == context[: len(cached)]
    fresh = wrap(pair.draft)
    fresh.forward(cached)
    torch.testing.assert_close(draft_lm.forward([7]), fresh.forward([7]), atol=1e-5, rtol=1e-5)
