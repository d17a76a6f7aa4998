"""A transformers causal LM over a StaticCache, replayed as CUDA graphs on CUDA.

On a GPU a batch-1 decode pass of an eager transformers model is bound by kernel launches
and Python, not by the GPU: replayed as a CUDA graph, a pass costs a fraction of its eager
time, the target's and a small draft's alike (measured: BENCHMARKS.md, section "GPU:
NVIDIA H200"). Speculation only pays there with graphs, and graphs need fixed addresses: a
preallocated (static) KV cache, and input buffers that are refilled in place.

`StaticCausalLM` implements the same `CausalLM` protocol as `HFCausalLM`:

* The cache is a transformers `StaticCache` with room for `capacity` tokens. It starts at
  `min(max_position_embeddings, DEFAULT_CAPACITY)` (or what the caller reserves) and, when
  a longer context is asked for, is re-created twice as large (up to the model's context),
  keeping what it holds; graphs captured over the old one are dropped and captured again.
  4096 tokens of a Qwen2.5-7B cache in bf16 are 235 MB; its whole 32k context would be
  1.9 GB, so sizing to the context up front would cost memory for nothing.
* `forward(ids)` writes at the current position: the cache's layers append at their write
  position (`StaticLayer.cumulative_length`, a tensor on the device), the positions are
  passed explicitly, and the attention mask is a 4-D additive mask that hides every slot
  past each query's position. Its width is the pass's window: for an SDPA model the
  smallest context bucket that holds the context (speccli.backends.attention, which also
  runs grouped-query heads without copying keys and values), else the whole capacity.
* `rollback(length)` only moves every layer's write position back (one device op, no
  sync): entries past it are hidden by the mask and overwritten by the next forward.
  Nothing is copied, nothing is prefilled again.
* Prompts (anything longer than the largest graphed size) run eagerly in chunks.
* On CUDA with graphs on, each fed size 1..`max_fed` is captured once per window as a CUDA
  graph over static buffers (input ids, positions; the mask is computed inside the graph
  from the positions) after a warm-up on a side stream, as PyTorch documents, and replayed from then
  on. The one-token draft step is size 1. Tree passes (token trees, lookahead) get their
  own graph per fed size, whose 4-D mask is read from a static buffer: a tree's mask does
  not follow from its positions. All graphs share one memory pool: they are only ever
  replayed one at a time, and each output is copied out before the next replay.
  A model whose pass cannot be captured (a capture error, e.g. a kernel that synchronises)
  falls back to eager passes over the same static cache; `graphs_error` says why.
* A draft model's chain of k tokens (`chain`) runs on the device: each token picked from
  the last pass's logits (speccli.drafters.chain) and fed to the next pass, with no host
  round trip between them; on CUDA the whole chain is one graph per (k, window, picker),
  and its tokens reach the host in one copy.
* With `compile`, the passes of up to `max_fed` tokens run the model through
  `torch.compile` (inductor fuses the small kernels of norms, rotary embeddings, activations
  and residual adds), compiled on first use (the warm-up before a capture) and replayed inside
  the same CUDA graphs. Shapes after the first compile share one dynamic-shape compile;
  inductor keeps what it compiled on disk (speccli.pipeline points it at specgen's cache), so
  a later start mostly reads it back. A pass that cannot be compiled runs eagerly from then on;
  `compile_error` says why.
* On the CPU (or with graphs off) the same class runs every pass eagerly, so CI tests it.
"""

from __future__ import annotations

import inspect
import time
from typing import TYPE_CHECKING, Any, Callable, Hashable, Sequence, TypeVar

import torch

from speccli.backends.attention import WINDOW_SDPA, pack_mask, query_groups, use_windowed_attention, window_for
from speccli.backends.base import Chain, ChainPicker, check_tree_pass, pick_chain
from speccli.backends.hf import TransformersLM

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE
    from transformers import PreTrainedModel

T = TypeVar("T")
# A chain's picks on the device (`pick_chain`): tokens, the draft's probability of each, q or None.
Picks = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]

DEFAULT_CAPACITY = 4096
# Verification feeds k + 1 tokens (calibration times up to 17); a tree or lookahead pass the
# pending token, the nodes and the window: 32 covers them. Sizes are captured on first use.
DEFAULT_MAX_FED = 32
PREFILL_CHUNK = 512
SUPPORTED_ATTENTION = ("sdpa", "eager", WINDOW_SDPA)


class StaticCacheUnsupported(ValueError):
    """A model this backend cannot serve (sliding-window or linear-attention layers, an
    attention implementation that takes no 4-D mask); use HFCausalLM instead."""


def static_cache_problem(model: PreTrainedModel) -> str | None:
    """Why `StaticCausalLM` cannot serve this model, or None when it can."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    config = model.config
    attention = getattr(config, "_attn_implementation", None) or "eager"
    if attention not in SUPPORTED_ATTENTION:
        return f"attention implementation {attention!r} (the static backend supports {', '.join(SUPPORTED_ATTENTION)})"
    params = inspect.signature(model.forward).parameters
    if "cache" not in params and "past_key_values" not in params:
        return "the model's forward takes no cache"
    try:
        probe = StaticCache(config=config, max_cache_len=1)
    except Exception as error:  # noqa: BLE001 - any failure means: not this backend
        return f"no StaticCache for this config ({error})"
    kinds = {type(layer).__name__ for layer in probe.layers if type(layer) is not StaticLayer}
    if kinds:
        return f"cache layers other than full attention ({', '.join(sorted(kinds))})"
    return None


class StaticCausalLM(TransformersLM):
    """A transformers causal LM over a StaticCache; CUDA graphs per fed size on CUDA."""

    def __init__(
        self,
        model: PreTrainedModel,
        vocab_size: int | None = None,
        *,
        capacity: int | None = None,
        graphs: bool = True,
        max_fed: int = DEFAULT_MAX_FED,
        prefill_chunk: int = PREFILL_CHUNK,
        compile: bool = False,
        device_chains: bool | None = None,
    ) -> None:
        problem = static_cache_problem(model)
        if problem is not None:
            raise StaticCacheUnsupported(f"the static-cache backend cannot serve this model: {problem}")
        super().__init__(model, vocab_size)
        # SDPA models attend over a window of the cache and group their query heads
        # (speccli.backends.attention); eager ones over the whole capacity, as transformers does.
        self.windowed = use_windowed_attention(model)
        self._groups = query_groups(model.config) if self.windowed else 1
        wanted = capacity or DEFAULT_CAPACITY
        self._capacity = min(wanted, self.max_length) if self.max_length else wanted
        self.max_fed = max(1, max_fed)
        self.prefill_chunk = max(1, prefill_chunk)
        self.graphs_enabled = bool(graphs) and self._device.type == "cuda"
        self.graphs_error: str | None = None
        self.compile_enabled = bool(compile)
        self.compile_error: str | None = None
        self._compiled = None
        self._capturing = False  # inside _capture, whose time all counts as setup
        # Seconds spent inside passes on one-time work (capturing graphs): the decoder keeps
        # them out of the step timings that k auto learns a pass's cost from.
        self.setup_seconds = 0.0
        self._cache = self._new_cache(self._capacity)
        # Per (fed size, tree pass, window): the graph, its logits buffer, and its hidden-states
        # buffer (None when it was captured before hidden states were asked for).
        self._graphs: dict[tuple[int, bool, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]] = {}
        self._pool: _POOL_HANDLE | None = None
        self._ids_buffer: torch.Tensor | None = None
        self._positions_buffer: torch.Tensor | None = None
        self._mask_buffer: torch.Tensor | None = None
        # Draft chains (`chain`): a graph per (length, window, picker), and their inputs: the
        # first token's logits and the chain's first position.
        self._device_chains = device_chains
        self._chain_graphs: dict[tuple[int, int, Hashable], tuple[torch.cuda.CUDAGraph, Picks]] = {}
        self._chain_logits: torch.Tensor | None = None
        self._chain_start: torch.Tensor | None = None

    # ------------------------------------------------------------------ protocol

    @property
    def capacity(self) -> int:
        """Tokens the cache holds room for now (it grows on demand up to max_length)."""
        return self._capacity

    @property
    def graphed_sizes(self) -> list[int]:
        """The fed sizes of chain passes captured as CUDA graphs so far."""
        return sorted({n for n, tree, _ in self._graphs if not tree})

    @property
    def graphed_tree_sizes(self) -> list[int]:
        """The fed sizes of tree passes captured as CUDA graphs so far."""
        return sorted({n for n, tree, _ in self._graphs if tree})

    @property
    def graphed_chain_lengths(self) -> list[int]:
        """The lengths of draft chains (`chain`) captured as CUDA graphs so far."""
        return sorted({steps for steps, _, _ in self._chain_graphs})

    @property
    def graphed_windows(self) -> list[int]:
        """The attention windows (cache slots attended over) graphs were captured for."""
        return sorted({window for _, _, window in self._graphs})

    def window(self, length: int) -> int:
        """The cache slots a pass attends over when the context after it is `length` tokens."""
        return window_for(length, self._capacity) if self.windowed else self._capacity

    def capture_hidden(self, layers: Sequence[int] | None = None) -> None:
        first = self._hidden_hook is None
        super().capture_hidden(layers)
        if first:
            self._drop_graphs()  # captured without the hidden states' buffer

    @property
    def chains(self) -> bool:
        """Whether draft chains run here (`chain`): where passes replay as CUDA graphs (a
        chain is then one graph, with no host round trip per token), or as `device_chains`
        says. Not for a model whose hidden states are kept (a target's)."""
        wanted = self.graphs_enabled if self._device_chains is None else self._device_chains
        return bool(wanted) and self._hidden_hook is None

    def chain(self, logits: torch.Tensor, steps: int, picker: ChainPicker) -> Chain:
        if steps < 1:
            raise ValueError(f"a chain drafts at least one token, not {steps}")
        if self._hidden_hook is not None:
            raise RuntimeError("draft chains do not keep hidden states; this model keeps them")
        started = time.perf_counter()
        start = len(self._tokens)
        self.reserve(start + steps - 1)
        width = self.window(start + steps - 1)
        try:
            with torch.inference_mode():
                if self._chain_logits is None or self._chain_start is None or self._chain_logits.shape != logits.shape:
                    self._chain_logits = torch.zeros(logits.shape, dtype=torch.float32, device=self._device)
                    self._chain_start = torch.zeros((1, 1), dtype=torch.long, device=self._device)
                    self._chain_graphs.clear()
                self._chain_logits.copy_(logits)
                self._chain_start.fill_(start)
                if self.graphs_enabled:
                    chain = Chain.read(*self._replay_chain(steps, width, picker, start))
                else:
                    chain = Chain.read(*self._chain_passes(steps, width, picker))
        except BaseException:
            self._set_length(start)
            raise
        self._tokens.extend(chain.tokens[:-1])
        self.forward_seconds += time.perf_counter() - started
        return chain

    def forward(self, token_ids: Sequence[int], all_logits: bool = True) -> torch.Tensor:
        if not token_ids:
            raise ValueError("forward() needs at least one token")
        started = time.perf_counter()
        token_ids = list(token_ids)
        start = len(self._tokens)
        self.reserve(start + len(token_ids))
        self._hidden_parts = []
        try:
            with torch.inference_mode():
                if self.graphs_enabled and len(token_ids) <= self.max_fed:
                    positions = list(range(start, start + len(token_ids)))
                    logits = self._replay(token_ids, positions, start, self.window(start + len(token_ids)))
                else:
                    logits = self._eager_chunks(token_ids, start, all_logits)
        except BaseException:
            # Interrupted mid-pass (Ctrl-C, OOM): some layers may have advanced their write
            # position and others not. What the cache held before is untouched (writes land
            # at or past `start`), so moving every layer back to `start` makes it whole.
            self._set_length(start)
            raise
        self._tokens.extend(token_ids)
        if not all_logits:
            logits = logits[-1:]
        self.forward_seconds += time.perf_counter() - started
        return logits

    def forward_tree(
        self, token_ids: Sequence[int], positions: Sequence[int], visible: torch.Tensor, window_start: int
    ) -> torch.Tensor:
        """Tree passes replay a graph per fed size too; theirs reads the mask from a static
        buffer (a tree's mask does not follow from its positions, as a chain's does)."""
        check_tree_pass(token_ids, positions)
        token_ids, positions = list(token_ids), list(positions)
        n, start = len(token_ids), len(self._tokens)
        started = time.perf_counter()
        self.reserve(start + n)
        self._hidden_parts = []
        try:
            with torch.inference_mode():
                width = self.window(start + n)
                mask = self._tree_mask(n, start, window_start, visible, width)
                if self.graphs_enabled and n <= self.max_fed:
                    logits = self._replay(token_ids, positions, start, width, mask)
                else:
                    logits = self._eager_tree(token_ids, positions, mask)
        except BaseException:
            self._set_length(start)
            raise
        self._tokens.extend(token_ids)
        self.forward_seconds += time.perf_counter() - started
        return logits

    def _forget(self, length: int, extra: int) -> None:
        with torch.inference_mode():  # the cache's tensors are inference tensors
            self._move_back(extra)

    def _move_entries(self, start: int, offsets: list[int]) -> None:
        source = torch.tensor([start + o for o in offsets], dtype=torch.long, device=self._device)
        end = start + len(offsets)
        for layer in self._cache.layers:
            layer.keys[:, :, start:end].copy_(layer.keys.index_select(2, source))
            layer.values[:, :, start:end].copy_(layer.values.index_select(2, source))

    # ------------------------------------------------------------------ cache

    def reserve(self, length: int) -> None:
        """Make room for a context of `length` tokens (re-creating a larger cache, keeping
        its contents, when needed). Raises ValueError past the model's context."""
        if length <= self._capacity:
            return
        if self.max_length is not None and length > self.max_length:
            raise ValueError(f"a context of {length} tokens exceeds the model's {self.max_length}")
        grown = max(length, 2 * self._capacity)
        if self.max_length is not None:
            grown = min(grown, self.max_length)
        old = self._cache
        self._cache = self._new_cache(grown)
        self._capacity = grown
        self._drop_graphs()
        kept = len(self._tokens)
        if kept and old.layers and old.layers[0].is_initialized:
            self._initialize(self._cache)
            with torch.inference_mode():
                for new_layer, old_layer in zip(self._cache.layers, old.layers):
                    new_layer.keys[:, :, :kept].copy_(old_layer.keys[:, :, :kept])
                    new_layer.values[:, :, :kept].copy_(old_layer.values[:, :, :kept])
            self._set_length(kept)
        del old

    def _new_cache(self, capacity: int):
        from transformers import StaticCache

        return StaticCache(config=self.model.config, max_cache_len=capacity)

    def _initialize(self, cache) -> None:
        """Allocate every layer's key/value tensors now (they are otherwise allocated by
        the first update) by one eager pass over a throwaway token, then forget it."""
        if cache.layers[0].is_initialized:
            return
        ids = torch.zeros((1, 1), dtype=torch.long, device=self._device)
        positions = torch.zeros((1, 1), dtype=torch.long, device=self._device)
        with torch.inference_mode():
            self._run(cache, ids, positions, all_logits=False, width=cache.layers[0].max_cache_len)
        self._set_length(0, cache)

    def _lengths(self, cache=None) -> list[torch.Tensor]:
        cache = cache if cache is not None else self._cache
        return [layer.cumulative_length for layer in cache.layers]

    def _move_back(self, extra: int) -> None:
        lengths = self._lengths()
        if lengths and lengths[0].device.type != "cpu":
            try:
                torch._foreach_sub_(lengths, extra)  # one fused launch for all layers, no sync
                return
            except RuntimeError:  # a torch without integer foreach kernels here
                pass
        for length in lengths:
            length.sub_(extra)

    def _set_length(self, length: int, cache=None) -> None:
        with torch.inference_mode():
            for tensor in self._lengths(cache):
                tensor.fill_(length)

    # ------------------------------------------------------------------ passes

    def _mask(self, positions: torch.Tensor, width: int) -> torch.Tensor:
        """[1, 1, n, width] additive mask: query i sees slots 0 .. positions[i]."""
        slots = torch.arange(width, device=positions.device)
        visible = slots[None, None, None, :] <= positions[:, None, :, None]
        zero = torch.zeros((), dtype=self._mask_dtype, device=positions.device)
        hidden = torch.full((), torch.finfo(self._mask_dtype).min, dtype=self._mask_dtype, device=positions.device)
        return torch.where(visible, zero, hidden)

    def _run(
        self,
        cache,
        ids: torch.Tensor,
        positions: torch.Tensor,
        all_logits: bool,
        width: int,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One model pass writing at the cache's write position, attending over the first
        `width` slots (`mask`, [1, 1, n, width], or a causal one); logits [1, n or 1, V].
        Compiled (with `compile`) for up to `max_fed` tokens; prompts' chunks run eagerly."""
        mask = self._mask(positions, width) if mask is None else mask
        kwargs: dict[str, Any] = {
            self._cache_kwarg: cache,
            "use_cache": True,
            "position_ids": positions,
            "attention_mask": pack_mask(mask, self._groups),
        }
        if self._supports_logits_to_keep:
            kwargs["logits_to_keep"] = 0 if all_logits else 1
        if self.compile_enabled and ids.shape[1] <= self.max_fed:
            try:
                return self._compiled_pass(ids, kwargs, all_logits)
            except Exception as error:  # noqa: BLE001 - dynamo/inductor fail before running: run eagerly
                self.compile_error = f"{type(error).__name__}: {error}"
                self.compile_enabled = False
        return self.model(input_ids=ids, **kwargs).logits

    def _compiled_pass(self, ids: torch.Tensor, kwargs: dict[str, Any], all_logits: bool) -> torch.Tensor:
        """The pass through the compiled model. It always scores every token fed (a handful:
        the output layer's weights are read once either way), so that `logits_to_keep` does
        not double the compiles; a compile outside a graph capture (on the CPU) counts as
        setup, not as the pass's cost."""
        from torch._dynamo.utils import counters

        if self._supports_logits_to_keep:
            kwargs["logits_to_keep"] = 0
        compiles, began = counters["frames"]["total"], time.perf_counter()
        logits = self._compiled_model()(input_ids=ids, **kwargs).logits
        if counters["frames"]["total"] != compiles and not self._capturing:
            self.setup_seconds += time.perf_counter() - began
        return logits if all_logits else logits[:, -1:]

    def _compiled_model(self):
        if self._compiled is None:
            import torch._dynamo

            # A compile per (fed size, window, chain or tree) at worst, before automatic
            # dynamic shapes cover the sizes: more than dynamo's default of 8.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self._compiled = torch.compile(self.model, dynamic=None, fullgraph=False)
        return self._compiled

    def _chain_passes(self, steps: int, width: int, picker: ChainPicker) -> Picks:
        """A chain's picks and its steps - 1 one-token passes, on the device only (`pick_chain`)."""
        logits, first = self._chain_logits, self._chain_start
        assert logits is not None and first is not None, "chain() fills the chain's inputs first"

        def feed(token: torch.Tensor, index: int) -> torch.Tensor:
            positions = first + index
            return self._run(self._cache, token.view(1, 1), positions, all_logits=False, width=width)[0, -1].float()

        return pick_chain(logits, steps, picker, feed)

    def _eager_chunks(self, token_ids: list[int], start: int, all_logits: bool) -> torch.Tensor:
        rows: list[torch.Tensor] = []
        for offset in range(0, len(token_ids), self.prefill_chunk):
            chunk = token_ids[offset : offset + self.prefill_chunk]
            last = offset + len(chunk) >= len(token_ids)
            ids = torch.tensor([chunk], dtype=torch.long, device=self._device)
            first = start + offset
            positions = torch.arange(first, first + len(chunk), device=self._device).unsqueeze(0)
            width = self.window(first + len(chunk))
            logits = self._run(self._cache, ids, positions, all_logits or not last, width)
            if all_logits:
                rows.append(logits[0].float())
            elif last:
                rows.append(logits[0, -1:].float())
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def _eager_tree(self, token_ids: list[int], positions: list[int], mask: torch.Tensor) -> torch.Tensor:
        ids = torch.tensor([token_ids], dtype=torch.long, device=self._device)
        where = torch.tensor([positions], dtype=torch.long, device=self._device)
        return self._run(self._cache, ids, where, all_logits=True, width=mask.shape[-1], mask=mask)[0].float()

    # ------------------------------------------------------------------ CUDA graphs

    def _drop_graphs(self) -> None:
        self._graphs.clear()
        self._chain_graphs.clear()
        self._pool = None
        self._ids_buffer = None
        self._positions_buffer = None
        self._mask_buffer = None

    def _replay(
        self, token_ids: list[int], positions: list[int], start: int, width: int, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Replay the graph of this fed size and window (a chain's, or with `mask` a tree's),
        captured on first use."""
        n = len(token_ids)
        ids, where = self._ids_buffer, self._positions_buffer
        if ids is None or where is None:
            ids = self._ids_buffer = torch.zeros((1, self.max_fed), dtype=torch.long, device=self._device)
            where = self._positions_buffer = torch.zeros((1, self.max_fed), dtype=torch.long, device=self._device)
        # One host-to-device copy of ids and positions together.
        host = torch.tensor([token_ids, positions], dtype=torch.long)
        staged = host.to(self._device, non_blocking=True)
        fed_ids, fed_positions = ids[:, :n], where[:, :n]
        fed_ids.copy_(staged[0:1])
        fed_positions.copy_(staged[1:2])
        fed_mask = None
        if mask is not None:
            if self._mask_buffer is None:
                self._mask_buffer = torch.zeros(
                    (1, 1, self.max_fed, self._capacity), dtype=self._mask_dtype, device=self._device
                )
            fed_mask = self._mask_buffer[:, :, :n, :width]
            fed_mask.copy_(mask)
        key = (n, mask is not None, width)
        captured = self._graphs.get(key)
        if captured is None:
            captured = self._captured_once(lambda: self._capture(fed_ids, fed_positions, start, width, fed_mask), start)
            if captured is None:  # the pass itself, eagerly: a cost of the step, not setup
                if mask is not None:
                    return self._eager_tree(token_ids, positions, mask)
                return self._eager_chunks(token_ids, start, all_logits=True)
        graph, output, hidden = captured
        with torch.cuda.device(self._device):
            graph.replay()
        # The output buffers are overwritten by the next replay: copy them out.
        self._hidden_parts = [] if hidden is None else [hidden.clone()]
        return output[0].to(torch.float32, copy=True)

    def _replay_chain(self, steps: int, width: int, picker: ChainPicker, start: int) -> Picks:
        """Replay the chain's graph (captured on first use); its outputs copied out."""
        key = (steps, width, picker.key)
        captured = self._chain_graphs.get(key)
        if captured is None:
            captured = self._captured_once(lambda: self._capture_chain(key, steps, width, picker, start), start)
            if captured is None:
                return self._chain_passes(steps, width, picker)
        graph, outputs = captured
        with torch.cuda.device(self._device):
            graph.replay()
        tokens, confidence, probs = outputs
        return tokens.clone(), confidence.clone(), None if probs is None else probs.clone()

    def _capture(
        self, ids: torch.Tensor, positions: torch.Tensor, start: int, width: int, mask: torch.Tensor | None
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]:
        """Capture one pass of the tokens in `ids` (see `_recorded`), reading these views of the
        static input buffers: ids and positions [1, n], a tree pass's mask [1, 1, n, width]."""

        def one_pass() -> torch.Tensor:
            self._hidden_parts = []
            return self._run(self._cache, ids, positions, all_logits=True, width=width, mask=mask)

        graph, output = self._recorded(one_pass, start)
        # The hook saw the graph's own hidden-states tensor: replays refill it in place.
        hidden = self._hidden_parts[-1] if self._hidden_parts else None
        self._graphs[(ids.shape[1], mask is not None, width)] = (graph, output, hidden)
        return graph, output, hidden

    def _capture_chain(
        self, key: tuple[int, int, Hashable], steps: int, width: int, picker: ChainPicker, start: int
    ) -> tuple[torch.cuda.CUDAGraph, Picks]:
        """Capture a whole chain, as `_capture` does one pass."""
        graph, outputs = self._recorded(lambda: self._chain_passes(steps, width, picker), start)
        self._chain_graphs[key] = (graph, outputs)
        return graph, outputs

    def _captured_once(self, capture: Callable[[], T], start: int) -> T | None:
        """`capture()` on the model's device (not the current one), its time counted as setup;
        None when it fails, and every pass runs eagerly from then on (`graphs_error` says why)."""
        began = time.perf_counter()
        try:
            self._capturing = True
            with torch.cuda.device(self._device):
                return capture()
        except Exception as error:  # noqa: BLE001 - any capture failure: run eagerly from now on
            self.graphs_error = f"{type(error).__name__}: {error}"
            self.graphs_enabled = False
            self._drop_graphs()
            self._set_length(start)
            self._hidden_parts = []
            return None
        finally:
            self._capturing = False
            self.setup_seconds += time.perf_counter() - began

    def _recorded(self, work: Callable[[], T], start: int) -> tuple[torch.cuda.CUDAGraph, T]:
        """`work` (passes writing at the cache's write position) as a CUDA graph in the shared
        pool, and the outputs it replays into. Two warm-ups on a side stream first (lazy
        initialisations, cuBLAS handles, autotuning), as PyTorch documents. They and the
        capture write past the cached tokens (harmless) and advance the write position, which
        is put back to `start` after each: capturing records the passes without running them,
        and a replay runs them from `start`."""
        self._initialize(self._cache)
        stream = torch.cuda.Stream(device=self._device)
        stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._set_length(start)
                work()
        torch.cuda.current_stream(self._device).wait_stream(stream)
        self._set_length(start)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = work()
        self._set_length(start)
        torch.cuda.synchronize(self._device)  # the warm-up passes count as setup, not as the next pass
        return graph, outputs
