"""A GGUF's config built from its header equals the one transformers' slow parse gives."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from speccli.models.formats.gguf_config import config_dict
from speccli.models.formats.gguf_file import read_header
from test_models_registry import write_tiny_gguf

TOKENS = ["<unk>", "<s>", "</s>", "a", "b", "ab"]


def write_metadata_gguf(
    path,
    architecture: str,
    *,
    name: str = "tiny",
    own_output: bool = True,
    vocab_size: int | None = None,
    rope_base: float = 1000000.0,
):
    """Metadata as llama.cpp's converter writes it, and the tensors whose names the config reads."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name(name)
    writer.add_block_count(2)
    writer.add_context_length(4096)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(rope_base)
    writer.add_layer_norm_rms_eps(1e-6)
    if vocab_size is not None:
        writer.add_vocab_size(vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(TOKENS)
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(2)
    writer.add_tensor("token_embd.weight", np.zeros((len(TOKENS), 64), dtype=np.float32))
    if own_output:
        writer.add_tensor("output.weight", np.zeros((len(TOKENS), 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("own_output", [True, False], ids=["untied", "tied"])
@pytest.mark.parametrize("vocab_size", [None, 6], ids=["vocab-from-tokens", "vocab-key"])
def test_the_header_gives_transformers_own_config(tmp_path, architecture, own_output, vocab_size):
    path = write_metadata_gguf(tmp_path / "m.gguf", architecture, own_output=own_output, vocab_size=vocab_size)
    fast = config_dict(read_header(path))
    assert fast is not None and fast == load_gguf_checkpoint(str(path))["config"]
    assert fast["model_type"] == architecture and fast["tie_word_embeddings"] is not own_output


def test_the_tiny_llama_the_tests_load_too(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    assert config_dict(read_header(path)) == load_gguf_checkpoint(str(path))["config"]


def test_what_transformers_treats_apart_is_left_to_it(tmp_path):
    mistral = write_metadata_gguf(tmp_path / "mistral.gguf", "llama", name="mistral 7b")  # renamed to mistral
    assert config_dict(read_header(mistral)) is None
    gemma = write_metadata_gguf(tmp_path / "gemma.gguf", "gemma3")
    assert config_dict(read_header(gemma)) is None


def test_transformers_parse_gives_the_rest_when_asked(tmp_path):
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from speccli.models.formats.gguf_weights import share_metadata_parse

    path = write_metadata_gguf(tmp_path / "q.gguf", "qwen2")
    share_metadata_parse()
    result = gguf_utils.load_gguf_checkpoint(str(path))
    assert result["config"]["model_type"] == "qwen2"
    assert result["tokenizer"]["tokens"] == TOKENS  # parsed the slow way, on first use
    result["config"]["hidden_size"] = 1  # every caller's own copy
    assert gguf_utils.load_gguf_checkpoint(str(path))["config"]["hidden_size"] == 64
