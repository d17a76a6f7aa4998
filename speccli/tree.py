"""Token trees: one target pass verifies several candidate continuations at once.

A chain of k drafted tokens uses a pass over k + 1 tokens. Where a pass over many tokens
costs little more than one (CUDA graphs; CPUs with bf16 matrix units), the rest of that
pass can check alternatives: a tree whose root is the pending token (the last context
token, not yet in the target's cache) and whose nodes are candidate tokens. The pass
feeds [pending] + nodes with an attention mask in which each node sees the cached context
and its own ancestors only, at position (context length - 1) + depth; row r of the logits
then scores the token after fed token r along r's own path, exactly as a chain would.

Verification walks down from the root:

* greedy: move to the child that is the target's argmax; stop where no child is;
* coupled (a seed): the same over the target's Gumbel-perturbed scores of each depth's
  output position (speccli.coupling), so the output is the target's own sample;
* sampling: the multi-candidate rule. At a node with target distribution p (the residual
  r = p to start) and children x_1 .. x_m, child i was drawn from q_i (given the earlier
  siblings); accept x_i with probability min(1, r(x_i) / q_i(x_i)), else r <- norm(max(0,
  r - q_i)) and try the next sibling; when none is accepted, the next token is drawn from
  r. Each stage outputs r's distribution whatever q_i is (by induction from the last), so
  the output is distributed as p exactly. Children drawn without replacement from the
  draft's q have q_i = q with the earlier siblings removed; deterministic children (top
  candidates, prompt lookup) have q_i one-hot.

Afterwards the caller keeps the root and the accepted path in the target's cache
(`keep`): their keys and values are moved into place, nothing is computed again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from speccli.autok.costs import CostCurve
from speccli.config import SamplingConfig
from speccli.coupling import perturbed
from speccli.verify import Verdict, accept_mask, residual_distribution, sample, warp

ROOT = -1
# Nodes of a tree verified in one pass when no costs were measured (a fixed k, no calibration).
DEFAULT_TREE_NODES = 8


@dataclass(frozen=True, eq=False)
class TokenTree:
    """Candidate tokens under the pending token. Node i holds `tokens[i]`; its parent is
    `parents[i]` (ROOT, or an earlier node), so parents come before their children.
    Siblings hold distinct tokens and are tried in order.

    `dists` ([rows, V]) holds, for sampled trees, the draft distribution each expanded
    node's children were drawn from without replacement, its row given by `dist_rows`
    (ROOT included); siblings are then in the order they were drawn. A node was drawn
    from that distribution with its earlier siblings' tokens removed, or with the tokens
    `excluded[node]` removed where siblings drawn before it were left out of the tree.
    Without `dists` the children are deterministic (q one-hot); so are the nodes in `fixed`
    of a sampled tree (another drafter's guess grafted into it: `graft`), each after the
    siblings drawn before it."""

    tokens: list[int]
    parents: list[int]
    dists: torch.Tensor | None = None
    dist_rows: dict[int, int] = field(default_factory=dict)
    excluded: dict[int, tuple[int, ...]] = field(default_factory=dict)
    fixed: frozenset[int] = frozenset()
    depths: list[int] = field(init=False)
    children: dict[int, list[int]] = field(init=False)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError("a tree needs one parent per token")
        depths: list[int] = []
        children: dict[int, list[int]] = {ROOT: []}
        for node, (token, parent) in enumerate(zip(self.tokens, self.parents)):
            if not ROOT <= parent < node:
                raise ValueError(f"node {node}'s parent {parent} does not come before it")
            siblings = children[parent]
            if any(self.tokens[s] == token for s in siblings):
                raise ValueError(f"node {node} repeats a sibling's token {token}")
            siblings.append(node)
            children[node] = []
            depths.append(1 if parent == ROOT else depths[parent] + 1)
        if self.dists is not None:
            drawn = {p: [c for c in kids if c not in self.fixed] for p, kids in children.items()}
            missing = [p for p in drawn if drawn[p] and p not in self.dist_rows]
            if missing:
                raise ValueError(f"sampled tree without the draft distribution of nodes {missing}")
        object.__setattr__(self, "depths", depths)
        object.__setattr__(self, "children", children)

    @classmethod
    def chain(cls, tokens: Sequence[int], probs: torch.Tensor | None = None) -> "TokenTree":
        """A chain is a tree whose nodes each have one child."""
        parents = [ROOT] + list(range(len(tokens) - 1)) if tokens else []
        rows = {node: node + 1 for node in range(-1, len(tokens) - 1)} if probs is not None else {}
        return cls(list(tokens), parents, probs, rows)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    @property
    def sampled(self) -> bool:
        return self.dists is not None

    def fed_depths(self) -> list[int]:
        """Depth of every fed token: the pending token (0), then each node."""
        return [0, *self.depths]

    def visibility(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[n+1, n+1] bool over the fed tokens: row r sees column c iff c is r or one of
        its ancestors (the pending token is everyone's)."""
        n = len(self.tokens) + 1
        visible = torch.zeros((n, n), dtype=torch.bool)
        visible[:, 0] = True
        for node, parent in enumerate(self.parents):
            row = node + 1
            if parent != ROOT:
                visible[row] = visible[parent + 1]
            visible[row, row] = True
        return visible.to(device)

    def path_to(self, node: int) -> list[int]:
        path = []
        while node != ROOT:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def drawn_from(self, node: int, device: torch.device) -> torch.Tensor:
        """The distribution `node` was drawn from: its parent's draft q without the tokens
        drawn before it (renormalised)."""
        if self.dists is None:
            raise ValueError("a deterministic tree's nodes were not drawn from a distribution")
        if node in self.fixed:
            q = torch.zeros(self.dists.shape[-1], device=device, dtype=torch.float32)
            q[self.tokens[node]] = 1.0
            return q
        parent = self.parents[node]
        q = self.dists[self.dist_rows[parent]].to(device=device, dtype=torch.float32)
        removed = self.excluded.get(node)
        if removed is None:
            siblings = [s for s in self.children[parent] if s not in self.fixed]
            removed = tuple(self.tokens[s] for s in siblings[: siblings.index(node)])
        if removed:
            q = q.clone()
            q[list(removed)] = 0.0
            q = q / q.sum().clamp_min(torch.finfo(q.dtype).tiny)
        return q


def graft(
    tree: TokenTree, guess: Sequence[int], max_nodes: int, worth: Callable[[int, int], bool] | None = None
) -> TokenTree:
    """`tree` with another drafter's deterministic `guess` (a chain under the root) grafted in:
    the guess follows the tree's nodes while they hold its tokens, and the rest of it hangs
    under the last one reached as new nodes, after their siblings, at most `max_nodes` nodes
    in all, and only while `worth(position in the guess, nodes so far)` says a new node pays.
    The tree's nodes keep their numbers (the new ones come after), so that what its drafter
    knows of them still holds. In a sampled tree the new nodes are `fixed` (q
    one-hot): the guess depends on the context alone, and the multi-candidate rule takes
    any sibling's q as long as it is what that sibling was drawn from."""
    tokens, parents = list(tree.tokens), list(tree.parents)
    node = ROOT
    for position, token in enumerate(guess):
        existing = next((c for c in tree.children.get(node, ()) if tokens[c] == token), None)
        if existing is None:
            if len(tokens) >= max_nodes or (worth is not None and not worth(position, len(tokens))):
                break
            existing = len(tokens)
            tokens.append(token)
            parents.append(node)
        node = existing
    if len(tokens) == len(tree):
        return tree
    added = frozenset(range(len(tree), len(tokens)))
    fixed = tree.fixed | added if tree.sampled else frozenset()
    return TokenTree(tokens, parents, tree.dists, dict(tree.dist_rows), dict(tree.excluded), fixed)


def own_share(tree: TokenTree, own: int, path: Sequence[int]) -> tuple[int, int]:
    """(depth, accepted) of the drafter's own nodes (those before `own`) in a tree with a
    grafted guess: how deep its own tree went, and how much of the accepted `path` it held
    (a graft's new nodes hang below the drafter's, so they end the path)."""
    depth = max(tree.depths[:own], default=0)
    return depth, sum(1 for node in path if node < own)


def verify_tree_greedy(scores: torch.Tensor, tree: TokenTree) -> Verdict:
    """scores: [n+1, V], row r for fed token r. Follows the children that are the row's
    argmax (Gumbel-perturbed scores make this the coupled rule)."""
    best = torch.argmax(scores, dim=-1).tolist()
    path: list[int] = []
    node = ROOT
    while True:
        token = best[node + 1]
        match = next((c for c in tree.children[node] if tree.tokens[c] == token), None)
        if match is None:
            return Verdict(path, token, resampled=bool(tree.children[node]))
        path.append(match)
        node = match


def verify_tree_sampled(p: torch.Tensor, tree: TokenTree, generator: torch.Generator | None) -> Verdict:
    """The multi-candidate rule (see the module's docstring). p: [n+1, V] warped target
    probabilities, row r for fed token r."""
    path: list[int] = []
    node = ROOT
    while True:
        residual = p[node + 1]
        kids = tree.children[node]
        if not kids:
            return Verdict(path, int(sample(residual, generator)), resampled=False)
        accepted = None
        for child in kids:
            token = tree.tokens[child]
            if tree.sampled:
                q = tree.drawn_from(child, p.device)
            else:
                q = torch.zeros_like(residual)
                q[token] = 1.0
            uniform = torch.rand((), generator=generator, device=p.device)
            if bool(accept_mask(residual[token], q[token], uniform)):
                accepted = child
                break
            residual = residual_distribution(residual, q)
        if accepted is None:
            return Verdict(path, int(sample(residual, generator)), resampled=True)
        path.append(accepted)
        node = accepted


@dataclass(frozen=True)
class Branch:
    """The lookahead branch of one pass: its tokens, their positions past the pending
    token's, and which of them each sees ([m, m]; every one also sees the pending token)."""

    tokens: list[int]
    offsets: list[int]
    visible: torch.Tensor

    def __len__(self) -> int:
        return len(self.tokens)

    def beside(self, tree_visible: torch.Tensor) -> torch.Tensor:
        """The visibility of [pending, tree nodes, branch tokens]: the tree's block, this
        branch's block, and the pending token for every branch token."""
        n, m = tree_visible.shape[0], len(self.tokens)
        visible = torch.zeros((n + m, n + m), dtype=torch.bool)
        visible[:n, :n] = tree_visible
        visible[n:, 0] = True
        visible[n:, n:] = self.visible
        return visible


@dataclass(frozen=True)
class TreePass:
    """What one tree pass feeds after `cached` tokens: the pending token, the tree's nodes
    and, beside them, a lookahead branch if one rides along (its rows come after the tree's
    and none of it stays in the cache)."""

    tokens: list[int]
    positions: list[int]
    visible: torch.Tensor
    tree_rows: int  # the pending token's row and the tree's: the rest are the branch's

    @classmethod
    def of(cls, pending: int, tree: TokenTree, cached: int, branch: Branch | None = None) -> TreePass:
        tokens = [pending, *tree.tokens]
        positions = [cached + depth for depth in tree.fed_depths()]
        visible = tree.visibility()
        if branch is not None:
            # The branch sees the pending token and itself; the tree does not see it.
            tokens += branch.tokens
            positions += [cached + offset for offset in branch.offsets]
            visible = branch.beside(visible)
        return cls(tokens, positions, visible, len(tree) + 1)


def verify_tree(
    logits: torch.Tensor,
    tree: TokenTree,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    noise: torch.Tensor | None = None,
) -> Verdict:
    """The rule the sampling settings call for (see the module's docstring); `noise`: the
    coupled rule's noise for each fed token's row (a seeded generation)."""
    if sampling.greedy:
        return verify_tree_greedy(logits, tree)
    if noise is not None:
        return verify_tree_greedy(perturbed(warp(logits, sampling), noise), tree)
    return verify_tree_sampled(warp(logits, sampling), tree, generator)


def kept_offsets(path: Sequence[int]) -> list[int]:
    """Offsets among the fed tokens of what the cache keeps: the pending token and the path."""
    return [0, *(node + 1 for node in path)]


@dataclass(frozen=True)
class TreeShape:
    """How large a tree may grow: depth (the policy's k), nodes (the pass holds nodes + 1
    tokens), and the costs that decide how much of that is worth it: a pass is priced at
    the sizes `costs` holds, unknown past them."""

    max_depth: int
    max_nodes: int
    costs: CostCurve | None = None

    def pass_cost(self, fed: int) -> float | None:
        return None if self.costs is None else self.costs.measured(fed)

    @property
    def draft_seconds(self) -> float | None:
        """One draft pass."""
        return None if self.costs is None else self.costs.draft_seconds

    @classmethod
    def for_costs(cls, k: int, live: CostCurve | None, calibrated: CostCurve | None) -> TreeShape:
        """k deep, with as many nodes as the costs say pay: those k auto measured in this
        session (`live`; unmeasured sizes guessed optimistically, so that they get tried
        and measured), else a calibration's, up to the largest pass measured; at least
        DEFAULT_TREE_NODES where nothing was measured."""
        if live is not None and live.verify_seconds:
            largest = max(live.largest, k + 1, DEFAULT_TREE_NODES + 1)
            return cls(k, largest - 1, live.filled(largest))
        if calibrated is not None:
            return cls(k, max(k, calibrated.largest - 1), calibrated)
        return cls(k, max(k, DEFAULT_TREE_NODES))


def best_node_count(path_probs: Sequence[float], shape: TreeShape, draft_spent: float) -> int:
    """How many of the candidates (sorted by path probability, best first) to verify:
    the count that maximises expected tokens per second, (1 + sum of path probabilities)
    / (drafting + the pass's cost), a path probability standing for the chance the node
    is accepted (EAGLE-2). Without measured costs: all of them."""
    limit = min(len(path_probs), shape.max_nodes)
    if limit == 0:
        return 0
    best, best_rate, expected = limit, None, 1.0
    for count in range(1, limit + 1):
        expected += path_probs[count - 1]
        cost = shape.pass_cost(count + 1)
        if cost is None:
            return limit
        rate = expected / (draft_spent + cost)
        if best_rate is None or rate > best_rate:
            best, best_rate = count, rate
    return best
