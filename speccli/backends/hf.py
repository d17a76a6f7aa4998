"""The transformers backend: a transformers causal LM over its DynamicCache, and what the
transformers backends share (the static-cache backend, speccli.backends.static, builds on it)."""

from __future__ import annotations

import inspect
import time
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch.utils.hooks import RemovableHandle

from speccli.backends.base import Chain, ChainPicker, check_kept_offsets, check_tree_pass

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def _output_size(model: PreTrainedModel) -> int:
    """Rows of the output layer (a quantized Linear's `weight` is a method, not a tensor)."""
    head = model.get_output_embeddings()
    size = getattr(head, "out_features", None)
    return int(size) if size is not None else int(head.weight.shape[0])


def _is_split() -> bool:
    """Whether the model runs split over processes (specgen's --tp: transformers' plan)."""
    distributed = torch.distributed
    return distributed.is_available() and distributed.is_initialized() and distributed.get_world_size() > 1


def _whole(weight: torch.Tensor) -> torch.Tensor:
    """A weight whole on this process: a DTensor's shards gathered (a collective), else itself."""
    from torch.distributed.tensor import DTensor

    return weight.full_tensor() if isinstance(weight, DTensor) else weight


def _weight(embedding: torch.nn.Module) -> torch.Tensor:
    """An input embedding's weight (a tensor: embeddings are never quantized into methods)."""
    weight = embedding.weight
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"the input embedding {type(embedding).__name__} has no weight tensor")
    return weight


def cache_tensors(layer: object) -> tuple[torch.Tensor, torch.Tensor]:
    """A transformers cache layer's keys and values (a layer of attention that holds them)."""
    from transformers.cache_utils import CacheLayerMixin

    if not isinstance(layer, CacheLayerMixin) or layer.keys is None or layer.values is None:
        raise TypeError(f"a {type(layer).__name__} cache layer holds no keys and values")
    return layer.keys, layer.values


class TransformersLM:
    """What the transformers backends share: the model in eval mode, its output size, how
    its forward names the cache, its device, and the ids the cache holds."""

    setup_seconds = 0.0  # eager passes: no one-time setup (StaticCausalLM counts its graph captures)

    def __init__(self, model: PreTrainedModel, vocab_size: int | None = None) -> None:
        self.model: PreTrainedModel = model.eval()
        self._vocab_size = vocab_size or _output_size(model)
        # transformers 5.x names the argument `cache`; 4.x called it `past_key_values`.
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._supports_logits_to_keep = "logits_to_keep" in params
        self._device = next(model.parameters()).device
        # The dtype of the additive attention masks this backend builds.
        self._mask_dtype = _weight(model.get_input_embeddings()).dtype
        if not self._mask_dtype.is_floating_point:
            self._mask_dtype = torch.float32
        self._tokens: list[int] = []
        # Wall time spent inside forward(), for measuring the engine's own overhead.
        self.forward_seconds = 0.0
        self._hidden_hook: list[RemovableHandle] | None = None
        self._feature_layers: tuple[int, ...] | None = None
        self._hidden_parts: list[torch.Tensor] = []

    def capture_hidden(self, layers: Sequence[int] | None = None) -> None:
        """Keep each pass's features: the base model's output, which the output layer reads,
        or with `layers` the inputs of those decoder layers, concatenated in that order
        (forward hooks, so no second pass and no change to the logits)."""
        layers = None if layers is None else tuple(int(i) for i in layers)
        if self._hidden_hook is not None:
            if layers != self._feature_layers:
                raise ValueError(f"hidden states are already kept for layers {self._feature_layers}, not {layers}")
            return
        base = getattr(self.model, "base_model", None)
        if base is None or base is self.model:
            raise ValueError(f"{type(self.model).__name__} has no base model whose hidden states could be read")
        entering: dict[int, torch.Tensor] = {}
        hooks: list[RemovableHandle] = []
        if layers is not None:
            decoder_layers = getattr(base, "layers", None)
            count = len(decoder_layers) if decoder_layers is not None else 0
            bad = [i for i in layers if not 0 <= i < count]
            if decoder_layers is None or not layers or bad:
                raise ValueError(f"{type(self.model).__name__} has {count} decoder layers: no layer {bad or layers}")
            for i in sorted(set(layers)):

                def on_input(module, args, kwargs, i=i) -> None:
                    entering[i] = args[0] if args else kwargs["hidden_states"]

                hooks.append(decoder_layers[i].register_forward_pre_hook(on_input, with_kwargs=True))

        def on_output(module, args, output) -> None:
            if layers is None:
                hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
                self._hidden_parts.append(hidden[0])
            else:
                self._hidden_parts.append(torch.cat([entering[i][0] for i in layers], dim=-1))
                entering.clear()

        hooks.append(base.register_forward_hook(on_output))
        self._hidden_hook = hooks
        self._feature_layers = layers

    @property
    def chains(self) -> bool:
        """A draft chain is a pass per token, driven from the host (StaticCausalLM graphs it)."""
        return False

    def chain(self, logits: torch.Tensor, steps: int, picker: ChainPicker) -> Chain:
        raise NotImplementedError(f"{type(self).__name__} runs no draft chains on the device (its `chains` is False)")

    @property
    def last_hidden(self) -> torch.Tensor:
        if self._hidden_hook is None:
            raise RuntimeError("hidden states are not kept: call capture_hidden() first")
        parts = self._hidden_parts
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def input_embedding(self) -> torch.nn.Module:
        """The input embedding as a drafter may call it on its own (EAGLE heads embed their
        tokens with it): the model's, or where tensor parallelism split the model, a whole
        copy of it (gathered: every rank runs this, see speccli.backends.distributed)."""
        embedding = self.model.get_input_embeddings()
        if not _is_split():
            return embedding
        return torch.nn.Embedding.from_pretrained(_whole(_weight(embedding)), freeze=True)

    def output_rows(self) -> torch.Tensor:
        """The output layer's rows [vocab, hidden], whole (gathered where split, as above)."""
        return _whole(self.model.get_output_embeddings().weight).detach()

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

    def forward(self, token_ids: Sequence[int], all_logits: bool = True) -> torch.Tensor:
        """A pass over the cache (each backend's own: `CausalLM.forward`)."""
        raise NotImplementedError

    def forward_tree(
        self, token_ids: Sequence[int], positions: Sequence[int], visible: torch.Tensor, window_start: int
    ) -> torch.Tensor:
        """A tree pass over the cache (each backend's own: `CausalLM.forward_tree`)."""
        raise NotImplementedError

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

    def keep(self, start: int, offsets: Sequence[int]) -> None:
        offsets = list(offsets)
        check_kept_offsets(start, offsets, len(self._tokens))
        moved = [(i, o) for i, o in enumerate(offsets) if i != o]
        if moved:
            with torch.inference_mode():
                self._move_entries(start, offsets)
            self._tokens[start : start + len(offsets)] = [self._tokens[start + o] for o in offsets]
        self.rollback(start + len(offsets))

    def _move_entries(self, start: int, offsets: list[int]) -> None:
        """Copy the cache entries at start + offsets to start, start + 1, ... (the tail
        past them is dropped afterwards by `rollback`)."""
        raise NotImplementedError

    def _tree_mask(self, n: int, cached: int, window_start: int, visible: torch.Tensor, width: int) -> torch.Tensor:
        """[1, 1, n, width] additive mask: everything before `window_start` visible, the
        window (cached entries past it, then the n new ones) as `visible` says, the rest
        (a static cache's empty slots) hidden."""
        window = cached - window_start + n
        if tuple(visible.shape) != (n, window):
            raise ValueError(f"visible must be [{n}, {window}], got {list(visible.shape)}")
        seen = torch.zeros((n, width), dtype=torch.bool, device=self._device)
        seen[:, :window_start] = True
        seen[:, window_start : cached + n] = visible.to(self._device)
        hidden = torch.finfo(self._mask_dtype).min
        mask = torch.zeros((n, width), dtype=self._mask_dtype, device=self._device).masked_fill_(~seen, hidden)
        return mask[None, None]


class HFCausalLM(TransformersLM):
    """A transformers causal LM plus its DynamicCache.

    Rolling back crops the cache in place (`DynamicCache.crop` with a negative count in
    transformers 5.x): nothing is copied and nothing is prefilled again.
    """

    def __init__(self, model: PreTrainedModel, vocab_size: int | None = None) -> None:
        from transformers import DynamicCache

        super().__init__(model, vocab_size)
        self._new_cache = lambda: DynamicCache(config=model.config)
        self._cache = self._new_cache()

    def forward(self, token_ids: Sequence[int], all_logits: bool = True) -> torch.Tensor:
        if not token_ids:
            raise ValueError("forward() needs at least one token")
        kwargs: dict[str, Any] = {}
        if not all_logits and self._supports_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        return self._pass(token_ids, kwargs, all_logits)

    def forward_tree(
        self, token_ids: Sequence[int], positions: Sequence[int], visible: torch.Tensor, window_start: int
    ) -> torch.Tensor:
        check_tree_pass(token_ids, positions)
        n, cached = len(token_ids), len(self._tokens)
        kwargs = {
            "position_ids": torch.tensor([list(positions)], dtype=torch.long, device=self._device),
            "attention_mask": self._tree_mask(n, cached, window_start, visible, cached + n),
        }
        return self._pass(token_ids, kwargs, all_logits=True)

    def _pass(self, token_ids: Sequence[int], kwargs: dict[str, Any], all_logits: bool) -> torch.Tensor:
        started = time.perf_counter()
        self._hidden_parts = []
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self._device)
        kwargs = {self._cache_kwarg: self._cache, "use_cache": True, **kwargs}
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

    def _move_entries(self, start: int, offsets: list[int]) -> None:
        source = torch.tensor([start + o for o in offsets], dtype=torch.long, device=self._device)
        end = start + len(offsets)
        for layer in self._cache.layers:
            keys, values = cache_tensors(layer)
            keys[..., start:end, :] = keys.index_select(-2, source)
            values[..., start:end, :] = values.index_select(-2, source)
