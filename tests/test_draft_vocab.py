"""A draft whose tokenizer is a strict prefix of the target's, and drafts whose
tokenizers do not match at all (refused before any weights load)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast
from typer.testing import CliRunner

from conftest import ON_CPU, char_tokenizer, save_model_folder, tiny_llama, wrap
from speccli.autok.costs import measure_costs
from speccli.cli import app
from speccli.config import SamplingConfig
from speccli.drafters.model import ModelDrafter
from speccli.models.pairs.compat import check_tokenizers_compatible, shared_vocab

# The commands here run with k auto (calibrating) unless told otherwise: keep it out of ~/.cache.
pytestmark = pytest.mark.usefixtures("private_cache")

TARGET_VOCAB, DRAFT_VOCAB = 400, 300


def _corpus() -> list[str]:
    rng = random.Random(0)
    syllables = ["ka", "lo", "mi", "ter", "sun", "ba", "de", "ret", "urn", "fi", "bo", "nan", "qu", "ix", "ol", "pe"]
    return [
        " ".join("".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(12))
        for _ in range(400)
    ]


def bpe_tokenizer(size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on a fixed corpus: a smaller size gives a prefix of a larger one's ids."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_corpus(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def truncated_copy(model: LlamaForCausalLM, rows: int) -> LlamaForCausalLM:
    """The target's weights for the ids below `rows` only: a draft that agrees with the
    target wherever the target does not need the ids it lacks."""
    draft = tiny_llama(rows, seed=0, logit_scale=1.0)
    state = {
        name: tensor[:rows] if name in ("model.embed_tokens.weight", "lm_head.weight") else tensor
        for name, tensor in model.state_dict().items()
    }
    draft.load_state_dict(state)
    return draft


@pytest.fixture(scope="module")
def prefix_pair(tmp_path_factory):
    target_tok, draft_tok = bpe_tokenizer(TARGET_VOCAB), bpe_tokenizer(DRAFT_VOCAB)
    assert (len(target_tok), len(draft_tok)) == (TARGET_VOCAB, DRAFT_VOCAB)
    check_tokenizers_compatible(target_tok, draft_tok)  # the draft's ids are a prefix of the target's
    target = tiny_llama(TARGET_VOCAB, seed=1, logit_scale=20.0)
    root = tmp_path_factory.mktemp("prefix")
    return {
        "tokenizer": target_tok,
        "target_model": target,
        "target": str(save_model_folder(target, target_tok, root / "target")),
        "draft": str(save_model_folder(truncated_copy(target, DRAFT_VOCAB), draft_tok, root / "draft")),
    }


PROMPT = _corpus()[0]


def test_the_prompt_and_the_text_use_ids_the_draft_lacks(prefix_pair):
    ids = prefix_pair["tokenizer"](PROMPT)["input_ids"]
    assert max(ids) >= DRAFT_VOCAB
    assert max(reference_ids(prefix_pair, 24)) >= DRAFT_VOCAB


def reference_ids(pair, max_new: int) -> list[int]:
    ids = pair["tokenizer"](PROMPT)["input_ids"]
    out = pair["target_model"].generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False)
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("k", ["3", "auto"])
def test_a_draft_with_a_prefix_vocabulary_gives_the_targets_greedy_text(prefix_pair, k, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path))
    args = ["generate", PROMPT, "--target", prefix_pair["target"], "--draft", prefix_pair["draft"]]
    result = CliRunner().invoke(app, [*args, *ON_CPU, "--dtype", "float32", "-n", "24", "-q", "--k", k, "--json"])
    assert result.exit_code == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["token_ids"] == reference_ids(prefix_pair, 24)
    assert payload["text"] == prefix_pair["tokenizer"].decode(payload["token_ids"], skip_special_tokens=True)
    if k == "3":
        assert payload["stats"]["provenance"]["accepted"] > 0  # the draft did draft


class FavouriteLM:
    """A CausalLM stub over `rows` ids whose logits favour `favourite` above all; it records what it is fed."""

    setup_seconds = 0.0
    chains = False

    def __init__(self, rows: int, favourite: int) -> None:
        self.vocab_size, self.favourite = rows, favourite
        self.device = torch.device("cpu")
        self.max_length = None
        self.cached_tokens: list[int] = []
        self.fed: list[int] = []

    def forward(self, token_ids, all_logits: bool = True) -> torch.Tensor:
        assert all(0 <= i < self.vocab_size for i in token_ids)
        self.cached_tokens.extend(token_ids)
        self.fed.extend(token_ids)
        logits = torch.arange(len(token_ids) * self.vocab_size, dtype=torch.float32).reshape(len(token_ids), -1) % 7
        logits[:, self.favourite] = 50.0
        return logits if all_logits else logits[-1:]

    def rollback(self, length: int) -> None:
        del self.cached_tokens[length:]


@pytest.mark.parametrize(
    "rows, favourite",
    [
        (320, 310),  # the draft's tokenizer knows 300 ids, its embedding is padded to 320
        (400, 350),  # the draft's tokenizer knows 400 ids, the target's 300 (its rows are padded to 400)
    ],
)
def test_the_draft_is_fed_and_proposes_only_shared_ids(rows, favourite):
    draft = FavouriteLM(rows, favourite)
    drafter = ModelDrafter(draft, TARGET_VOCAB, shared_vocab=300, substitute_id=0)
    context = [5, 350, 7, 399, 310, 8]
    drafter.start(context)
    greedy = drafter.propose(context, 3, SamplingConfig(temperature=0.0), None)
    assert draft.fed[:6] == [5, 0, 7, 0, 0, 8]
    assert greedy.tokens and all(t < 300 for t in greedy.tokens)

    drafter.rollback(len(context))
    sampled = drafter.propose(context, 3, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0))
    assert sampled.probs.shape == (len(sampled), TARGET_VOCAB)
    assert torch.all(sampled.probs[:, 300:] == 0)
    assert torch.allclose(sampled.probs.sum(dim=-1), torch.ones(len(sampled)))
    assert all(t < 300 for t in sampled.tokens)
    # The substituted context is reused, not prefilled again on every start.
    fed = len(draft.fed)
    drafter.rollback(len(context))
    drafter.start(context)
    assert len(draft.fed) == fed


def test_shared_vocab_substitutes_the_drafts_unk_token():
    target, draft = bpe_tokenizer(TARGET_VOCAB), bpe_tokenizer(DRAFT_VOCAB)
    shared = shared_vocab(target, draft)
    assert (shared.size, shared.substitute_id) == (DRAFT_VOCAB, draft.unk_token_id)
    assert shared_vocab(draft, target).size == DRAFT_VOCAB


def test_calibration_feeds_the_draft_only_ids_it_has():
    target = tiny_llama(TARGET_VOCAB, seed=3, hidden=16, layers=1)
    draft = tiny_llama(DRAFT_VOCAB, seed=4, hidden=16, layers=1)
    costs = measure_costs(wrap(target), wrap(draft), max_fed=2, repeats=1)
    assert costs.draft_seconds is not None and costs.draft_seconds > 0
