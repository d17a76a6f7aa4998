"""Small models built inside the tests: a character tokenizer and random Llama-style pairs."""

from __future__ import annotations

import os
import site
import string
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from speccli.backends.hf import HFCausalLM

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
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


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


# What tests that compare with an in-memory reference on the CPU pass to the CLI: on a
# machine with CUDA, --device auto would pick it, and --quant auto 4-bit weights there.
ON_CPU = ("--device", "cpu")


# More positions than a pipe or a terminal holds unread characters (a pipe 64 KiB by
# default, a Linux pseudo-terminal some tens of KiB): an answer of 100000 tokens from a
# never_ends() target cannot finish while the test has stopped reading, so an interrupt sent
# then always lands inside the generation.
ENDLESS_CONTEXT = 1 << 17


def never_ends(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Zero the output rows of <unk>, <s> and </s>: their logits are then 0, below the
    largest of the other (random, either sign) logits, so greedy decoding never picks them. Every token then prints
    one character, and an answer ends only at its length limit or the context's end."""
    with torch.no_grad():
        model.lm_head.weight[: len(SPECIALS)] = 0
    return model


@pytest.fixture(autouse=True)
def measured_floor(request, monkeypatch) -> None:
    """k auto's floor (speccli.autok.measured) stops a way of drafting by the wall-clock time of
    its steps: with tiny models that is Python's time, not the passes' the tests price. Off in
    the tests of this process unless a test is marked `floor` (which then sets its clock)."""
    if request.node.get_closest_marker("floor") is None:
        monkeypatch.setattr("speccli.autok.measured.PAYS_AT_LEAST", 0.0)


@pytest.fixture
def private_cache(tmp_path, monkeypatch) -> Path:
    """specgen's cache (calibrations) in this test's own folder, for the command run in the
    test's process and for children that inherit its environment."""
    cache = tmp_path / "specgen-cache"
    monkeypatch.setenv("SPECGEN_CACHE", str(cache))
    return cache


def isolated_env(home: Path, **extra: str) -> dict[str, str]:
    """The environment for a specgen child process with its own home: the calibration
    cache (SPECGEN_CACHE), prompt history (XDG_STATE_HOME) and anything else kept under
    HOME live in `home`, not in the user's folders shared with other tests and runs.
    PYTHONUSERBASE keeps packages installed with `pip install --user` importable."""
    env = {
        **os.environ,
        "HOME": str(home),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_STATE_HOME": str(home / "state"),
        "SPECGEN_CACHE": str(home / "specgen-cache"),
        "PYTHONUSERBASE": os.environ.get("PYTHONUSERBASE", site.getuserbase()),
        # The checkout first, then what the caller's PYTHONPATH held (packages installed with --target).
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parents[1]), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
        "OMP_NUM_THREADS": "1",  # as above: tiny models on a shared 2-core machine
    }
    return {**env, **extra}


def default_sigint() -> None:
    """preexec_fn for a child that a test interrupts: Ctrl-C (SIGINT) back to its default.

    A process started with SIGINT ignored (a background job of a non-interactive shell,
    nohup, some CI runners) passes that on to every child, and a Python started so never
    raises KeyboardInterrupt: the interrupt would be lost and the test would wait for its
    timeout. A user's terminal starts specgen with the default, which is what is tested."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def read_first(stream, count: int) -> bytes:
    """Up to `count` bytes from an unbuffered pipe, as they come (fewer only at its end): a
    child's first output, before a test interrupts it or closes the pipe."""
    data = b""
    while len(data) < count:
        chunk = stream.read(count - len(data))
        if not chunk:
            break
        data += chunk
    return data


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
                vocab_size,
                seed=12,
                embedding_rows=vocab_size + 7,
                hidden=16,
                layers=1,
                logit_scale=20.0,
            ),
        ),
    ]


def pytest_collection_modifyitems(config, items) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


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
    from speccli.backends.static import StaticCausalLM

    return StaticCausalLM(model, **kwargs)
