"""A draft quantized to int8 on the CPU: chosen by default for drafts, refused where it
cannot run, and lossless (the output is still exactly the target's greedy output)."""

from __future__ import annotations

import pytest
import torch

from conftest import save_model_folder, wrap
from speccli.config import LoadConfig, SamplingConfig, SpecConfig
from speccli.drafters.model import ModelDrafter
from speccli.events import StepEvent, TokenEvent
from speccli.loop import SpeculativeDecoder
from speccli.models import choices
from speccli.models.errors import ModelLoadError
from speccli.models.kernels.int8 import int8_problem, quantize_int8
from speccli.models.loading import choose_quant, load_model

CPU = torch.device("cpu")
CUDA0 = torch.device("cuda", 0)
PROMPTS = ["def fib(n):", "hello world", "abcabcabc", "1, 2, 3,", "The quick brown fox"]


def test_this_pytorch_can_quantize_to_int8():
    assert int8_problem() is None


def test_quantize_int8_gives_what_torchs_quantize_dynamic_gives(pairs):
    import copy

    from torch.ao.quantization import quantize_dynamic

    source = pairs[0].draft
    ours = quantize_int8(copy.deepcopy(source))
    theirs = quantize_dynamic(copy.deepcopy(source), {torch.nn.Linear}, dtype=torch.qint8, inplace=False)
    mine = {name: type(module) for name, module in ours.named_modules()}
    assert mine == {name: type(module) for name, module in theirs.named_modules()}
    assert torch.nn.Linear not in mine.values()
    for name, module in ours.named_modules():
        if hasattr(module, "weight") and callable(module.weight):
            other = dict(theirs.named_modules())[name]
            assert (module.in_features, module.out_features) == (other.in_features, other.out_features)
            assert torch.equal(module.weight().int_repr(), other.weight().int_repr()), name
            assert module.weight().q_scale() == other.weight().q_scale()
    ids = torch.tensor([[5, 6, 7, 8, 3]])
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)


def test_auto_quantizes_drafts_on_the_cpu_only():
    assert choose_quant("auto", CPU, draft=True) == "int8"
    assert choose_quant("auto", CPU) == "none"  # a target stays as it is
    assert choose_quant("auto", CPU, gguf=True, draft=True) == "int8"  # after dequantizing
    assert choose_quant("auto", CUDA0, draft=True) == "4bit"
    assert choose_quant("none", CPU, draft=True) == "none"
    assert choose_quant("int8", CPU) == "int8"  # a target too, when asked


def test_int8_is_refused_where_it_cannot_run(monkeypatch):
    with pytest.raises(ModelLoadError, match="runs on the CPU only") as info:
        choose_quant("int8", CUDA0)
    assert "4bit or 8bit" in info.value.hint
    monkeypatch.setattr(choices, "int8_problem", lambda: "no quantized engine")
    with pytest.raises(ModelLoadError, match="--quant int8 is not available: no quantized engine"):
        choose_quant("int8", CPU)
    assert choose_quant("auto", CPU, draft=True) == "none"  # auto falls back quietly


@pytest.fixture(scope="module")
def folders(pairs, tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("int8-models")
    return {
        pair.name: (
            str(save_model_folder(pair.target, tokenizer, root / f"{pair.name}-target")),
            str(save_model_folder(pair.draft, tokenizer, root / f"{pair.name}-draft")),
        )
        for pair in pairs
    }


def test_a_draft_loads_as_int8_in_float32_whatever_dtype_it_inherits(folders):
    _, draft_folder = folders["close-draft"]
    loaded = load_model(draft_folder, LoadConfig(device="cpu", dtype="bfloat16", for_draft=True))
    assert loaded.quant == "int8" and loaded.dtype is torch.float32
    kinds = {type(module) for module in loaded.model.modules()}
    assert torch.ao.nn.quantized.dynamic.Linear in kinds and torch.nn.Linear not in kinds
    assert "int8" in loaded.describe()


def test_an_explicit_int8_with_another_dtype_is_a_contradiction(folders):
    _, draft_folder = folders["close-draft"]
    with pytest.raises(ModelLoadError, match="computes in float32 around int8 weights, not in bfloat16"):
        load_model(draft_folder, LoadConfig(device="cpu", dtype="bfloat16", quant="int8", for_draft=True))


@pytest.mark.parametrize("pair_index", [0, 1])
def test_int8_draft_output_is_exactly_the_targets_greedy_output(pairs, tokenizer, pair_index):
    pair = pairs[pair_index]
    draft = quantize_int8(_copy(pair.draft))  # a copy: quantizing works in place
    drafter = ModelDrafter(wrap(draft), len(tokenizer))
    decoder = SpeculativeDecoder(wrap(pair.target), tokenizer, [2], drafter)
    accepted = 0
    for prompt in PROMPTS:
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        reference = pair.target.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[
            0, len(ids) :
        ].tolist()
        if 2 in reference:
            reference = reference[: reference.index(2)]
        events = list(decoder.generate(ids, SamplingConfig(), SpecConfig(k=4, max_new_tokens=24)))
        assert [e.token_id for e in events if isinstance(e, TokenEvent)] == reference, prompt
        accepted += sum(e.accepted for e in events if isinstance(e, StepEvent))
    if pair.name == "close-draft":
        assert accepted > 0  # the quantized draft still guesses right


def _copy(model):
    copy = type(model)(model.config).eval()
    copy.load_state_dict(model.state_dict())
    return copy
