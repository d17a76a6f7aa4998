"""specgen's own GGUF dequantization: the header reader and the torch kernels give exactly what
the gguf package and transformers' GGUF loader give, bit for bit."""

from __future__ import annotations

import mmap

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from speccli.models.formats import gguf_file, gguf_weights
from test_models_registry import write_tiny_gguf

TORCH_TYPES = sorted(gguf_weights._torch_kernel_types())


def _mapped(tmp_path, raw: bytes) -> mmap.mmap:
    path = tmp_path / "blocks.bin"
    path.write_bytes(raw)
    with open(path, "rb") as handle:
        return mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)


@pytest.mark.parametrize("ggml_type", TORCH_TYPES, ids=lambda t: gguf.GGMLQuantizationType(t).name)
def test_torch_kernels_equal_the_gguf_package_bit_for_bit(ggml_type, tmp_path):
    kind = gguf.GGMLQuantizationType(ggml_type)
    block_elements, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    rows, columns = 3, 2 * 256
    raw = np.random.default_rng(ggml_type).integers(
        0, 256, rows * columns // block_elements * block_bytes, dtype=np.uint8
    )
    tensor = gguf_file.GgufTensor("w", (rows, columns), ggml_type, 0, raw.size)
    ours = gguf_weights.dequantize(_mapped(tmp_path, raw.tobytes()), tensor, set(TORCH_TYPES))
    with np.errstate(all="ignore"):  # random scale bytes include NaN and infinity
        reference = gguf.dequantize(raw.reshape(rows, -1), kind)
    assert ours.shape == reference.shape == (rows, columns) and ours.dtype == reference.dtype == np.float32
    numbers = ~np.isnan(reference)
    assert np.array_equal(np.isnan(ours), ~numbers)
    assert np.array_equal(ours[numbers].view(np.uint32), reference[numbers].view(np.uint32))


@pytest.fixture(scope="module")
def quantized_gguf(tmp_path_factory):
    """A tiny Llama (so the q/k un-permutation runs) whose matrices take Q8_0, Q5_0, Q5_1, Q4_0
    and F16 in turn: transformers' kernels, specgen's own and the numpy fallback all used."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.mixed.gguf"
    write_tiny_gguf(path, block_types=("Q8_0", "Q5_0", "Q5_1", "Q4_0", "F16"))
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_model_equals_transformers_own_gguf_load(quantized_gguf, dtype):
    path = quantized_gguf
    reported = []
    ours = gguf_weights.load_causal_lm(path, dtype, None, lambda done, total: reported.append((done, total)))
    theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    mine, reference = ours.state_dict(), theirs.state_dict()
    assert mine.keys() == reference.keys()
    assert [name for name in mine if not torch.equal(mine[name], reference[name])] == []
    assert all(t.dtype == dtype for t in mine.values())
    header = gguf_file.read_header(path)
    assert reported[-1] == (len(header.tensors), len(header.tensors))
    ids = torch.tensor([[5, 6, 7, 8, 3]])
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)


def test_the_header_matches_the_gguf_package(quantized_gguf):
    ours = gguf_file.read_header(quantized_gguf)
    theirs = gguf.GGUFReader(quantized_gguf)
    assert ours.architecture == "llama" and ours.version == 3
    assert ours.metadata["llama.block_count"] == theirs.fields["llama.block_count"].contents()
    assert ours.metadata["tokenizer.ggml.tokens"] == len(theirs.fields["tokenizer.ggml.tokens"].contents())
    assert [(t.name, t.shape, t.ggml_type, t.start, t.nbytes) for t in ours.tensors] == [
        (t.name, tuple(int(n) for n in reversed(t.shape)), int(t.tensor_type), int(t.data_offset), int(t.n_bytes))
        for t in theirs.tensors
    ]


def test_the_tokenizer_digest_covers_only_the_tokenizer(tmp_path):
    first, second = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_tiny_gguf(first, seed=1)
    write_tiny_gguf(second, seed=2)  # other weights, the same tokenizer
    a, b = gguf_file.read_header(first), gguf_file.read_header(second)
    assert a.digest("tokenizer.") == b.digest("tokenizer.")
    assert a.digest("llama.") == b.digest("llama.")


def test_damaged_files_are_refused_with_the_reason(quantized_gguf, tmp_path):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(quantized_gguf.read_bytes()[:-100])
    with pytest.raises(gguf_file.GgufFormatError, match="truncated: tensor .* ends past the end of the file"):
        gguf_file.read_header(truncated)
    cut_header = tmp_path / "cut.gguf"
    cut_header.write_bytes(quantized_gguf.read_bytes()[:200])
    with pytest.raises(gguf_file.GgufFormatError, match="ends inside its header|runs past the end of the file"):
        gguf_file.read_header(cut_header)
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(gguf_file.GgufFormatError, match="does not start with the GGUF magic"):
        gguf_file.read_header(not_gguf)


@pytest.mark.parametrize("config_from_header", [True, False], ids=["llama-from-header", "parsed"])
def test_a_first_load_parses_the_metadata_once_for_tokenizer_and_config_or_not_at_all(
    tmp_path, monkeypatch, config_from_header
):
    from speccli.config import LoadConfig
    from speccli.models.formats import gguf_config
    from speccli.models.loading import load_model

    if not config_from_header:
        monkeypatch.setattr(gguf_config, "PLAIN_ARCHITECTURES", ())
    path = tmp_path / f"once-{config_from_header}.gguf"
    write_tiny_gguf(path, seed=5)
    parses = []
    real = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda *args, **kwargs: parses.append(args[0]) or real(*args, **kwargs))
    messages = []
    load_model(str(path), LoadConfig(device="cpu", dtype="float32"), messages.append, tmp_path / "cache")
    assert any("converting the tokenizer" in m for m in messages) and any("dequantized in" in m for m in messages)
    assert len(parses) == (0 if config_from_header else 1)
