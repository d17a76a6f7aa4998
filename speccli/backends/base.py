"""What the decode loop needs of a model: score new tokens against the cached context,
and forget the cache past a length. The backends (speccli.backends.hf, .static, .llamacpp)
implement it; the checks they all make of their arguments are here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Protocol, Sequence

import torch


class ChainPicker(Protocol):
    """How a draft chain picks each token from the draft's logits, on the device: only
    tensor operations (no value read back to the host), so that a whole chain can be
    replayed as one CUDA graph. Its randomness lives in buffers it refills before each chain."""

    @property
    def key(self) -> Hashable:
        """Two pickers with equal keys pick alike from the same buffers: a graph captured with
        one replays for the other."""
        ...

    def pick(self, logits: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """logits [V_draft] -> (token [1] long, the draft's probability of it [1] float32,
        the warped q [V_target] it was drawn from, or None when greedy)."""
        ...


@dataclass(frozen=True)
class Chain:
    """What `CausalLM.chain` drafted: the tokens, the draft's probability of each, and the
    warped q of each ([len(tokens), V_target], None when greedy) on the model's device."""

    tokens: list[int]
    confidence: list[float]
    probs: torch.Tensor | None

    @classmethod
    def read(cls, tokens: torch.Tensor, confidence: torch.Tensor, probs: torch.Tensor | None) -> "Chain":
        """The chain from its device tensors, in one copy to the host (ids are exact in float64)."""
        picked = torch.stack([tokens.double(), confidence.double()]).cpu()
        return cls([int(i) for i in picked[0].tolist()], picked[1].tolist(), probs)


def pick_chain(
    logits: torch.Tensor, steps: int, picker: ChainPicker, feed: Callable[[torch.Tensor, int], torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A chain's picks on the device: the first token from `logits`, each next one from
    `feed(token, index)`, the logits after the index-th token was fed. Returns (tokens [steps],
    the draft's probability of each [steps], q [steps, V] or None), nothing read back."""
    tokens, confidence, probs = [], [], []
    for index in range(steps):
        token, chance, q = picker.pick(logits, index)
        tokens.append(token)
        confidence.append(chance.float())
        if q is not None:
            probs.append(q)
        if index + 1 < steps:
            logits = feed(token, index)
    return torch.cat(tokens), torch.cat(confidence), torch.stack(probs) if probs else None


class CausalLM(Protocol):
    """A causal language model with a KV cache, at batch size 1."""

    @property
    def setup_seconds(self) -> float:
        """Seconds of one-time setup spent inside passes so far (a CUDA graph captured on
        first use): the decoder keeps them out of the steps' timings."""
        ...

    @property
    def chains(self) -> bool:
        """Whether a whole draft chain runs on the device (`chain`): the backends with CUDA
        graphs. Where False, `chain` is never called (it raises NotImplementedError)."""
        ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def cached_tokens(self) -> Sequence[int]:
        """The token ids the cache currently holds, in order."""
        ...

    @property
    def max_length(self) -> int | None:
        """The longest context the model supports, if known."""
        ...

    def forward(self, token_ids: Sequence[int], all_logits: bool = True) -> torch.Tensor:
        """Append `token_ids` to the cache and return float32 logits [n, V] for each of
        them (or [1, V] for the last one only when all_logits is False)."""
        ...

    def rollback(self, length: int) -> None:
        """Keep only the first `length` cached tokens."""
        ...

    def forward_tree(
        self, token_ids: Sequence[int], positions: Sequence[int], visible: torch.Tensor, window_start: int
    ) -> torch.Tensor:
        """Append `token_ids` at the given positions, each attending to every cached entry
        before `window_start` and to the entries from there on (cached ones, then the new
        ones) where its row of `visible` ([n, cached - window_start + n], bool) is True.
        Returns float32 logits [n, V]. The cache then holds them all, in fed order, until
        `keep` or `rollback` says which stay."""
        ...

    def chain(self, logits: torch.Tensor, steps: int, picker: ChainPicker) -> Chain:
        """Draft `steps` tokens on the device (backends with `chains`): pick the first from
        `logits` ([V], the last context token's, on the device), feed it, pick the next from
        its logits, and so on; the cache then holds every picked token but the last. One copy
        reaches the host per chain."""
        ...

    def keep(self, start: int, offsets: Sequence[int]) -> None:
        """Keep the first `start` cached entries followed by those at start + each offset
        (ascending), moved into place; forget the rest."""
        ...


class FeatureLM(CausalLM, Protocol):
    """A CausalLM that can also hand out its last hidden states (the features the output
    layer turns into logits), for drafters that draft from them (Medusa, EAGLE)."""

    def capture_hidden(self, layers: Sequence[int] | None = None) -> None:
        """From now on, keep each pass's features (none are kept by default): the last
        hidden states, or with `layers` the residual stream entering each of those decoder
        layers (transformers' `hidden_states[i]`), concatenated in the order given."""
        ...

    @property
    def last_hidden(self) -> torch.Tensor:
        """[n, hidden] (or [n, len(layers) * hidden]) for every token fed by the latest
        forward / forward_tree (prompts included, whatever `all_logits` said)."""
        ...

    def input_embedding(self) -> torch.nn.Module:
        """The input embedding, callable by a drafter on its own (whole where the model is split)."""
        ...

    def output_rows(self) -> torch.Tensor:
        """The output layer's rows [vocab, hidden], whole."""
        ...


def check_tree_pass(token_ids: Sequence[int], positions: Sequence[int]) -> None:
    """forward_tree's arguments, as every backend requires them."""
    if not token_ids or len(positions) != len(token_ids):
        raise ValueError("forward_tree() needs one position per token, and a token")


def check_kept_offsets(start: int, offsets: list[int], cached: int) -> None:
    """keep's offsets: ascending, distinct, and within the `cached` entries past `start`."""
    if offsets != sorted(set(offsets)) or (offsets and (offsets[0] < 0 or start + offsets[-1] >= cached)):
        raise ValueError(f"cannot keep offsets {offsets} past {start} of {cached} cached entries")


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
