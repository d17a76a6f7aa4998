"""How drafters grow token trees (speccli.tree).

A draft model branches where it is unsure: each depth, the most probable nodes so far are
expanded together in one draft pass (a tree pass over the draft's own cache), each
offering its top candidates as children; the tree verified is the set of candidates with
the highest path probability (the product of the draft's probabilities down the path, a
stand-in for the chance the target accepts the node, as in EAGLE-2), as many as maximise
expected tokens per second under the measured pass costs. Where the draft is sure, every
depth has one clear best node and the tree is a chain.

Prompt lookup offers several earlier continuations of the context's last n-gram, merged
into a trie.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from speccli.config import SamplingConfig
from speccli.coupling import Noise, perturbed
from speccli.tree import ROOT, TokenTree, TreeShape, best_node_count
from speccli.verify import warp

BEAM = 4  # nodes expanded per depth; one draft pass feeds them together
BRANCHES = 4  # children each expanded node offers
# Expanding a node costs a share of a draft pass and gains at most its path probability
# in tokens; without measured costs, expand nodes at least this likely.
DEFAULT_EXPAND_FLOOR = 0.1


def expand_floor(shape: TreeShape) -> float:
    """The path probability below which a node is not worth a draft pass: the draft pass's
    cost in tokens of plain decoding."""
    plain = shape.pass_cost(1)
    if plain and shape.draft_seconds:
        return min(0.9, shape.draft_seconds / plain)
    return DEFAULT_EXPAND_FLOOR


def _candidates(
    q: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None, noise: torch.Tensor | None
) -> list[int]:
    """Up to BRANCHES children from one draft distribution, in the order tried: the most
    probable (greedy); drawn without replacement (Gumbel top-k: the order is the order
    of successive draws); or, coupled, ranked by the position's own noise, so that the
    first is the draft's coupled sample."""
    possible = int((q > 0).sum())
    count = min(BRANCHES, possible)
    if sampling.greedy:
        scores = q
    elif noise is not None:
        scores = perturbed(q, noise)
    else:
        uniform = torch.rand(q.shape, generator=generator, device=q.device).clamp_min_(torch.finfo(q.dtype).tiny)
        scores = torch.log(q) - torch.log(-torch.log(uniform))
    return torch.topk(scores, count).indices.tolist()


@dataclass(frozen=True)
class GrownTree:
    """A drafted tree, and where the draft's cache holds its nodes: `cached[node]` is the
    offset past `base` of each node the draft was fed (the expanded ones), so that the
    accepted path can stay in the draft's cache."""

    tree: TokenTree
    base: int
    cached: dict[int, int]


def _children_counts(
    dists: Sequence[tuple[int, torch.Tensor, float]],
    shape: TreeShape,
    nodes: int,
    expected: float,
    draft_seconds: float,
) -> list[int]:
    """How many children to draw for each (parent, q, parent's path probability), decided
    from the distributions alone, before drawing: slots in order of the parent's path
    probability times q's r-th largest probability, as long as each slot pays for its
    place in the pass (expected tokens per second) and the tree has room."""
    slots: list[tuple[float, int]] = []
    for index, (_, q, above) in enumerate(dists):
        top = torch.topk(q, min(BRANCHES, int((q > 0).sum()))).values.tolist()
        slots += [(above * value, index) for value in top]
    counts = [0] * len(dists)
    for proxy, index in sorted(slots, key=lambda slot: -slot[0]):
        if nodes >= shape.max_nodes:
            break
        now, more = shape.pass_cost(nodes + 1), shape.pass_cost(nodes + 2)
        if (
            now is not None
            and more is not None
            and (expected + proxy) * (draft_seconds + now) < expected * (draft_seconds + more)
        ):
            break
        counts[index] += 1
        nodes += 1
        expected += proxy
    return counts


class TreeSource:
    """Where a grown tree's distributions come from: the root's children's logits, and
    those of the children of nodes chosen for expansion (over the target's vocabulary)."""

    # Expanding a node costs nothing beyond the root's pass (heads that draft every depth at
    # once): no expansion floor (`expand_floor`).
    expands_free: bool = False

    def root_logits(self, context: Sequence[int]) -> torch.Tensor:
        """[V_target] logits of the token after `context`."""
        raise NotImplementedError

    def expand(
        self, nodes: Sequence[int], tokens: Sequence[int], parents: Sequence[int], depth: int
    ) -> list[torch.Tensor]:
        """Logits [V_target] of the children of each of `nodes` (all at `depth`; `tokens`
        and `parents` describe every node grown so far)."""
        raise NotImplementedError


def feed_window(window: dict[int, int], nodes: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
    """Append `nodes` to a drafter's window of fed tree nodes (node -> offset in feeding
    order) and return which window entries each sees: itself and its ancestors, [n, window]."""
    fed = len(window)
    for offset, node in enumerate(nodes):
        window[node] = fed + offset
    visible = torch.zeros((len(nodes), fed + len(nodes)), dtype=torch.bool)
    for row, node in enumerate(nodes):
        ancestor = node
        while ancestor != ROOT:
            visible[row, window[ancestor]] = True
            ancestor = parents[ancestor]
    return visible


def grow_tree(
    source: TreeSource,
    context: Sequence[int],
    shape: TreeShape,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    noise: Noise | None = None,
) -> tuple[TokenTree, dict[int, int]]:
    """A tree grown depth by depth: the BEAM most probable new nodes (above the expansion
    floor) each offer BRANCHES children. Returns the tree and the map from grown node
    numbers to the tree's.

    Greedy and coupled trees keep, at the end, the candidates of highest path
    probability. A tree sampled without a seed may not: keeping a drawn token because of
    its own value would bias what is kept towards the draft's likely tokens, and the rule
    needs each child to be a plain draw (without replacement) from its parent's q. So
    there, how many children each node gets is decided from q before they are drawn, and
    every drawn child stays (which nodes get children may depend on anything drawn before
    them: the rule only looks at children once their parent is accepted)."""
    if shape.max_depth <= 0 or shape.max_nodes <= 0:
        return TokenTree([], []), {}
    started = time.perf_counter()
    sampled = not sampling.greedy and noise is None
    row = source.root_logits(context)
    # A source whose expansions cost no pass (Medusa's heads) expands the BEAM best nodes.
    floor = 0.0 if source.expands_free else expand_floor(shape)
    tokens: list[int] = []
    parents: list[int] = []
    path_probs: list[float] = []
    drawn_before: list[tuple[int, ...]] = []
    dists: list[torch.Tensor] = []
    dist_rows: dict[int, int] = {}
    frontier: list[tuple[int, torch.Tensor]] = [(ROOT, row)]
    for depth in range(1, shape.max_depth + 1):
        here: list[tuple[int, torch.Tensor, float]] = []
        for parent, aligned in frontier:
            if generator is not None:
                aligned = aligned.to(generator.device)
            q = torch.softmax(aligned.float(), dim=-1) if sampling.greedy else warp(aligned, sampling)
            here.append((parent, q, 1.0 if parent == ROOT else path_probs[parent]))
        counts = [BRANCHES] * len(here)
        if sampled:
            spent = time.perf_counter() - started + (shape.draft_seconds or 0.0)
            counts = _children_counts(here, shape, len(tokens), 1.0 + sum(path_probs), spent)
        grown: list[int] = []
        for (parent, q, above), count in zip(here, counts):
            if count == 0:
                continue
            if not sampling.greedy:
                dist_rows[parent] = len(dists)
                dists.append(q)
            chosen = _candidates(q, sampling, generator, None if noise is None else noise(depth - 1))[:count]
            probs = q[chosen].tolist()
            for rank, (token, prob) in enumerate(zip(chosen, probs)):
                grown.append(len(tokens))
                tokens.append(token)
                parents.append(parent)
                path_probs.append(min(above, above * prob))  # a child never outranks its parent
                drawn_before.append(tuple(chosen[:rank]))
        if depth == shape.max_depth or (sampled and len(tokens) >= shape.max_nodes):
            break
        best = sorted(grown, key=lambda node: -path_probs[node])[:BEAM]
        expand = [node for node in best if path_probs[node] >= floor]
        if not expand:
            break
        frontier = list(zip(expand, source.expand(expand, tokens, parents, depth)))

    if sampled:
        kept = list(range(len(tokens)))
    else:
        order = sorted(range(len(tokens)), key=lambda node: (-path_probs[node], node))
        count = best_node_count([path_probs[n] for n in order], shape, time.perf_counter() - started)
        # A parent is at least as probable as its child and comes first among equals, so
        # the kept nodes form a tree.
        kept = sorted(order[:count])
    renumber = {ROOT: ROOT, **{node: i for i, node in enumerate(kept)}}
    excluded = {renumber[n]: drawn_before[n] for n in kept} if dists else {}
    tree = TokenTree(
        [tokens[n] for n in kept],
        [renumber[parents[n]] for n in kept],
        torch.stack(dists) if dists else None,
        {renumber[p]: r for p, r in dist_rows.items() if p in renumber},
        excluded,
    )
    return tree, renumber


def trie(continuations: Sequence[Sequence[int]], max_nodes: int) -> TokenTree:
    """Continuations merged into a tree (first ones first), at most `max_nodes` nodes."""
    tokens: list[int] = []
    parents: list[int] = []
    child_of: dict[tuple[int, int], int] = {}
    for continuation in continuations:
        node = ROOT
        for token in continuation:
            existing = child_of.get((node, token))
            if existing is None:
                if len(tokens) >= max_nodes:
                    break
                existing = child_of[(node, token)] = len(tokens)
                tokens.append(token)
                parents.append(node)
            node = existing
    return TokenTree(tokens, parents)
