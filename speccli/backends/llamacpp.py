"""A CausalLM over llama.cpp (llama-cpp-python's low-level API): GGUF files run at
llama.cpp's own speed on the CPU.

One `llama_decode` per verification returns logits for every fed position; a rollback
removes cells from llama.cpp's KV cache (`llama_memory_seq_rm`), so nothing is prefilled
again.

Token trees use llama.cpp's sequences, as its own tree speculation does. The context is
sequence 0. Each leaf of a tree pass gets a sequence of its own. Every node is tagged
with the sequences of the leaves below it, so a sequence holds exactly one root-to-leaf
path. llama.cpp masks a token by its first sequence with causal positions, so a node
sees the context, its ancestors and itself. Before the pass, each leaf's sequence is
given the context and the earlier passes' nodes its leaf may see (`llama_memory_seq_cp`:
the cells gain a tag; no data moves). `keep` tags the kept path as sequence 0 and drops
every other tag.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Iterator, Sequence

import numpy as np
import torch

from speccli.backends.base import Chain, ChainPicker, check_kept_offsets, check_tree_pass

INSTALL_HINT = 'install it: pip install "specgen[llamacpp]"   (builds llama.cpp from source; see README)'
# Sequence ids a context accepts (llama.cpp allows up to 256): the leaves of one tree
# window, plus the context's own. Each costs a row of logits in llama.cpp's output buffer.
MAX_SEQUENCES = 64
DEFAULT_CONTEXT = 8192
DEFAULT_BATCH = 512
# llama.cpp's CPU flash attention accumulates in float16 and makes passes over many tokens
# dearer on the CPU; one-token passes cost the same either way (measured: BENCHMARKS.md,
# section "Levers tried and not kept").
FLASH_ATTENTION = 0  # LLAMA_FLASH_ATTN_TYPE_DISABLED


class LlamaCppError(RuntimeError):
    """llama.cpp refused a model, a context or a batch; the message carries its own log lines."""


def llama_cpp_problem() -> str | None:
    """Why llama-cpp-python cannot be used here, or None when it can."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        return f"llama-cpp-python is not installed ({exc})"
    except OSError as exc:  # the shared library is present but does not load
        return f"llama-cpp-python's library does not load ({exc})"
    return None


def llama_cpp_version() -> str:
    import llama_cpp

    return getattr(llama_cpp, "__version__", "unknown")


def default_threads() -> int:
    """The cores this process may run on (llama.cpp's own default is a fixed 4)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


GGML_LOG_LEVEL_DEBUG = 1


class _Log:
    """llama.cpp's log, kept instead of printed: the last lines explain a failure."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._lock = threading.Lock()

    def record(self, level: int, text: bytes | None, user_data) -> None:
        if not text or level == GGML_LOG_LEVEL_DEBUG:
            return
        with self._lock:
            self.lines.append(text.decode("utf-8", "replace"))
            del self.lines[:-200]

    def tail(self, count: int = 6) -> str:
        with self._lock:
            text = "".join(self.lines).strip().splitlines()
        return " | ".join(line.strip() for line in text[-count:] if line.strip())


_LOG = _Log()
_CALLBACK = None  # the ctypes callback must outlive every call into llama.cpp
_READY = False


def _backend():
    """llama_cpp, initialised once, its log routed to _LOG."""
    global _CALLBACK, _READY
    import llama_cpp

    if not _READY:
        _CALLBACK = llama_cpp.llama_log_callback(_LOG.record)
        llama_cpp.llama_log_set(_CALLBACK, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        _READY = True
    return llama_cpp


@dataclass
class LlamaCppWeights:
    """A GGUF file loaded by llama.cpp (weights memory-mapped, no context yet)."""

    path: Path
    pointer: object  # llama_model_p
    description: str  # llama.cpp's own, e.g. "qwen2 1.5B Q4_K - Medium"
    n_vocab: int
    n_ctx_train: int
    threads: int  # the threads its contexts decode with
    extra_buffers: bool = True  # weights repacked for this CPU's own kernels (see llamacpp_check)

    @classmethod
    def load(
        cls,
        path: Path | str,
        threads: int | None = None,
        extra_buffers: bool = True,
    ) -> "LlamaCppWeights":
        """Load `path`; `extra_buffers`: repack the weights for this CPU's own kernels
        (speccli.models.kernels.llamacpp_check tells whether they run here)."""
        lc = _backend()
        path = Path(path)
        params = lc.llama_model_default_params()
        params.n_gpu_layers = 0
        params.use_extra_bufts = extra_buffers
        pointer = lc.llama_model_load_from_file(str(path).encode(), params)
        if not pointer:
            raise LlamaCppError(f"llama.cpp could not load {path}: {_LOG.tail() or 'no reason given'}")
        buffer = ctypes.create_string_buffer(256)
        lc.llama_model_desc(pointer, buffer, len(buffer))
        vocab = lc.llama_model_get_vocab(pointer)
        return cls(
            path=path,
            pointer=pointer,
            description=buffer.value.decode("utf-8", "replace"),
            n_vocab=int(lc.llama_vocab_n_tokens(vocab)),
            n_ctx_train=int(lc.llama_model_n_ctx_train(pointer)),
            threads=threads or default_threads(),
            extra_buffers=extra_buffers,
        )

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        """llama.cpp's own tokenization of `text` (no BOS added; special tokens parsed)."""
        lc = _backend()
        vocab = lc.llama_model_get_vocab(self.pointer)
        raw = text.encode("utf-8")
        room = len(raw) + 16
        ids = (lc.llama_token * room)()
        count = lc.llama_tokenize(vocab, raw, len(raw), ids, room, False, special)
        if count < 0:
            room = -count
            ids = (lc.llama_token * room)()
            count = lc.llama_tokenize(vocab, raw, len(raw), ids, room, False, special)
        return list(ids[:count])


@dataclass
class _TreeEntry:
    position: int
    sequence: int  # a sequence whose cell at `position` is this entry (its first tag)
    seen: frozenset[int]  # the window entries it sees (indices into the entries), itself included


class LlamaCppLM:
    """A llama.cpp context over loaded weights, at batch size 1 (see the module's doc)."""

    setup_seconds = 0.0  # no one-time setup inside passes

    def __init__(
        self,
        weights: LlamaCppWeights,
        n_ctx: int | None = None,
        threads: int | None = None,
        n_batch: int = DEFAULT_BATCH,
    ) -> None:
        if n_batch < MAX_SEQUENCES:
            raise ValueError(
                f"n_batch must be at least {MAX_SEQUENCES} (llama.cpp reserves an output row per sequence)"
            )
        lc = _backend()
        self._lc = lc
        self.weights = weights
        self.threads = threads or weights.threads
        params = lc.llama_context_default_params()
        params.n_ctx = n_ctx or min(weights.n_ctx_train or DEFAULT_CONTEXT, DEFAULT_CONTEXT)
        params.n_batch = n_batch
        params.n_ubatch = n_batch
        params.n_seq_max = MAX_SEQUENCES
        params.kv_unified = True  # one cache whose cells several sequences share: trees need it
        params.n_threads = self.threads
        params.n_threads_batch = self.threads
        params.no_perf = True
        params.flash_attn_type = FLASH_ATTENTION
        self._ctx = lc.llama_init_from_model(weights.pointer, params)
        if not self._ctx:
            raise LlamaCppError(
                f"llama.cpp could not make a context for {weights.path}: {_LOG.tail() or 'no reason given'}"
            )
        self._memory = lc.llama_get_memory(self._ctx)
        self._n_ctx = int(lc.llama_n_ctx(self._ctx))
        self._n_batch = n_batch
        self._batch = lc.llama_batch_init(n_batch, 0, MAX_SEQUENCES)
        self._vocab_size = weights.n_vocab
        self._tokens: list[int] = []
        self._window_start: int | None = None  # where tree entries start, while any are cached
        self._entries: list[_TreeEntry] = []  # the tree entries, in fed order
        self._next_sequence = 1
        self.forward_seconds = 0.0

    @property
    def context(self):
        """llama.cpp's context (a ctypes pointer), for scripts that time its own calls."""
        return self._ctx

    # ------------------------------------------------------------------ CausalLM

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def cached_tokens(self) -> Sequence[int]:
        return self._tokens

    @property
    def max_length(self) -> int | None:
        return self._n_ctx

    @property
    def chains(self) -> bool:
        """Draft chains are driven from the host, a pass per token."""
        return False

    def chain(self, logits: torch.Tensor, steps: int, picker: ChainPicker) -> Chain:
        raise NotImplementedError("llama.cpp runs no draft chains on the device (its `chains` is False)")

    def forward(self, token_ids: Sequence[int], all_logits: bool = True) -> torch.Tensor:
        if not token_ids:
            raise ValueError("forward() needs at least one token")
        if self._window_start is not None:
            raise RuntimeError("forward() while tree entries are cached: keep() or rollback() them first")
        started = time.perf_counter()
        start = len(self._tokens)
        rows: list[torch.Tensor] = []
        with self._whole_or_nothing():
            for chunk in range(0, len(token_ids), self._n_batch):
                part = list(token_ids[chunk : chunk + self._n_batch])
                last_chunk = chunk + self._n_batch >= len(token_ids)
                wanted = [all_logits or (last_chunk and i == len(part) - 1) for i in range(len(part))]
                positions = [start + chunk + i for i in range(len(part))]
                rows.append(self._decode(part, positions, [(0,)] * len(part), wanted))
                self._tokens.extend(part)
        self.forward_seconds += time.perf_counter() - started
        return torch.cat(rows) if len(rows) > 1 else rows[0]

    def rollback(self, length: int) -> None:
        if length < 0:
            raise ValueError(f"cannot roll back to a negative length ({length})")
        if length >= len(self._tokens):
            return
        if self._window_start is not None:
            if length > self._window_start:
                self.keep(self._window_start, range(length - self._window_start))
                return
            self._close_window()
        if not self._lc.llama_memory_seq_rm(self._memory, 0, length, -1):
            raise LlamaCppError(f"llama.cpp could not remove cache cells past {length}")
        del self._tokens[length:]

    def forward_tree(
        self, token_ids: Sequence[int], positions: Sequence[int], visible: torch.Tensor, window_start: int
    ) -> torch.Tensor:
        check_tree_pass(token_ids, positions)
        n, cached = len(token_ids), len(self._tokens)
        opening = self._window_start is None
        if opening and window_start != cached:
            raise ValueError(f"a tree window must start at the cache's end ({cached}), not {window_start}")
        if not opening and window_start != self._window_start:
            raise ValueError(f"this cache's tree window starts at {self._window_start}, not {window_start}")
        window = cached - window_start
        if tuple(visible.shape) != (n, window + n):
            raise ValueError(f"visible must be [{n}, {window + n}], got {list(visible.shape)}")
        started = time.perf_counter()
        plan = _plan_tree(visible.cpu().bool(), self._entries, list(positions), window_start)
        first = self._next_sequence
        if first + plan.leaves > MAX_SEQUENCES:
            raise ValueError(
                f"a tree window holds at most {MAX_SEQUENCES - 1} leaves; this pass needs {first - 1 + plan.leaves}"
            )
        self._next_sequence += plan.leaves
        self._window_start = window_start
        lc = self._lc
        for leaf, seen_entries in enumerate(plan.leaf_sees):
            sequence = first + leaf
            lc.llama_memory_seq_cp(self._memory, 0, sequence, 0, window_start)
            for entry in seen_entries:
                old = self._entries[entry]
                lc.llama_memory_seq_cp(self._memory, old.sequence, sequence, old.position, old.position + 1)
        tags = [tuple(first + leaf for leaf in leaves) for leaves in plan.node_leaves]
        with self._whole_or_nothing():
            logits = self._decode(list(token_ids), list(positions), tags, [True] * n)
            self._tokens.extend(token_ids)
            self._entries += [_TreeEntry(p, tag[0], seen) for p, tag, seen in zip(positions, tags, plan.seen)]
        self.forward_seconds += time.perf_counter() - started
        return logits

    def keep(self, start: int, offsets: Sequence[int]) -> None:
        offsets = list(offsets)
        check_kept_offsets(start, offsets, len(self._tokens))
        if self._window_start is None:
            if any(i != o for i, o in enumerate(offsets)):
                raise ValueError("outside a tree window only a prefix can be kept")
            self.rollback(start + len(offsets))
            return
        if start < self._window_start:
            raise ValueError(f"cannot keep past {start}: tree entries start at {self._window_start}")
        # The entries between the window start and `start`, then the kept ones: a path from
        # the window start, each one position past the one before and seeing it.
        path = list(range(start - self._window_start)) + [start - self._window_start + o for o in offsets]
        for index, entry_index in enumerate(path):
            entry = self._entries[entry_index]
            if entry.position != self._window_start + index:
                raise ValueError(
                    f"kept entries must lie at consecutive positions: entry {self._window_start + entry_index} is at"
                    f" {entry.position}, not {self._window_start + index}"
                )
            if index and path[index - 1] not in entry.seen:
                raise ValueError(f"kept entry {self._window_start + entry_index} does not follow the one before it")
        tokens = [self._tokens[self._window_start + i] for i in path]
        for entry_index in path:
            entry = self._entries[entry_index]
            self._lc.llama_memory_seq_cp(self._memory, entry.sequence, 0, entry.position, entry.position + 1)
        self._close_window()
        self._tokens.extend(tokens)

    def greedy_batch(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop: Collection[int]
    ) -> list[list[int]]:
        """Greedy continuations of several prompts at once (at most MAX_SEQUENCES), each
        its own sequence in the cache, one token of every unfinished one per pass: on a CPU
        a pass over 16 tokens costs a fraction of 16 one-token passes. A continuation ends
        before a `stop` token or at `max_new_tokens`. Not for speculative decoding: the
        cache is cleared before and after. Rows of a batched pass may round differently
        from a lone one's, so near-ties can go the other way than in `forward`."""
        if len(prompts) > MAX_SEQUENCES:
            raise ValueError(f"at most {MAX_SEQUENCES} prompts at once, got {len(prompts)}")
        if any(not prompt for prompt in prompts):
            raise ValueError("every prompt needs at least one token")
        needed = sum(len(prompt) + max_new_tokens for prompt in prompts)
        if needed > self._n_ctx:
            raise LlamaCppError(f"the context is full: {needed} positions asked for, {self._n_ctx} held")
        started = time.perf_counter()
        self._reset()
        outputs: list[list[int]] = [[] for _ in prompts]
        try:
            entries = [
                (token, position, s) for s, prompt in enumerate(prompts) for position, token in enumerate(prompt)
            ]
            last = {(s, len(prompt) - 1) for s, prompt in enumerate(prompts)}
            rows: list[torch.Tensor] = []
            for chunk in range(0, len(entries), self._n_batch):
                part = entries[chunk : chunk + self._n_batch]
                rows.append(
                    self._decode(
                        [t for t, _, _ in part],
                        [p for _, p, _ in part],
                        [(s,) for _, _, s in part],
                        [(s, p) in last for _, p, s in part],
                    )
                )
            logits = torch.cat(rows)  # one row per prompt, in order
            live = list(range(len(prompts)))
            while live and max_new_tokens > 0:
                chosen = logits.argmax(-1).tolist()
                still: list[int] = []
                for sequence, token in zip(live, chosen):
                    if token in stop:
                        continue
                    outputs[sequence].append(token)
                    if len(outputs[sequence]) < max_new_tokens:
                        still.append(sequence)
                live = still
                if live:
                    positions = [len(prompts[s]) + len(outputs[s]) - 1 for s in live]
                    logits = self._decode(
                        [outputs[s][-1] for s in live], positions, [(s,) for s in live], [True] * len(live)
                    )
        finally:
            self._reset()
            self.forward_seconds += time.perf_counter() - started
        return outputs

    # ------------------------------------------------------------------ internals

    def _close_window(self) -> None:
        """Drop every tree tag (cells only sequence 0 also holds survive), and the entries' tokens."""
        if self._window_start is None:
            return
        for sequence in range(1, self._next_sequence):
            self._lc.llama_memory_seq_rm(self._memory, sequence, -1, -1)
        del self._tokens[self._window_start :]
        self._window_start = None
        self._entries = []
        self._next_sequence = 1

    def _decode(
        self, tokens: list[int], positions: list[int], tags: list[tuple[int, ...]], wanted: list[bool]
    ) -> torch.Tensor:
        """One llama_decode; the float32 logits [outputs, V] of the wanted rows, in order."""
        n = len(tokens)
        if n > self._n_batch:
            raise ValueError(f"at most {self._n_batch} tokens fit one llama.cpp batch, got {n}")
        if positions and max(positions) >= self._n_ctx:
            raise LlamaCppError(f"the context is full: {self._n_ctx} positions (position {max(positions)} asked for)")
        batch = self._batch
        batch.n_tokens = n
        for i, (token, position, tag, want) in enumerate(zip(tokens, positions, tags, wanted)):
            batch.token[i] = token
            batch.pos[i] = position
            batch.n_seq_id[i] = len(tag)
            row = batch.seq_id[i]
            for s, sequence in enumerate(tag):
                row[s] = sequence
            batch.logits[i] = want
        status = self._lc.llama_decode(self._ctx, batch)
        if status != 0:
            reason = _LOG.tail()
            if status == 1:
                raise LlamaCppError(f"the context is full: no room for {n} more tokens in {self._n_ctx}")
            raise LlamaCppError(f"llama_decode failed ({status}): {reason or 'no reason given'}")
        outputs = sum(wanted)
        if outputs == 0:
            return torch.empty((0, self._vocab_size))
        pointer = self._lc.llama_get_logits(self._ctx)
        logits = np.ctypeslib.as_array(pointer, shape=(outputs * self._vocab_size,))
        return torch.from_numpy(logits.reshape(outputs, self._vocab_size).copy())

    @contextlib.contextmanager
    def _whole_or_nothing(self) -> Iterator[None]:
        """A pass that fails or is interrupted (Ctrl-C lands between two calls into
        llama.cpp) may leave cells the token list does not know: forget everything then."""
        try:
            yield
        except BaseException:
            self._reset()
            raise

    def _reset(self) -> None:
        """Forget everything: after a failed or interrupted decode the cache is not trusted."""
        self._lc.llama_memory_clear(self._memory, True)
        self._tokens.clear()
        self._window_start = None
        self._entries = []
        self._next_sequence = 1

    def close(self) -> None:
        if self._ctx:
            self._lc.llama_batch_free(self._batch)
            self._lc.llama_free(self._ctx)
            self._ctx = None

    def __del__(self) -> None:  # contexts hold the KV cache: free it with the backend
        try:
            self.close()
        except Exception:
            pass


@dataclass
class _TreePlan:
    """How one tree pass maps onto sequences: leaves (how many), node_leaves[i] (the leaf
    numbers at or below new node i, lowest first), leaf_sees[l] (the earlier entries leaf
    l sees), seen[i] (the window entries new node i sees, itself included)."""

    leaves: int
    node_leaves: list[tuple[int, ...]]
    leaf_sees: list[list[int]]
    seen: list[frozenset[int]]


def _plan_tree(
    visible: torch.Tensor, old: Sequence["_TreeEntry"], positions: list[int], window_start: int
) -> _TreePlan:
    """Check that the pass is a forest of paths llama.cpp can express, and assign leaves.

    Row i of `visible` covers the earlier window entries, then the new ones. Each new node
    must see itself and what its parent sees: the parent being the seen entry one
    position before it, or none for a node right at the window start."""
    count = len(old)
    all_positions = [e.position for e in old] + positions
    rows = visible.tolist()
    seen: list[frozenset[int]] = []
    parent_of: list[int | None] = []
    for i, position in enumerate(positions):
        row = rows[i]
        if not row[count + i]:
            raise ValueError(f"tree node {i} must see itself")
        if any(row[count + i + 1 :]):
            raise ValueError(f"tree node {i} sees a node fed after it: parents must come first")
        above = frozenset(j for j in range(count + i) if row[j])
        seen.append(above | {count + i})
        if not above:
            if position != window_start:
                raise ValueError(
                    f"tree node {i} has no parent in the window, so it must sit at {window_start}, not {position}"
                )
            parent_of.append(None)
            continue
        parent = max(above, key=lambda j: all_positions[j])
        if all_positions[parent] != position - 1:
            raise ValueError(
                f"tree node {i} at {position} must follow its parent (at {all_positions[parent]}) directly"
            )
        if above != (old[parent].seen if parent < count else seen[parent - count]):
            raise ValueError(
                f"tree node {i} must see exactly its parent and what its parent sees: llama.cpp masks by paths"
            )
        parent_of.append(parent)
    parents = {j for j in parent_of if j is not None}
    leaves = [i for i in range(len(positions)) if count + i not in parents]
    node_leaves: list[list[int]] = [[] for _ in positions]
    for number, leaf in enumerate(leaves):
        node: int | None = count + leaf
        while node is not None and node >= count:
            node_leaves[node - count].append(number)
            node = parent_of[node - count]
    leaf_sees = [sorted(j for j in seen[leaf] if j < count) for leaf in leaves]
    return _TreePlan(len(leaves), [tuple(n) for n in node_leaves], leaf_sees, seen)
