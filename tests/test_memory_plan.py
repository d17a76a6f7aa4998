"""Memory before loading (speccli.models.memory.plan): sizes from the config alone match what loading
really allocates, and a model that cannot fit the GPU is refused before any weights, naming
what would fit."""

from __future__ import annotations

import pytest
import torch

from conftest import save_model_folder, tiny_llama
from speccli.models import loading
from speccli.models.errors import ModelLoadError
from speccli.models.memory.plan import GB, MemoryNeed, check_fits, check_pair_fits, memory_need, meta_model
from speccli.models.names.registry import ResolvedModel


def loaded_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.data_ptr() not in seen and tensor.device.type != "meta":
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unquantized_weights_are_counted_exactly(tokenizer, dtype):
    model = tiny_llama(len(tokenizer), seed=1).to(dtype)
    need = memory_need(meta_model(model.config), "none", dtype)
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    assert need.weights == parameters
    layers, kv_heads, head_dim = 2, 2, 8  # tiny_llama: hidden 32, 4 heads, 2 key/value heads
    assert need.kv_cache == 2 * layers * kv_heads * head_dim * 512 * (4 if dtype == torch.float32 else 2)


def test_the_nf4_estimate_is_what_bitsandbytes_allocates(tmp_path, tokenizer):
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    model = tiny_llama(len(tokenizer), seed=1, hidden=128, layers=2)
    folder = save_model_folder(model, tokenizer, tmp_path / "m")
    quantized = AutoModelForCausalLM.from_pretrained(
        folder,
        dtype=torch.bfloat16,
        device_map={"": "cpu"},
        quantization_config=BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=torch.bfloat16,
            bnb_4bit_use_double_quant=True,
        ),
    )
    estimate = memory_need(meta_model(model.config), "4bit", torch.bfloat16).weights
    assert abs(estimate - loaded_bytes(quantized)) / loaded_bytes(quantized) < 0.05


def test_a_model_that_does_not_fit_is_refused_with_what_would():
    need = {
        q: MemoryNeed(w * GB, 0.5 * GB, 1.0 * GB)
        for q, w in {"none": 15.2, "8bit": 7.7, "int4": 4.1, "4bit": 4.0}.items()
    }
    check_fits("qwen-7b", need["int4"], "int4", 10 * GB, "cuda:0", need)  # fits: no error
    with pytest.raises(ModelLoadError) as info:
        check_fits("qwen-7b", need["none"], "none", 10 * GB, "cuda:0", need)
    assert str(info.value) == (
        "qwen-7b in none needs 16.7 GB on cuda:0 (15.2 GB of weights, 0.5 GB of KV cache for "
        "4,096 tokens, 1.0 GB working), and 10.0 GB is free"
    )
    assert info.value.hint == "use --quant 8bit (9.2 GB) or --quant int4 (5.6 GB) or --quant 4bit (5.5 GB)"
    with pytest.raises(ModelLoadError) as nothing:
        check_fits("qwen-7b", need["4bit"], "4bit", 2 * GB, "cuda:0", need)
    assert nothing.value.hint == "use a smaller model, or free memory on that GPU"


def test_target_and_draft_must_fit_together():
    target, draft = MemoryNeed(8 * GB, 0, 1 * GB), MemoryNeed(2 * GB, 0, 1 * GB)
    check_pair_fits("t", target, "d", draft, 12 * GB, "cuda:0")
    with pytest.raises(
        ModelLoadError, match=r"t \(9.0 GB\) and d \(3.0 GB\) need 12.0 GB together on cuda:0, and 11.0 GB is free"
    ):
        check_pair_fits("t", target, "d", draft, 11 * GB, "cuda:0")


def test_loading_checks_before_any_weights(tmp_path, tokenizer, monkeypatch):
    """On CUDA the check reads only config.json: here a GPU with 1 MB free refuses a tiny model."""
    folder = save_model_folder(tiny_llama(len(tokenizer), seed=1), tokenizer, tmp_path / "m")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1_000_000, 80 * 10**9))
    resolved = ResolvedModel("local-folder", str(folder), None, "a local folder")
    with pytest.raises(ModelLoadError, match=r"^m in none needs 1.0 GB on cuda:0 .* and 0.0 GB is free$"):
        loading.check_memory("m", resolved, "none", torch.float32, torch.device("cuda", 0), False)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * 10**9, 80 * 10**9))
    need = loading.check_memory("m", resolved, "none", torch.float32, torch.device("cuda", 0), False)
    assert 0 < need.weights < 100_000


def test_models_shows_weights_from_a_config_here_else_the_registered_shapes(tmp_path, monkeypatch):
    """An alias whose config is on this machine is sized by it; any other by its registered shapes."""
    from speccli.models.memory.plan import weight_sizes

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
    assert weight_sizes("llama3-70b", tmp_path)["bf16"] == 141_107_412_992  # registered shapes
    config = load_llama8b_config(tmp_path)
    config.num_hidden_layers = 31  # the local config wins over the registered one
    monkeypatch.setattr(
        "speccli.models.memory.plan._local_config", lambda alias, cache: config if alias == "llama3-8b" else None
    )
    sizes = weight_sizes("llama3-8b", tmp_path)
    assert sizes["bf16"] == 2 * (8_030_261_248 - 218_112_000) > sizes["8bit"] > sizes["4bit"]


def load_llama8b_config(tmp_path):
    from pathlib import Path

    from speccli.models.loading import load_config

    return load_config(str(Path(__file__).parent / "data" / "llama3-8b"), tmp_path)[1]


def test_an_installed_offline_package_gives_its_sizes(tmp_path):
    from speccli.models.names import offline
    from speccli.models.memory.plan import weight_sizes

    if offline.installed_parts(offline.OFFLINE_MODELS["smollm2-135m"]) is None:
        pytest.skip("the SmolLM2-135M offline package is not installed")
    sizes = weight_sizes("smollm2-135m", tmp_path)
    assert sizes["bf16"] == 2 * 134_515_008  # SmolLM2-135M's parameters, from its GGUF header's shapes
    assert sizes["bf16"] > sizes["8bit"] > sizes["4bit"]
