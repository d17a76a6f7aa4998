"""Whether transformers' tensor-parallel plan can split a target over `--tp` ranks: checked
before any rank starts (and the device each rank takes)."""

from __future__ import annotations

import math
from typing import Any

import torch

from speccli.config import LoadConfig
from speccli.models.errors import ModelLoadError
from speccli.models.names.registry import ResolvedModel


def attention_heads(model_config: Any) -> tuple[int, int]:
    """(attention heads, key/value heads) of a transformers config."""
    text = getattr(model_config, "text_config", None) or model_config
    heads = int(getattr(text, "num_attention_heads"))
    return heads, int(getattr(text, "num_key_value_heads", None) or heads)


def check_heads_split(name: str, model_config: Any, tp: int) -> None:
    """A ModelLoadError unless `tp` ranks divide the target's attention and key/value heads
    (each rank holds whole heads), naming the counts that would."""
    if tp <= 1:
        return
    heads, kv_heads = attention_heads(model_config)
    if heads % tp == 0 and kv_heads % tp == 0:
        return
    common = math.gcd(heads, kv_heads)
    working = [n for n in range(2, common + 1) if common % n == 0]
    hint = (
        f"use --tp {' or '.join(str(n) for n in working)}"
        if working
        else "this model cannot be split by heads: drop --tp"
    )
    raise ModelLoadError(
        f"--tp {tp} cannot split {name}: each rank holds whole heads, and it has {heads} attention heads"
        f" and {kv_heads} key/value heads",
        hint=hint,
    )


def tensor_parallel_device(name: str, config: LoadConfig, resolved: ResolvedModel) -> torch.device:
    """This rank's device for a target split over `config.tp` ranks; a ModelLoadError where
    transformers' tensor-parallel plan cannot apply."""
    from speccli.backends.distributed import TP_QUANTS, current, device_for

    if resolved.is_gguf:
        raise ModelLoadError(
            f"--tp splits safetensors models; {name} is a GGUF file, which transformers dequantizes whole",
            hint="use the model's safetensors release (a Hub id or folder), or drop --tp",
        )
    if config.quant not in ("auto", *TP_QUANTS):
        raise ModelLoadError(
            f"--tp {config.tp} splits unquantized weights; --quant {config.quant} is not split by transformers' plan",
            hint="use --quant none (or auto) with --tp, or drop --tp to quantize on one GPU",
        )
    return device_for(current(), config.device)
