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

# hidden, intermediate, layers, attention heads, key/value heads, vocabulary, tied embeddings,
# context; head_dim where the config gives one apart from hidden / heads.
_LLAMA3_8B = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)
_LLAMA3_70B = dict(_LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                   num_attention_heads=64)
_QWEN25 = dict(model_type="qwen2", vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768)
_QWEN25_LARGE = dict(_QWEN25, vocab_size=152064, tie_word_embeddings=False)
_QWEN3 = dict(model_type="qwen3", vocab_size=151936, head_dim=128, num_key_value_heads=8, tie_word_embeddings=False,
              max_position_embeddings=40960)
_VICUNA = dict(model_type="llama", vocab_size=32000, tie_word_embeddings=False, max_position_embeddings=2048)
_SMOLLM2 = dict(model_type="llama", vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192)


def _qwen25(hidden: int, intermediate: int, layers: int, heads: int, kv: int, large: bool) -> dict[str, Any]:
    return dict(_QWEN25_LARGE if large else _QWEN25, hidden_size=hidden, intermediate_size=intermediate,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv)


_QWEN25_SIZES = {
    "0.5B": _qwen25(896, 4864, 24, 14, 2, False),
    "1.5B": _qwen25(1536, 8960, 28, 12, 2, False),
    "3B": _qwen25(2048, 11008, 36, 16, 2, False),
    "7B": _qwen25(3584, 18944, 28, 28, 4, True),
    "14B": _qwen25(5120, 13824, 48, 40, 8, True),
    "32B": _qwen25(5120, 27648, 64, 40, 8, True),
    "72B": _qwen25(8192, 29568, 80, 64, 8, True),
}

SHAPES: dict[str, dict[str, Any]] = {
    "meta-llama/Meta-Llama-3-8B-Instruct": dict(_LLAMA3_8B, max_position_embeddings=8192),
    "meta-llama/Meta-Llama-3-70B-Instruct": dict(_LLAMA3_70B, max_position_embeddings=8192),
    "meta-llama/Llama-3.1-8B-Instruct": dict(_LLAMA3_8B, max_position_embeddings=131072),
    "meta-llama/Llama-3.1-70B-Instruct": dict(_LLAMA3_70B, max_position_embeddings=131072),
    "meta-llama/Llama-3.3-70B-Instruct": dict(_LLAMA3_70B, max_position_embeddings=131072),
    "meta-llama/Llama-3.2-3B-Instruct": dict(_LLAMA3_8B, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                                             num_attention_heads=24, head_dim=128, tie_word_embeddings=True,
                                             max_position_embeddings=131072),
    "meta-llama/Llama-3.2-1B-Instruct": dict(_LLAMA3_8B, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                             num_attention_heads=32, head_dim=64, tie_word_embeddings=True,
                                             max_position_embeddings=131072),
    **{f"Qwen/Qwen2.5-{size}-Instruct": shape for size, shape in _QWEN25_SIZES.items()},
    **{f"Qwen/Qwen2.5-Coder-{size}-Instruct": shape for size, shape in _QWEN25_SIZES.items() if size != "72B"},
    "Qwen/Qwen3-0.6B": dict(_QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                            num_attention_heads=16, tie_word_embeddings=True),
    "Qwen/Qwen3-1.7B": dict(_QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                            num_attention_heads=16, tie_word_embeddings=True),
    "Qwen/Qwen3-4B": dict(_QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                          num_attention_heads=32, tie_word_embeddings=True),
    "Qwen/Qwen3-8B": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                          num_attention_heads=32),
    "Qwen/Qwen3-14B": dict(_QWEN3, hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                           num_attention_heads=40),
    "Qwen/Qwen3-32B": dict(_QWEN3, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                           num_attention_heads=64),
    "lmsys/vicuna-7b-v1.3": dict(_VICUNA, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=32),
    "lmsys/vicuna-13b-v1.3": dict(_VICUNA, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                                  num_attention_heads=40, num_key_value_heads=40),
    "lmsys/vicuna-33b-v1.3": dict(_VICUNA, hidden_size=6656, intermediate_size=17920, num_hidden_layers=60,
                                  num_attention_heads=52, num_key_value_heads=52),
    "HuggingFaceTB/SmolLM2-135M-Instruct": dict(_SMOLLM2, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                                num_attention_heads=9, num_key_value_heads=3),
    "HuggingFaceTB/SmolLM2-360M-Instruct": dict(_SMOLLM2, hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
                                                num_attention_heads=15, num_key_value_heads=5),
    "HuggingFaceTB/SmolLM2-1.7B-Instruct": dict(_SMOLLM2, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                                                num_attention_heads=32, num_key_value_heads=32),
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
