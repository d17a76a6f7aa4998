"""Checkpoints in the layouts draft heads are published in, written for tiny targets.

The key names, shapes and config keys are those of the Hub files, recorded here as data:
- EAGLE-3: yuhuili/EAGLE3-LLaMA3.1-Instruct-8B (`pytorch_model.bin`, config
  `LlamaForCausalLMEagle3` with `draft_vocab_size` 32000) as SafeAILab/EAGLE
  `eagle/model/cnets.py` builds it; the `layers.0.` spelling and the nested
  `transformer_layer_config` / `norm_before_residual` / `eagle_aux_hidden_state_layer_ids` are
  the speculators format (RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3, as vLLM's
  `llama_eagle3.py` reads it).
- EAGLE-1/2: yuhuili/EAGLE-LLaMA3-Instruct-8B (`pytorch_model.bin`), SafeAILab/EAGLE
  `eagle/model/cnets1.py`: `fc` with bias, `layers.0.*` without `input_layernorm`.
- Medusa: FasterDecoding/medusa-vicuna-7b-v1.3 (`medusa_lm_head.pt`, config `medusa_num_heads`,
  `medusa_num_layers`, `base_model_name_or_path`), FasterDecoding/Medusa `medusa_model.py`.
Shapes: H hidden, I intermediate, A attention heads, K key/value heads, D head size,
V the target's vocabulary, W the draft vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

EAGLE3_SHAPES = {
    "fc.weight": ("H", "3H"),
    "midlayer.input_layernorm.weight": ("H",),
    "midlayer.hidden_norm.weight": ("H",),
    "midlayer.post_attention_layernorm.weight": ("H",),
    "midlayer.self_attn.q_proj.weight": ("A*D", "2H"),
    "midlayer.self_attn.k_proj.weight": ("K*D", "2H"),
    "midlayer.self_attn.v_proj.weight": ("K*D", "2H"),
    "midlayer.self_attn.o_proj.weight": ("H", "A*D"),
    "midlayer.mlp.gate_proj.weight": ("I", "H"),
    "midlayer.mlp.up_proj.weight": ("I", "H"),
    "midlayer.mlp.down_proj.weight": ("H", "I"),
    "norm.weight": ("H",),
    "lm_head.weight": ("W", "H"),
    "d2t": ("W",),
    "t2d": ("V",),
}
EAGLE_SHAPES = {
    "fc.weight": ("H", "2H"),
    "fc.bias": ("H",),
    "layers.0.self_attn.q_proj.weight": ("A*D", "H"),
    "layers.0.self_attn.k_proj.weight": ("K*D", "H"),
    "layers.0.self_attn.v_proj.weight": ("K*D", "H"),
    "layers.0.self_attn.o_proj.weight": ("H", "A*D"),
    "layers.0.mlp.gate_proj.weight": ("I", "H"),
    "layers.0.mlp.up_proj.weight": ("I", "H"),
    "layers.0.mlp.down_proj.weight": ("H", "I"),
    "layers.0.post_attention_layernorm.weight": ("H",),
}
MEDUSA_SHAPES = {  # per head h, with `layers` blocks: {h}.{l}.linear.* for l < layers, then the output
    "{h}.{l}.linear.weight": ("H", "H"),
    "{h}.{l}.linear.bias": ("H",),
    "{h}.{layers}.weight": ("V", "H"),
}


def dims(config) -> dict[str, int]:
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return {
        "H": hidden,
        "I": config.intermediate_size,
        "A": heads,
        "K": config.num_key_value_heads,
        "D": head_dim,
        "V": config.vocab_size,
    }


def shape_of(spec: tuple[str, ...], sizes: dict[str, int]) -> tuple[int, ...]:
    def one(term: str) -> int:
        if "*" in term:
            a, b = term.split("*")
            return sizes[a] * sizes[b]
        if term[0].isdigit():
            return int(term[0]) * sizes[term[1:]]
        return sizes[term]

    return tuple(one(t) for t in spec)


def random_tensors(shapes: dict[str, tuple[str, ...]], sizes: dict[str, int], seed: int, scale: float = 0.2):
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for key, spec in shapes.items():
        shape = shape_of(spec, sizes)
        if key.endswith("norm.weight"):
            out[key] = 1.0 + 0.1 * torch.randn(shape, generator=generator)
        else:
            out[key] = scale * torch.randn(shape, generator=generator) / max(1, shape[-1]) ** 0.5
    return out


def eagle3_config(target_config, draft_vocab: int, **extra) -> dict:
    """The head's config.json as SafeAILab publishes it."""
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": target_config.hidden_size,
        "intermediate_size": target_config.intermediate_size,
        "num_attention_heads": target_config.num_attention_heads,
        "num_key_value_heads": target_config.num_key_value_heads,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": target_config.rms_norm_eps,
        "max_position_embeddings": target_config.max_position_embeddings,
        "rope_theta": 10000.0,
        "vocab_size": target_config.vocab_size,
        "draft_vocab_size": draft_vocab,
        "torch_dtype": "float16",
    }
    config.update(extra)
    return config


def draft_ids_with_gaps(vocab_size: int, draft_size: int) -> torch.Tensor:
    """Target ids for a draft vocabulary: every other id from 3, then the rest: gaps in d2t."""
    ids = list(range(3, vocab_size, 2)) + list(range(4, vocab_size, 2))
    return torch.tensor(ids[:draft_size])


def write_eagle3(
    folder: Path,
    target_config,
    tensors: dict[str, torch.Tensor],
    draft_ids: torch.Tensor,
    fmt: str = "bin",
    speculators: bool = False,
    **config_extra,
) -> Path:
    """An EAGLE-3 head folder: `tensors` in EAGLE3_SHAPES' names (d2t/t2d made from draft_ids)."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = dict(tensors)
    tensors["d2t"] = draft_ids - torch.arange(len(draft_ids))
    t2d = torch.zeros(target_config.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    tensors["t2d"] = t2d
    config = eagle3_config(target_config, len(draft_ids), **config_extra)
    if speculators:
        tensors = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}
        head_keys = {"draft_vocab_size", "norm_before_residual", "target_hidden_size"}
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": {k: v for k, v in config.items() if k not in head_keys | set(config_extra)},
            "draft_vocab_size": len(draft_ids),
            "norm_before_residual": False,
            **config_extra,
            "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "tiny-target"}},
        }
    (folder / "config.json").write_text(json.dumps(config))
    _save(folder, tensors, fmt)
    return folder


def write_eagle(folder: Path, target_config, tensors: dict[str, torch.Tensor], fmt: str = "bin", **extra) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": target_config.hidden_size,
        "intermediate_size": target_config.intermediate_size,
        "num_attention_heads": target_config.num_attention_heads,
        "num_key_value_heads": target_config.num_key_value_heads,
        "vocab_size": target_config.vocab_size,
        "bias": "fc.bias" in tensors,
        **extra,
    }
    (folder / "config.json").write_text(json.dumps(config))
    _save(folder, tensors, fmt)
    return folder


def write_medusa(
    folder: Path,
    tensors: dict[str, torch.Tensor],
    heads: int,
    layers: int,
    fmt: str = "pt",
    base_model: str = "tiny-target",
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = {"medusa_num_heads": heads, "medusa_num_layers": layers, "base_model_name_or_path": base_model}
    (folder / "config.json").write_text(json.dumps(config))
    if fmt == "pt":
        torch.save(tensors, folder / "medusa_lm_head.pt")
    else:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "medusa_lm_head.safetensors"))
    return folder


def medusa_tensors(sizes: dict[str, int], heads: int, layers: int, seed: int, rows: torch.Tensor | None = None):
    generator = torch.Generator().manual_seed(seed)
    out = {}
    hidden = sizes["H"]
    for h in range(heads):
        for layer in range(layers):
            out[f"{h}.{layer}.linear.weight"] = 0.3 * torch.randn(hidden, hidden, generator=generator) / hidden**0.5
            out[f"{h}.{layer}.linear.bias"] = 0.01 * torch.randn(hidden, generator=generator)
        out[f"{h}.{layers}.weight"] = (
            rows.clone() if rows is not None else torch.randn(sizes["V"], hidden, generator=generator) / hidden**0.5
        )
    return out


def _save(folder: Path, tensors: dict[str, torch.Tensor], fmt: str) -> None:
    if fmt == "bin":
        torch.save(tensors, folder / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
