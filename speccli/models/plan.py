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

import torch

from speccli.models.errors import ModelLoadError

GB = 1e9
KV_TOKENS = 4096
# A pass's activations, the logits of a verification and the graphs' memory pool: measured
# well under this for 7B shapes; a share of the weights on top for the largest models.
WORKING_BYTES = 1.0 * GB
WORKING_SHARE = 0.05
# What a refusal offers instead, in this order.
ALTERNATIVES = ("none", "8bit", "int4", "4bit")


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


def meta_model(config) -> torch.nn.Module:
    """The architecture `config` describes, on the meta device (no memory, no weights)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def memory_need(model: torch.nn.Module, quant: str, dtype: torch.dtype, kv_tokens: int = KV_TOKENS) -> MemoryNeed:
    """What `model` (a meta model will do) needs in `quant` and `dtype`."""
    head = model.get_output_embeddings()
    size = torch.finfo(dtype).bits / 8
    weights = 0.0
    counted: set[int] = set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in counted:  # tied embeddings count once
                continue
            counted.add(id(param))
            if isinstance(module, torch.nn.Linear) and module is not head and name == "weight":
                weights += param.numel() * quantized_bytes_per_weight(quant, dtype, module.in_features)
            else:
                weights += param.numel() * size
    config = model.config
    heads = getattr(config, "num_attention_heads", 1)
    head_dim = getattr(config, "head_dim", None) or getattr(config, "hidden_size", 0) // max(1, heads)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    context = min(kv_tokens, getattr(config, "max_position_embeddings", None) or kv_tokens)
    layers = getattr(config, "num_hidden_layers", 0)
    kv_cache = 2.0 * layers * kv_heads * head_dim * context * size
    return MemoryNeed(weights, kv_cache, WORKING_BYTES + WORKING_SHARE * weights)


def check_fits(name: str, need: MemoryNeed, quant: str, free: float, device: str, alternatives: dict[str, MemoryNeed]) -> None:
    """Raise ModelLoadError (before anything is downloaded or allocated) when `need` exceeds
    `free` bytes, naming the quantizations in `alternatives` that would fit."""
    if need.total <= free:
        return
    shown = "none" if quant == "none" else quant
    fitting = [f"--quant {q} ({n.total / GB:.1f} GB)" for q, n in alternatives.items() if n.total <= free and q != quant]
    raise ModelLoadError(
        f"{name} in {shown} needs {need.total / GB:.1f} GB on {device} ({need.weights / GB:.1f} GB of weights, "
        f"{need.kv_cache / GB:.1f} GB of KV cache for {KV_TOKENS:,} tokens, {need.working / GB:.1f} GB working), "
        f"and {free / GB:.1f} GB is free",
        hint=("use " + " or ".join(fitting)) if fitting else "use a smaller model, or free memory on that GPU",
    )


def check_pair_fits(target: str, target_need: MemoryNeed, draft: str, draft_need: MemoryNeed, free: float,
                    device: str) -> None:
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
