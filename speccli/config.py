"""Typed settings shared by the CLI and the engine."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path


@dataclass(frozen=True)
class SamplingConfig:
    """How a token is chosen from a distribution. temperature 0 means greedy.

    The same warp (temperature, then top-k, then top-p) is applied to the target's
    and the draft's logits, which is what keeps speculative sampling lossless.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.seed is not None and not -(1 << 63) <= self.seed < 1 << 64:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if not 0.0 < self.top_p <= 1.0:  # NaN too
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def nth(self, n: int) -> SamplingConfig:
        """The config of the n-th of several generations: with a seed, seed + n (a series
        replays exactly, and each generation gets its own sample); without one, this."""
        return self if self.seed is None else replace(self, seed=self.seed + n)


AUTO_K = "auto"


def parse_draft_length(text: str) -> int | str:
    """'auto' or a whole number >= 1 (the --k option and /set k)."""
    value = text.strip().lower()
    if value == AUTO_K:
        return AUTO_K
    try:
        k = int(value)
    except ValueError:
        k = 0
    if k < 1:
        raise ValueError(f"k must be a whole number >= 1 or auto, got {text!r}")
    return k


@dataclass(frozen=True)
class SpecConfig:
    """What one generation may do: how many tokens to draft, when to stop.

    k is a fixed draft length, or "auto": each step picks the k (0 .. max_k) that
    maximises expected tokens per second from the acceptance and costs measured so far.
    max_k is also how far `auto` calibrates (passes over 1 .. max_k + 1 tokens); where the
    measured curve stops paying for longer drafts, `auto` stops short of it by itself.
    tree: draft a tree of candidates k deep (speccli.tree) instead of one chain, its size
    chosen from the measured pass costs (True), one chain (False), or under k auto whichever
    of the two has measured the faster on this machine and text (None, "auto"; a fixed k then
    drafts chains).
    """

    k: int | str = 4
    max_new_tokens: int = 256
    stop_strings: tuple[str, ...] = field(default_factory=tuple)
    max_k: int = 16
    tree: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.k, str):
            if self.k != AUTO_K:
                raise ValueError(f"k (draft length) must be a number or {AUTO_K!r}, got {self.k!r}")
        elif self.k < 0:
            raise ValueError(f"k (draft length) must be >= 0, got {self.k}")
        if self.max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {self.max_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if any(not s for s in self.stop_strings):
            raise ValueError("stop strings must not be empty")


DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTS = ("auto", "4bit", "nf4", "8bit", "int8", "int4", "fp8", "none")
CPU_LINEAR = ("auto", "stock")
CUDA_GRAPHS = ("auto", "off")
COMPILE = ("auto", "on", "off")
BACKENDS = ("auto", "transformers", "llama.cpp")


@dataclass(frozen=True)
class LoadConfig:
    """Where and in what precision one model is loaded.

    device: auto (CUDA when available), cpu, cuda or cuda:N.
    dtype: auto picks what runs fastest where the model runs; else the weights' dtype.
    quant: auto means bitsandbytes NF4 4-bit on CUDA; on the CPU, none for a target and
    PyTorch's dynamic int8 for a draft (`for_draft`), whose speed is what matters there.
    cpu_linear: auto runs float32 linear layers on the CPU through oneDNN, and bfloat16
    one-row products as two rows where that is measured faster (see
    speccli.models.kernels.onednn); stock keeps PyTorch's default kernels.
    cuda_graphs: auto runs a model on CUDA in bfloat16/float16 or bitsandbytes 4/8-bit over a
    static KV cache replayed as CUDA graphs (speccli.backends.static); off, and every
    model on the CPU, keeps transformers' DynamicCache (speccli.backends.hf.HFCausalLM).
    backend: auto runs a GGUF file on the CPU through llama.cpp when llama-cpp-python is
    installed (speccli.backends.llamacpp), everything else through transformers.
    tp: the target split over this many tensor-parallel ranks (speccli.backends.distributed).
    compile: on runs the static-cache backend's passes through torch.compile (and puts a model
    on the CPU on that backend too); auto stays off until the GPU check measures it faster
    (scripts/gpu_check.py); off.
    keep_converted: a GGUF file's first load through transformers keeps the dequantized
    weights in specgen's cache and later loads read them (speccli.models.formats.converted); off
    (`--no-cache`), neither read nor written.
    """

    device: str = "auto"
    dtype: str = "auto"
    quant: str = "auto"
    trust_remote_code: bool = False
    for_draft: bool = False
    cpu_linear: str = "auto"
    cuda_graphs: str = "auto"
    backend: str = "auto"
    keep_converted: bool = True
    compile: str = "auto"
    tp: int = 1

    def __post_init__(self) -> None:
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be one of {', '.join(DEVICES)} or cuda:N, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quant not in QUANTS:
            raise ValueError(f"quant must be one of {', '.join(QUANTS)}, got {self.quant!r}")
        if self.cpu_linear not in CPU_LINEAR:
            raise ValueError(f"cpu_linear must be one of {', '.join(CPU_LINEAR)}, got {self.cpu_linear!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.cuda_graphs not in CUDA_GRAPHS:
            raise ValueError(f"cuda_graphs must be one of {', '.join(CUDA_GRAPHS)}, got {self.cuda_graphs!r}")
        if self.tp < 1:
            raise ValueError(f"tp must be 1 or more, got {self.tp}")
        if self.compile not in COMPILE:
            raise ValueError(f"compile must be one of {', '.join(COMPILE)}, got {self.compile!r}")


def default_cache_dir() -> Path:
    """specgen's cache: ``$SPECGEN_CACHE``, else ``$XDG_CACHE_HOME/specgen``, else ``~/.cache/specgen``."""
    env = os.environ.get("SPECGEN_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    # The XDG spec says relative values are invalid and must be ignored.
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "specgen"
    return Path.home() / ".cache" / "specgen"
