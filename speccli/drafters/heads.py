"""Drafters that draft from the target's own hidden states (speccli.heads): Medusa heads
guess the next few tokens from the last settled feature at once; the EAGLE head runs
autoregressively in feature space over a cache of its own.

Both read features the target computed anyway: the decoder asks, before prefilling, from
which position a drafter lacks them (`features_from`), prefills the target from there, and
after each pass hands over the features of what was settled (`observe_features`). A
feature at position p is the target's last hidden state there: the one its output layer
turns into the logits of token p + 1.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Protocol, Sequence

import torch

from speccli.backends.base import Chain, common_prefix_length, pick_chain
from speccli.config import SamplingConfig
from speccli.coupling import Noise
from speccli.drafters.base import Draft, Drafter, FeatureReader, TreeDraft, draw
from speccli.drafters.chain import Pickers, until_unsure
from speccli.drafters.trees import TreeSource, feed_window, grow_tree
from speccli.drafters.eagle3_layer import Eagle3Head
from speccli.drafters.eagle_layer import EagleHead, additive_mask
from speccli.drafters.medusa_heads import MedusaHeads
from speccli.drafters.draft_vocab import DraftVocab
from speccli.tree import ROOT, TokenTree, TreeShape


class CroppedCache(Protocol):
    """A head's KV cache (transformers' DynamicCache, or EAGLE-3's HeadCache)."""

    def crop(self, count: int) -> None: ...


class HeadPasses:
    """The seconds a drafter spends in its heads' own passes, kept in `forward_seconds` as the
    backends keep theirs, so that time outside forward passes means bookkeeping only."""

    forward_seconds = 0.0

    def _pass(self, function, *args, **kwargs):
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            self.forward_seconds += time.perf_counter() - started


class MedusaDrafter(HeadPasses, Drafter):
    """Head i of a Medusa set proposes the token i + 1 places past the pending one, from the
    feature of the last settled position: one small pass for the whole draft."""

    name = "medusa"
    drafts_trees = True
    feature_layers: tuple[int, ...] | None = None  # the target's last hidden state

    @property
    def features(self) -> FeatureReader:
        return self

    def __init__(self, heads: MedusaHeads, vocab: DraftVocab, dtype: torch.dtype | None = None) -> None:
        self.heads = heads.eval()
        self.vocab = vocab
        self.dtype = dtype or next(heads.parameters()).dtype
        self.heads.to(self.dtype)
        self._feature: torch.Tensor | None = None
        self._position = -1  # the position self._feature belongs to

    def start(self, context: Sequence[int]) -> None:
        # A feature does not say which tokens it read: one from before this generation is
        # not trusted (the decoder feeds the target the last settled token again instead).
        self._forget()

    def features_from(self, context: Sequence[int]) -> int:
        return max(0, len(context) - 2)

    def observe_features(self, start: int, features: torch.Tensor) -> None:
        if len(features):
            self._feature = features[-1]
            self._position = start + len(features) - 1

    def propose(
        self,
        context: Sequence[int],
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        noise: Noise | None = None,
    ) -> Draft:
        if k <= 0 or self._feature is None or self._position != len(context) - 2:
            return Draft([])
        with torch.inference_mode():
            logits = self._pass(self.heads, self._feature.to(self.dtype))[: min(k, self.heads.heads)]
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        for i, row in enumerate(logits):
            full = self.vocab.to_target(row)
            if generator is not None:
                full = full.to(generator.device)
            token, q, _ = draw(full, sampling, generator, None if noise is None else noise(i))
            tokens.append(token)
            if q is not None:
                probs.append(q)
        return Draft(tokens, torch.stack(probs) if probs else None)

    def propose_tree(
        self,
        context: Sequence[int],
        shape: TreeShape,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        noise: Noise | None = None,
    ) -> TreeDraft:
        """A tree as Medusa drafts one: each depth's nodes offer the top candidates of
        that depth's head (the heads read the same feature, so every node at a depth has
        the same children's distribution); the most probable paths are kept."""
        if self._feature is None or self._position != len(context) - 2:
            return TreeDraft(TokenTree([], []))
        with torch.inference_mode():
            rows = [self.vocab.to_target(row) for row in self._pass(self.heads, self._feature.to(self.dtype))]
        shape = replace(shape, max_depth=min(shape.max_depth, len(rows)))
        source = _FixedRows(rows)
        return TreeDraft(grow_tree(source, context, shape, sampling, generator, noise)[0])

    def rollback(self, length: int) -> None:
        if self._position > length - 1:
            self._forget()

    def _forget(self) -> None:
        self._feature = None
        self._position = -1


class _FixedRows(TreeSource):
    """Medusa's tree source: depth d's children come from head d + 1, whatever the parent."""

    expands_free = True

    def __init__(self, rows: list[torch.Tensor]) -> None:
        self.rows = rows

    def root_logits(self, context: Sequence[int]) -> torch.Tensor:
        return self.rows[0]

    def expand(
        self, nodes: Sequence[int], tokens: Sequence[int], parents: Sequence[int], depth: int
    ) -> list[torch.Tensor]:
        return [self.rows[depth]] * len(nodes)


class EagleDrafter(HeadPasses, Drafter):
    """An EAGLE head drafts token by token: fed (feature of p, embedding of token p + 1) at
    position p it predicts the feature of p + 1, whose logits (through `output`) give the
    token after it. EAGLE-1/2: the feature is the target's last hidden state and `output`
    the target's rows for the draft vocabulary; EAGLE-3: the real features are three target
    layers' inputs, what the head feeds back is its own layer's output, and `output` its own
    norm and output layer. Real features fill its cache as the target settles them; drafted
    entries are dropped at the next step."""

    name = "eagle"
    drafts_trees = True

    @property
    def features(self) -> FeatureReader:
        return self

    def __init__(
        self,
        head: EagleHead | Eagle3Head,
        vocab: DraftVocab,
        embeddings: torch.nn.Module,
        output: torch.nn.Module,
        stop_confidence: float = 0.0,
        dtype: torch.dtype | None = None,
        feature_layers: tuple[int, ...] | None = None,
        device_chains: bool | None = None,
    ) -> None:
        """`output` turns the head's output into logits over `vocab` (the target's rows for
        it, or an EAGLE-3 head's own norm and output layer); `feature_layers`: the target
        layers whose inputs an EAGLE-3 head reads (None: the target's last hidden state);
        `device_chains`: pick each drafted token on the device and feed it back there, with
        one copy to the host per draft (None: on CUDA, where a copy waits for the GPU)."""
        self.dtype = dtype or next(head.parameters()).dtype
        self.head = head.eval().to(self.dtype)
        weight = embeddings.weight
        assert isinstance(weight, torch.Tensor)
        self.device = weight.device
        self.vocab = replace(vocab, ids=vocab.ids.to(self.device))  # to_target reads them every step
        self.embeddings = embeddings
        self.output = output.to(self.dtype)
        self.stop_confidence = stop_confidence
        self.feature_layers = feature_layers
        self.device_chains = self.device.type == "cuda" if device_chains is None else device_chains
        self._pickers = Pickers(vocab.target_size, vocab.target_size, self.device)
        self._reset()

    def _reset(self) -> None:
        self._cache: CroppedCache | None = None
        self._entries = 0  # cache entries, drafted ones included
        self._real = 0  # cache entries fed real features (positions 0 .. _real - 1)
        self._seen: list[int] = []  # the tokens the real entries read: context[: _real + 1]
        self._pending: torch.Tensor | None = None  # features not yet fed, from position _real
        self._last: torch.Tensor | None = None  # the feature the last real entry predicted

    def _crop(self, entries: int) -> None:
        if entries >= self._entries:
            return
        if entries == 0 or self._cache is None:
            self._cache = None
        else:
            self._cache.crop(entries - self._entries)  # transformers 5: a negative count removes
        self._entries = entries

    def _valid(self, context: Sequence[int]) -> int:
        """Real entries that read a prefix of `context` (entry p reads tokens up to p + 1)."""
        return max(0, min(self._real, common_prefix_length(self._seen, context) - 1))

    def _keep_real(self, valid: int) -> None:
        if valid < self._real:
            self._last = None
        self._crop(valid)
        self._real = min(self._real, valid)
        del self._seen[self._real + 1 :]

    def features_from(self, context: Sequence[int]) -> int:
        return self._valid(context)

    def start(self, context: Sequence[int]) -> None:
        self._keep_real(self._valid(context))
        self._pending = None

    def observe_features(self, start: int, features: torch.Tensor) -> None:
        if not len(features):
            return
        if start < self._real:
            self._keep_real(start)
            self._pending = None
        have = self._real + (0 if self._pending is None else len(self._pending))
        if start > have:
            self._reset()  # features are missing for some positions: start again from nothing
            return
        features = features.to(self.device, self.dtype)
        if self._pending is None or start == self._real:
            self._pending = features
        else:
            self._pending = torch.cat([self._pending[: start - self._real], features])

    def _step(self, features: torch.Tensor, tokens: Sequence[int] | torch.Tensor, first: int) -> torch.Tensor:
        """Feed entries at positions first.. (features [n, hidden], the tokens after them, ids
        or a [1, n] tensor on the device); returns the predicted features [n, hidden]."""
        if self._cache is None:
            self._cache = self.head.new_cache()
        if isinstance(tokens, torch.Tensor):
            ids = tokens
        else:
            ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        count = ids.shape[1]
        embeds = self.embeddings(ids).to(self.dtype)
        positions = torch.arange(first, first + count, device=self.device)[None]
        out = self._pass(self.head, features[None], embeds, positions, cache=self._cache)
        self._entries += count
        return out[0]

    def propose(
        self,
        context: Sequence[int],
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        noise: Noise | None = None,
    ) -> Draft:
        n = len(context)
        if k <= 0:
            return Draft([])
        with torch.inference_mode():
            feature = self._root(context)
            if feature is None:
                return Draft([])
            if self.device_chains:
                return self._chain(feature, n, k, sampling, generator, noise)
            tokens: list[int] = []
            probs: list[torch.Tensor] = []
            for i in range(k):
                row = self._logits(feature)
                if generator is not None:
                    row = row.to(generator.device)
                token, q, confidence = draw(row, sampling, generator, None if noise is None else noise(i))
                tokens.append(token)
                if q is not None:
                    probs.append(q)
                if i + 1 == k or confidence < self.stop_confidence:
                    break
                feature = self._step(feature[None], [token], n - 1 + i)[-1]
        return Draft(tokens, torch.stack(probs) if probs else None)

    def _chain(
        self,
        feature: torch.Tensor,
        n: int,
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        noise: Noise | None,
    ) -> Draft:
        """The k steps with each token picked on the device (speccli.drafters.chain) and fed
        back from there: the host reads the draft once, and cuts it after the first unsure
        token. (Not one graph: the head's cache grows by concatenation.)"""

        def feed(token: torch.Tensor, index: int) -> torch.Tensor:
            nonlocal feature
            feature = self._step(feature[None], token.view(1, 1), n - 1 + index)[-1]
            return self._logits(feature)

        picker = self._pickers.loaded(sampling, k, generator, noise)
        return until_unsure(Chain.read(*pick_chain(self._logits(feature), k, picker, feed)), self.stop_confidence)

    def _root(self, context: Sequence[int]) -> torch.Tensor | None:
        """Feed the real features not fed yet (dropping last step's drafted entries) and
        return the feature predicted for the pending token: the one its successor's logits
        come from. None when features are missing."""
        n = len(context)
        if n < 2:
            return None
        self._crop(self._real)
        pending = 0 if self._pending is None else len(self._pending)
        if self._real + pending != n - 1:
            return None  # features missing (a gap the decoder did not fill)
        if self._pending is not None and pending:
            predicted = self._step(self._pending, context[self._real + 1 : n], self._real)
            self._seen = list(context[:n])
            self._real, self._pending = n - 1, None
            self._last = predicted[-1]
        return self._last

    def propose_tree(
        self,
        context: Sequence[int],
        shape: TreeShape,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        noise: Noise | None = None,
    ) -> TreeDraft:
        """A tree as EAGLE-2 drafts one: the most probable nodes of each depth are fed to
        the head together (each sees the context's entries and its own ancestors), and the
        nodes of highest path probability are kept (speccli.drafters.trees)."""
        with torch.inference_mode():
            feature = self._root(context)
            if feature is None:
                return TreeDraft(TokenTree([], []))
            return TreeDraft(grow_tree(_EagleSource(self, feature), context, shape, sampling, generator, noise)[0])

    def _logits(self, feature: torch.Tensor) -> torch.Tensor:
        return self.vocab.to_target(self._pass(self.output, feature))

    def rollback(self, length: int) -> None:
        if self._real > length - 1:
            self._keep_real(max(0, length - 1))
            self._pending = None
        elif self._pending is not None and self._real + len(self._pending) > length:
            # The feature of position p read context[: p + 1]: it stands while p < length.
            self._pending = self._pending[: max(0, length - self._real)]


class _EagleSource(TreeSource):
    """EAGLE's tree source: expanding a node feeds the head (its parent's predicted
    feature, its own token) at its position, seeing the real entries and its ancestors."""

    def __init__(self, drafter: EagleDrafter, root_feature: torch.Tensor) -> None:
        self.drafter = drafter
        self.features: dict[int, torch.Tensor] = {ROOT: root_feature}
        self.window: dict[int, int] = {}  # node -> its offset among the drafted entries

    def root_logits(self, context: Sequence[int]) -> torch.Tensor:
        return self.drafter._logits(self.features[ROOT])

    def expand(
        self, nodes: Sequence[int], tokens: Sequence[int], parents: Sequence[int], depth: int
    ) -> list[torch.Tensor]:
        drafter = self.drafter
        real = drafter._real
        # Every real entry, then the drafted ones as feed_window says.
        seen = torch.cat(
            [torch.ones((len(nodes), real), dtype=torch.bool), feed_window(self.window, nodes, parents)], dim=1
        )
        mask = additive_mask(seen, drafter.dtype).to(drafter.device)
        if drafter._cache is None:
            drafter._cache = drafter.head.new_cache()
        features = torch.stack([self.features[parents[node]] for node in nodes])
        ids = torch.tensor([[tokens[node] for node in nodes]], dtype=torch.long, device=drafter.device)
        embeds = drafter.embeddings(ids).to(drafter.dtype)
        # Node at depth d reads the feature of position (pending + d - 1).
        positions = torch.full((1, len(nodes)), real + depth - 1, dtype=torch.long, device=drafter.device)
        out = drafter._pass(drafter.head, features[None], embeds, positions, cache=drafter._cache, attention_mask=mask)[
            0
        ]
        drafter._entries += len(nodes)
        for node, feature in zip(nodes, out):
            self.features[node] = feature
        return [drafter._logits(feature) for feature in out]
