"""Small models built inside the tests: a character tokenizer and random Llama-style pairs."""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from speccli.engine.backends import HFCausalLM

# The models here are tiny: one thread avoids oversubscribing a shared 2-core machine,
# which made them several times slower.
torch.set_num_threads(1)

SPECIALS = ["<unk>", "<s>", "</s>"]
PRINTABLE = string.ascii_letters + string.digits + string.punctuation + " \n"


def char_tokenizer(alphabet: str = PRINTABLE) -> PreTrainedTokenizerFast:
    """One token per character, ids 0..2 for <unk>, <s>, </s>."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(dict.fromkeys(alphabet)))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def tiny_llama(
    vocab_size: int,
    seed: int,
    embedding_rows: int | None = None,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    logit_scale: float = 1.0,
    max_positions: int = 512,
) -> LlamaForCausalLM:
    """A random Llama. logit_scale > 1 spreads the logits so distributions are peaked and
    greedy argmaxes are far from ties. embedding_rows > vocab_size pads the embedding
    matrix as real checkpoints often do."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=embedding_rows or vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    model.generation_config.pad_token_id = 0
    return model


def perturbed_copy(model: LlamaForCausalLM, noise: float, seed: int) -> LlamaForCausalLM:
    """A draft that mostly agrees with its target: the same weights plus noise."""
    torch.manual_seed(seed)
    draft = LlamaForCausalLM(model.config).eval()
    draft.load_state_dict(model.state_dict())
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(noise * param.std() * torch.randn_like(param))
    draft.generation_config.pad_token_id = 0
    return draft


@dataclass
class ModelPair:
    name: str
    target: LlamaForCausalLM
    draft: LlamaForCausalLM


def model_pairs(vocab_size: int) -> list[ModelPair]:
    """Two kinds of pair: a close draft (high acceptance) and an unrelated, smaller one
    whose embedding matrix is padded past the tokenizer's vocabulary."""
    target_a = tiny_llama(vocab_size, seed=1, logit_scale=20.0)
    target_b = tiny_llama(vocab_size, seed=2, hidden=48, layers=3, logit_scale=20.0)
    return [
        ModelPair("close-draft", target_a, perturbed_copy(target_a, noise=0.3, seed=11)),
        ModelPair(
            "unrelated-draft",
            target_b,
            tiny_llama(
                vocab_size, seed=12, embedding_rows=vocab_size + 7, hidden=16, layers=1,
                logit_scale=20.0,
            ),
        ),
    ]


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return char_tokenizer()


@pytest.fixture(scope="session")
def pairs(tokenizer) -> list[ModelPair]:
    return model_pairs(len(tokenizer))


def wrap(model: LlamaForCausalLM) -> HFCausalLM:
    return HFCausalLM(model)


def save_model_folder(model: LlamaForCausalLM, tokenizer, folder: Path) -> Path:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def wrap_static(model: LlamaForCausalLM, **kwargs):
    """The static-cache backend over a model (CUDA graphs only when the model is on CUDA)."""
    from speccli.engine.static_backend import StaticCausalLM

    return StaticCausalLM(model, **kwargs)


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
