"""Memory before loading: what a model needs on a GPU in a quantization, from its config alone.

The model is built on PyTorch's meta device (shapes, no memory), so every parameter is
counted as the architecture defines it. The linear layers inside the decoder are what the
quantizations shrink; embeddings, the output layer and norms stay in the model's dtype, as
bitsandbytes and torchao (through transformers) leave them. Bytes per quantized weight:

    none  the dtype's size        8bit  1 + a float32 scale per row (LLM.int8)
    4bit  NF4: 0.5 + an 8-bit absmax per 64 and its float32 per 256 blocks (double quant)
    int4  0.5 + a bf16 scale and zero per 128 (torchao, tinygemm)
    fp8   1 + a float32 scale per row (torchao weight-only)

The KV cache is counted at the static backend's first capacity (4,096 tokens, or the
model's context if shorter), and a working margin on top: a pass's activations and the
CUDA graphs' pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from speccli.models.errors import ModelLoadError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

GB = 1e9
KV_TOKENS = 4096
# A pass's activations, the logits of a verification and the graphs' memory pool: measured
# well under this for 7B shapes; a share of the weights on top for the largest models.
WORKING_BYTES = 1.0 * GB
WORKING_SHARE = 0.05
# What a refusal offers instead, in this order.
ALTERNATIVES = ("none", "8bit", "int4", "4bit")
# The formats `specgen plan` takes (the GPU's: no CPU int8).
QUANT_NAMES = ("none", "8bit", "4bit", "int4", "fp8")


def quantized_bytes_per_weight(quant: str, dtype: torch.dtype, in_features: int) -> float:
    """Bytes per weight of a linear layer with `in_features` columns, in `quant`."""
    if quant in ("none", "int8"):  # int8 is the CPU's; on a GPU a model is never int8
        return torch.finfo(dtype).bits / 8
    if quant == "4bit":
        return 0.5 + 1 / 64 + 4 / (64 * 256)
    if quant == "int4":
        return 0.5 + 4 / 128
    if quant in ("8bit", "fp8"):
        return 1.0 + 4 / in_features
    raise ValueError(f"no size known for quantization {quant!r}")


@dataclass(frozen=True)
class MemoryNeed:
    """What one model needs on its device, in bytes."""

    weights: float
    kv_cache: float
    working: float

    @property
    def total(self) -> float:
        return self.weights + self.kv_cache + self.working


def meta_model(config) -> PreTrainedModel:
    """The architecture `config` describes, on the meta device (no memory, no weights)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def memory_need(
    model: PreTrainedModel, quant: str, dtype: torch.dtype, kv_tokens: int = KV_TOKENS, tp: int = 1
) -> MemoryNeed:
    """What `model` (a meta model will do) needs in `quant` and `dtype`, on each of `tp` GPUs
    under tensor parallelism (matrices and key/value heads split between them, vectors such
    as norms on each)."""
    head = model.get_output_embeddings()
    size = torch.finfo(dtype).bits / 8
    weights = 0.0
    counted: set[int] = set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in counted:  # tied embeddings count once
                continue
            counted.add(id(param))
            share = 1 / tp if param.dim() >= 2 else 1.0
            if isinstance(module, torch.nn.Linear) and module is not head and name == "weight":
                weights += share * param.numel() * quantized_bytes_per_weight(quant, dtype, module.in_features)
            else:
                weights += share * param.numel() * size
    config = model.config
    heads = getattr(config, "num_attention_heads", 1)
    head_dim = getattr(config, "head_dim", None) or getattr(config, "hidden_size", 0) // max(1, heads)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    context = min(kv_tokens, getattr(config, "max_position_embeddings", None) or kv_tokens)
    layers = getattr(config, "num_hidden_layers", 0)
    kv_cache = 2.0 * layers * -(-kv_heads // tp) * head_dim * context * size
    return MemoryNeed(weights, kv_cache, WORKING_BYTES + WORKING_SHARE * weights)


def check_fits(
    name: str, need: MemoryNeed, quant: str, free: float, device: str, alternatives: dict[str, MemoryNeed]
) -> None:
    """Raise ModelLoadError (before anything is downloaded or allocated) when `need` exceeds
    `free` bytes, naming the quantizations in `alternatives` that would fit."""
    if need.total <= free:
        return
    fitting = [
        f"--quant {q} ({n.total / GB:.1f} GB)" for q, n in alternatives.items() if n.total <= free and q != quant
    ]
    raise ModelLoadError(
        f"{name} in {quant} needs {need.total / GB:.1f} GB on {device} ({need.weights / GB:.1f} GB of weights, "
        f"{need.kv_cache / GB:.1f} GB of KV cache for {KV_TOKENS:,} tokens, {need.working / GB:.1f} GB working), "
        f"and {free / GB:.1f} GB is free",
        hint=("use " + " or ".join(fitting)) if fitting else "use a smaller model, or free memory on that GPU",
    )


def check_pair_fits(
    target: str, target_need: MemoryNeed, draft: str, draft_need: MemoryNeed, free: float, device: str
) -> None:
    """Target and draft on one device: raise ModelLoadError when together they need more than
    `free` bytes (each alone was checked as it was named)."""
    total = target_need.total + draft_need.total
    if total <= free:
        return
    raise ModelLoadError(
        f"{target} ({target_need.total / GB:.1f} GB) and {draft} ({draft_need.total / GB:.1f} GB) need "
        f"{total / GB:.1f} GB together on {device}, and {free / GB:.1f} GB is free",
        hint="quantize further (--quant, --draft-quant), use a smaller draft, or --draft-device cpu",
    )


TP_SIZES = (1, 2, 4, 8)
SMALLER = ("8bit", "int4", "4bit")  # what a plan offers instead, least compressed first


@dataclass(frozen=True)
class PairPlan:
    """A target over `tp` GPUs and a draft on the first of them (rank 0), against GPUs of
    `gpu_bytes` each (None: not known, figures only), `gpus` of them (0: as many as asked)."""

    target: str
    draft: str | None
    quant: str
    draft_quant: str
    tp: int
    kv_tokens: int
    target_need: MemoryNeed  # on each GPU
    draft_need: MemoryNeed | None  # on the first GPU
    target_weights: float  # all GPUs together
    gpu_bytes: float | None
    gpus: int
    suggestions: tuple[str, ...] = ()

    @property
    def first_gpu(self) -> float:
        return self.target_need.total + (self.draft_need.total if self.draft_need else 0.0)

    @property
    def fits(self) -> bool | None:
        if self.gpu_bytes is None:
            return None
        return self.first_gpu <= self.gpu_bytes and (self.gpus == 0 or self.tp <= self.gpus)

    def verdict(self) -> str:
        gpu_bytes = self.gpu_bytes
        if gpu_bytes is None:  # self.fits is None
            return "no GPU memory known here: give --gpu-memory GB to check a card size"
        if self.fits:
            return f"fits: {self.first_gpu / GB:.1f} of {gpu_bytes / GB:.1f} GB on the first GPU"
        head = f"{self.target} in {self.quant} needs {self.target_weights / GB:.0f} GB of weights"
        if self.tp > 1:
            head += f" ({self.first_gpu / GB:.1f} GB on the first of {self.tp} GPUs, draft included)"
        elif self.draft_need is not None:
            head += f" ({self.first_gpu / GB:.1f} GB with the draft)"
        if not self.suggestions:
            return f"{head}: nothing offered here fits {gpu_bytes / GB:.0f} GB GPUs"
        return f"{head}: " + ", or ".join(self.suggestions)


def plan_pair(
    target_name: str,
    target_model: PreTrainedModel,
    draft_name: str | None,
    draft_model: PreTrainedModel | None,
    quant: str,
    draft_quant: str,
    dtype: torch.dtype,
    tp: int = 1,
    kv_tokens: int = KV_TOKENS,
    gpu_bytes: float | None = None,
    gpus: int = 0,
) -> PairPlan:
    """The memory a pair needs per GPU (meta models will do), and where it does not fit GPUs of
    `gpu_bytes`, what would: more GPUs in the asked format, or a smaller format."""
    draft_need = None if draft_model is None else memory_need(draft_model, draft_quant, dtype, kv_tokens)
    extra = draft_need.total if draft_need else 0.0

    def first_gpu(q: str, n: int) -> float:
        return memory_need(target_model, q, dtype, kv_tokens, n).total + extra

    target_need = memory_need(target_model, quant, dtype, kv_tokens, tp)
    weights = memory_need(target_model, quant, dtype, kv_tokens, 1).weights
    suggestions: list[str] = []
    if gpu_bytes is not None and target_need.total + extra > gpu_bytes:
        more = next((n for n in TP_SIZES if n > tp and first_gpu(quant, n) <= gpu_bytes), None)
        if more is not None:
            suggestions.append(
                f"use --tp {more} on {more} {gpu_bytes / GB:.0f} GB GPUs"
                + (f" (this machine has {gpus})" if 0 < gpus < more else "")
            )
        smaller = next((q for q in SMALLER if q != quant and first_gpu(q, tp) <= gpu_bytes), None)
        if smaller is not None:
            size = memory_need(target_model, smaller, dtype, kv_tokens, 1).weights
            where = "on one" if tp == 1 else f"over {tp}"
            suggestions.append(f"--quant {smaller}, {size / GB:.0f} GB, {where}")
    return PairPlan(
        target_name,
        draft_name,
        quant,
        draft_quant,
        tp,
        kv_tokens,
        target_need,
        draft_need,
        weights,
        gpu_bytes,
        gpus,
        tuple(suggestions),
    )


WEIGHT_FORMATS = (("bf16", "none"), ("8bit", "8bit"), ("4bit", "4bit"))


def weight_sizes(alias_name: str, cache_dir) -> dict[str, int]:
    """An alias's weights in bf16, 8-bit and 4-bit (NF4), without the network: from a config
    on this machine (an installed offline package, the Hugging Face cache), else from the
    shapes registered for it (speccli.models.names.shapes)."""
    from speccli.models.names.registry import ALIASES
    from speccli.models.names.shapes import shape_config

    config = _local_config(alias_name, cache_dir) or shape_config(ALIASES[alias_name].hub_id)
    assert config is not None, f"no shapes registered for {alias_name}"  # every alias has them (tests/test_shapes.py)
    one, two = (_with_layers(config, layers) for layers in (1, 2))
    # The layers are all alike: the weights of one and of two give the rest, without building
    # each alias's whole meta model on every `specgen models`.
    sizes = {}
    for name, quant in WEIGHT_FORMATS:
        first, second = (memory_need(model, quant, torch.bfloat16).weights for model in (one, two))
        sizes[name] = round(first + (config.num_hidden_layers - 1) * (second - first))
    return sizes


def _with_layers(config, layers: int) -> PreTrainedModel:
    from copy import deepcopy

    shallow = deepcopy(config)
    shallow.num_hidden_layers = layers
    return meta_model(shallow)


def _local_config(alias_name: str, cache_dir):
    from pathlib import Path

    from speccli.models.names import offline
    from speccli.models.formats.gguf_weights import gguf_config
    from speccli.models.names.registry import ALIASES

    alias = ALIASES[alias_name]
    package = offline.OFFLINE_MODELS.get(alias.offline) if alias.offline else None
    parts = offline.installed_parts(package) if package is not None else None
    if package is not None and parts is not None:
        gguf = parts[0] if package.single_part else Path(cache_dir) / package.filename
        if gguf.is_file():
            return gguf_config(gguf)
    return cached_hub_config(alias.hub_id)


def cached_hub_config(hub_id: str):
    """`hub_id`'s config from the Hugging Face cache, without the network; None when it is not there."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(hub_id, local_files_only=True)
    except (OSError, ValueError):
        return None
