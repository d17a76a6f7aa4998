"""What the decode loop needs of a model: score new tokens against the cached context,
and forget the cache past a length. transformers is the first backend."""

from __future__ import annotations

import inspect
import time
from typing import Protocol, Sequence

import torch


class CausalLM(Protocol):
    """A causal language model with a KV cache, at batch size 1."""

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


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _output_size(model: torch.nn.Module) -> int:
    """Rows of the output layer (a quantized Linear's `weight` is a method, not a tensor)."""
    head = model.get_output_embeddings()
    size = getattr(head, "out_features", None)
    return int(size) if size is not None else int(head.weight.shape[0])


class TransformersLM:
    """What the transformers backends share: the model in eval mode, its output size, how
    its forward names the cache, its device, and the ids the cache holds."""

    def __init__(self, model: torch.nn.Module, vocab_size: int | None = None) -> None:
        self.model = model.eval()
        self._vocab_size = vocab_size or _output_size(model)
        # transformers 5.x names the argument `cache`; 4.x called it `past_key_values`.
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._supports_logits_to_keep = "logits_to_keep" in params
        self._device = next(model.parameters()).device
        self._tokens: list[int] = []
        # Wall time spent inside forward(), for measuring the engine's own overhead.
        self.forward_seconds = 0.0

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def cached_tokens(self) -> Sequence[int]:
        return self._tokens

    @property
    def max_length(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    def rollback(self, length: int) -> None:
        if length < 0:
            raise ValueError(f"cannot roll back to a negative length ({length})")
        extra = len(self._tokens) - length
        if extra <= 0:
            return
        self._forget(length, extra)
        del self._tokens[length:]

    def _forget(self, length: int, extra: int) -> None:
        """Drop the cache's last `extra` entries, keeping `length`."""
        raise NotImplementedError


class HFCausalLM(TransformersLM):
    """A transformers causal LM plus its DynamicCache.

    Rolling back crops the cache in place (`DynamicCache.crop` with a negative count in
    transformers 5.x): nothing is copied and nothing is prefilled again.
    """

    def __init__(self, model: torch.nn.Module, vocab_size: int | None = None) -> None:
        from transformers import DynamicCache

        super().__init__(model, vocab_size)
        self._new_cache = lambda: DynamicCache(config=model.config)
        self._cache = self._new_cache()

    def forward(self, token_ids: Sequence[int], all_logits: bool = True) -> torch.Tensor:
        if not token_ids:
            raise ValueError("forward() needs at least one token")
        started = time.perf_counter()
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self._device)
        kwargs = {self._cache_kwarg: self._cache, "use_cache": True}
        if not all_logits and self._supports_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        try:
            with torch.inference_mode():
                out = self.model(input_ids=ids, **kwargs)
        except BaseException:
            # Interrupted mid-pass (Ctrl-C, OOM): some layers may hold the new tokens and
            # others not. Start from an empty cache rather than trust it.
            self._cache = self._new_cache()
            self._tokens.clear()
            raise
        self._tokens.extend(token_ids)
        logits = out.logits[0]
        if not all_logits:
            logits = logits[-1:]
        logits = logits.float()
        self.forward_seconds += time.perf_counter() - started
        return logits

    def _forget(self, length: int, extra: int) -> None:
        if length == 0:
            self._cache = self._new_cache()
        else:
            self._cache.crop(-extra)
