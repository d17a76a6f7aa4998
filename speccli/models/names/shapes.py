"""The architecture of every registered alias, as the model's config.json on the Hub gives it:
what `specgen models` and `specgen plan` size a model by when its config is not on this
machine, so that neither needs the network. Shapes only: a model that loads reads its own
config, and a config on this machine (an offline package, the Hugging Face cache) comes first.

Checked against copies of the Hub's config.json files (ai-dynamo/aiconfigurator: Qwen3, Llama
3.1 and 3.3; kevinstephano/thunder_model_blocks: Llama 3 8B, 3.2 1B), Lightning-AI/litgpt's
`litgpt/config.py` (every Llama 3.x, Qwen2.5, Qwen2.5-Coder, Qwen3 and SmolLM2 size) and
SafeAILab/EAGLE's draft configs (Vicuna); tests/test_shapes.py checks them against the Llama 3
configs in tests/data and the offline packages' GGUF headers.
"""

from __future__ import annotations

from typing import Any

_LLAMA3 = dict(model_type="llama", vocab_size=128256, tie_word_embeddings=False)
_QWEN25 = dict(model_type="qwen2", vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768)
_QWEN25_LARGE = dict(_QWEN25, vocab_size=152064, tie_word_embeddings=False)
_QWEN3 = dict(
    model_type="qwen3", vocab_size=151936, head_dim=128, tie_word_embeddings=False, max_position_embeddings=40960
)
_VICUNA = dict(model_type="llama", vocab_size=32000, tie_word_embeddings=False, max_position_embeddings=2048)
_SMOLLM2 = dict(model_type="llama", vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192)


def _shape(
    family: dict[str, Any], hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, **rest: Any
) -> dict[str, Any]:
    return dict(
        family,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        **rest,
    )


_LLAMA3_8B = _shape(_LLAMA3, 4096, 14336, 32, 32, 8)
_LLAMA3_70B = _shape(_LLAMA3, 8192, 28672, 80, 64, 8)
_QWEN25_SIZES = {
    "0.5B": _shape(_QWEN25, 896, 4864, 24, 14, 2),
    "1.5B": _shape(_QWEN25, 1536, 8960, 28, 12, 2),
    "3B": _shape(_QWEN25, 2048, 11008, 36, 16, 2),
    "7B": _shape(_QWEN25_LARGE, 3584, 18944, 28, 28, 4),
    "14B": _shape(_QWEN25_LARGE, 5120, 13824, 48, 40, 8),
    "32B": _shape(_QWEN25_LARGE, 5120, 27648, 64, 40, 8),
    "72B": _shape(_QWEN25_LARGE, 8192, 29568, 80, 64, 8),
}

SHAPES: dict[str, dict[str, Any]] = {
    "meta-llama/Meta-Llama-3-8B-Instruct": dict(_LLAMA3_8B, max_position_embeddings=8192),
    "meta-llama/Meta-Llama-3-70B-Instruct": dict(_LLAMA3_70B, max_position_embeddings=8192),
    "meta-llama/Llama-3.1-8B-Instruct": dict(_LLAMA3_8B, max_position_embeddings=131072),
    "meta-llama/Llama-3.1-70B-Instruct": dict(_LLAMA3_70B, max_position_embeddings=131072),
    "meta-llama/Llama-3.3-70B-Instruct": dict(_LLAMA3_70B, max_position_embeddings=131072),
    "meta-llama/Llama-3.2-3B-Instruct": _shape(
        _LLAMA3, 3072, 8192, 28, 24, 8, head_dim=128, tie_word_embeddings=True, max_position_embeddings=131072
    ),
    "meta-llama/Llama-3.2-1B-Instruct": _shape(
        _LLAMA3, 2048, 8192, 16, 32, 8, head_dim=64, tie_word_embeddings=True, max_position_embeddings=131072
    ),
    **{f"Qwen/Qwen2.5-{size}-Instruct": shape for size, shape in _QWEN25_SIZES.items()},
    **{f"Qwen/Qwen2.5-Coder-{size}-Instruct": shape for size, shape in _QWEN25_SIZES.items() if size != "72B"},
    "Qwen/Qwen3-0.6B": _shape(_QWEN3, 1024, 3072, 28, 16, 8, tie_word_embeddings=True),
    "Qwen/Qwen3-1.7B": _shape(_QWEN3, 2048, 6144, 28, 16, 8, tie_word_embeddings=True),
    "Qwen/Qwen3-4B": _shape(_QWEN3, 2560, 9728, 36, 32, 8, tie_word_embeddings=True),
    "Qwen/Qwen3-8B": _shape(_QWEN3, 4096, 12288, 36, 32, 8),
    "Qwen/Qwen3-14B": _shape(_QWEN3, 5120, 17408, 40, 40, 8),
    "Qwen/Qwen3-32B": _shape(_QWEN3, 5120, 25600, 64, 64, 8),
    "lmsys/vicuna-7b-v1.3": _shape(_VICUNA, 4096, 11008, 32, 32, 32),
    "lmsys/vicuna-13b-v1.3": _shape(_VICUNA, 5120, 13824, 40, 40, 40),
    "lmsys/vicuna-33b-v1.3": _shape(_VICUNA, 6656, 17920, 60, 52, 52),
    "HuggingFaceTB/SmolLM2-135M-Instruct": _shape(_SMOLLM2, 576, 1536, 30, 9, 3),
    "HuggingFaceTB/SmolLM2-360M-Instruct": _shape(_SMOLLM2, 960, 2560, 32, 15, 5),
    "HuggingFaceTB/SmolLM2-1.7B-Instruct": _shape(_SMOLLM2, 2048, 8192, 24, 32, 32),
}


def shape_config(hub_id: str) -> Any | None:
    """A transformers config with the registered shapes of `hub_id`; None for a model the
    registry does not know."""
    shape = SHAPES.get(hub_id)
    if shape is None:
        return None
    from transformers import AutoConfig

    fields = dict(shape)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)
