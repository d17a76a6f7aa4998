"""Medusa and EAGLE heads: the target's hidden states, the draft vocabulary, training on tiny
models, saving and refusing, and drafting that stays lossless."""

from __future__ import annotations

import collections

import pytest
import torch
from safetensors.torch import load_file

import speccli.loop as decoder_module
from conftest import char_tokenizer, tiny_llama, wrap, wrap_static
from speccli.config import SamplingConfig, SpecConfig
from speccli.drafters.heads import EagleDrafter, MedusaDrafter
from speccli.events import Provenance, StepEvent, TokenEvent
from speccli.heads.corpus import Corpus, build_corpus
from speccli.drafters.eagle_layer import EagleHead, OutputRows
from speccli.heads.features import extract
from speccli.drafters.medusa_heads import MedusaHeads
from speccli.heads.store import Heads, HeadsMismatch, load_heads, save_heads, target_identity
from speccli.heads.train import TrainConfig, Trainer
from speccli.drafters.draft_vocab import IGNORE, DraftVocab
from speccli.loop import SpeculativeDecoder
from test_decoder_greedy import PROMPTS, emitted, encode, target_greedy
from test_decoder_sampling import (
    ALPHABET,
    CONTINUATION,
    assert_follows,
    exact_continuation_distribution,
)

EOS = 2
TEXT = (
    "def add(a, b):\n    return a + b\n\n"
    "def mul(a, b):\n    return a * b\n\n"
    "for i in range(10):\n    print(add(i, i))\n"
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n"
) * 40


# --------------------------------------------------------------------------- vocabulary


def test_draft_vocab_keeps_the_most_frequent_ids_and_maps_back():
    labels = torch.tensor([5, 5, 5, 2, 2, 9, 7, 7, 7, 7])
    vocab = DraftVocab.most_frequent(labels, 3, target_size=12)
    assert vocab.ids.tolist() == [7, 5, 2]
    assert vocab.index_of(torch.tensor([7, 2, 9, 0])).tolist() == [0, 2, IGNORE, IGNORE]
    assert vocab.coverage(labels) == pytest.approx(0.9)
    full = vocab.to_target(torch.tensor([0.5, 1.5, -1.0]))
    assert full.shape == (12,) and full[7] == 0.5 and full[5] == 1.5 and full[2] == -1.0
    assert torch.isinf(full[[0, 1, 3, 4, 6, 8, 9, 10, 11]]).all()
    with pytest.raises(ValueError, match="distinct"):
        DraftVocab(torch.tensor([1, 1]), 4)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        DraftVocab(torch.tensor([4]), 4)


def test_draft_vocab_is_filled_from_more_text_past_the_labels_distinct_ids():
    labels = torch.tensor([5, 5, 2])
    fill = torch.tensor([9, 9, 9, 5, 5, 5, 5, 3, 3, 1])
    # The labels' ids first (by their own counts), then the text's others by count: 9, 3, 1.
    assert DraftVocab.most_frequent(labels, 4, 12, fill=fill).ids.tolist() == [5, 2, 9, 3]
    assert DraftVocab.most_frequent(labels, 9, 12, fill=fill).ids.tolist() == [5, 2, 9, 3, 1]
    assert DraftVocab.most_frequent(labels, 2, 12, fill=fill).ids.tolist() == [5, 2]
    assert DraftVocab.most_frequent(labels, 4, 12).ids.tolist() == [5, 2]


# --------------------------------------------------------------------------- the target's features


@pytest.mark.parametrize("backend", [wrap, wrap_static], ids=["dynamic", "static"])
def test_backends_hand_out_the_hidden_states_their_logits_come_from(tokenizer, backend):
    model = tiny_llama(len(tokenizer), seed=3)
    lm = backend(model)
    lm.capture_hidden()
    ids = encode(tokenizer, "def fib(n): return n")
    lm.forward(ids[:-3], all_logits=False)  # a prompt: one row of logits, every row of features
    prompt_hidden = lm.last_hidden
    assert prompt_hidden.shape == (len(ids) - 3, 32)
    logits = lm.forward(ids[-3:])
    hidden = lm.last_hidden
    assert hidden.shape == (3, 32)
    with torch.no_grad():
        torch.testing.assert_close(model.lm_head(hidden).float(), logits)
        full = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    torch.testing.assert_close(torch.cat([prompt_hidden, hidden]), full, rtol=1e-4, atol=1e-4)


def test_hidden_states_must_be_asked_for(tokenizer):
    lm = wrap(tiny_llama(len(tokenizer), seed=3))
    lm.forward([5, 6])
    with pytest.raises(RuntimeError, match="capture_hidden"):
        lm.last_hidden


# --------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny target, its features over TEXT, and Medusa and EAGLE heads trained on them."""
    tokenizer = char_tokenizer()
    target = tiny_llama(len(tokenizer), seed=7, hidden=32, logit_scale=4.0)
    folder = tmp_path_factory.mktemp("text")
    (folder / "code.py").write_text(TEXT)
    corpus = build_corpus(tokenizer, 64 * 40, [folder], segment_tokens=64)
    features = extract(target, corpus, folder / "features")
    train_index, held_index = corpus.split()
    results = {}
    for kind, rate in (("medusa", 1e-2), ("eagle", 3e-3)):
        config = TrainConfig(kind, heads=3, vocab=40, epochs=20, batch_segments=4, learning_rate=rate)
        trainer = Trainer(
            config, target, features.select(train_index), features.select(held_index), folder / f"{kind}.ckpt"
        )
        trainer.run()
        results[kind] = trainer
    return tokenizer, target, corpus, features, results


def test_corpus_segments_and_held_out_split(trained):
    _, _, corpus, features, _ = trained
    assert len(corpus.segments) == 40 and all(len(s) == 64 for s in corpus.segments)
    train, held = corpus.split()
    assert held == [19, 39] and len(train) == 38
    assert features.features.shape == (40, 64, 32) and features.labels.shape == (40, 64)


def test_features_are_the_targets_and_resume_from_disk(trained, tmp_path):
    tokenizer, target, corpus, features, _ = trained
    with torch.no_grad():
        ids = torch.tensor([corpus.segments[3]])
        hidden = target.model(input_ids=ids).last_hidden_state[0]
        labels = target.lm_head(hidden).argmax(-1)
    torch.testing.assert_close(features.features[3].float(), hidden, rtol=1e-2, atol=1e-2)
    assert torch.equal(features.labels[3], labels)
    calls = []
    again = extract(target, corpus, tmp_path / "f", progress=lambda done, total: calls.append(done))
    assert calls[-1] == corpus.tokens
    calls.clear()
    cached = extract(target, corpus, tmp_path / "f", progress=lambda done, total: calls.append(done))
    assert torch.equal(cached.features, again.features)
    assert len(calls) == 3  # three shards read back, no segment computed again


def test_unrolled_training_feeds_each_depth_what_decoding_feeds_it(trained):
    """Training-time test: the step-s prediction at position t equals the head run as the
    drafter runs it, over a cache of real entries up to t - s + 1, then its s - 1 drafted
    ancestors, each fed the feature the one before it predicted."""
    from speccli.heads.train import eagle_unrolled

    tokenizer, target, corpus, features, results = trained
    head = results["eagle"].module.eval()
    embeddings = target.get_input_embeddings()
    real = features.features[:2, :24].float()
    tokens = features.tokens[:2, :24]
    with torch.no_grad():
        unrolled = eagle_unrolled(head, embeddings, real, tokens, 3)
        assert torch.allclose(unrolled[0], eagle_unrolled(head, embeddings, real, tokens, 1)[0], atol=1e-5)
        for b, t, steps in ((0, 9, 2), (1, 15, 3), (0, 20, 3), (1, 2, 2)):
            from transformers import DynamicCache

            cache = DynamicCache(config=head.body.config)
            first = t - steps + 1  # the last real entry the chain sees
            embedded = embeddings(tokens[b : b + 1, 1 : first + 2]).float()
            feature = head(real[b : b + 1, : first + 1], embedded, torch.arange(first + 1)[None], cache=cache)[0, -1]
            for depth in range(2, steps + 1):
                position = first + depth - 1
                embedded = embeddings(tokens[b : b + 1, position + 1 : position + 2]).float()
                feature = head(feature[None, None], embedded, torch.tensor([[position]]), cache=cache)[0, -1]
            torch.testing.assert_close(unrolled[steps - 1][b, t], feature, atol=1e-4, rtol=1e-4)


def test_chain_hits_count_a_depth_only_where_the_guesses_before_it_were_right():
    from speccli.heads.train import chain_hits

    labels = torch.tensor([[1, 2, 3, 4, 5]])
    first = torch.tensor([[1, 2, 0, 4, 5]])  # wrong at t = 2
    second = torch.tensor([[9, 2, 3, 4, 0]])  # its chain at t reads first's guess at t - 1
    # Depth 2 has chances at t = 1, 2, 4 (a right first at t - 1) and hits at 1 and 2; t = 3's hit does not count.
    assert chain_hits([first, second], labels) == [(4, 5), (2, 3)]


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_training_lowers_the_loss_and_measures_held_out_accuracy(trained, kind):
    trainer = trained[4][kind]
    assert trainer.losses[-1] < 0.8 * trainer.losses[0], trainer.losses
    accuracy = trainer.accuracy()
    assert len(accuracy) == 3  # Medusa: per head; EAGLE: per depth
    assert all(0.0 <= a <= 1.0 for a in accuracy)
    # Far better than the heads it started from (Medusa: the target's own next-token
    # guess standing in for the token after it; EAGLE: the target's top layer).
    tokenizer, target, corpus, features, _ = trained
    train_index, held_index = corpus.split()
    untrained = Trainer(
        trainer.config, target, features.select(train_index), features.select(held_index), trainer.checkpoint
    )
    before = untrained.accuracy()
    assert accuracy[0] > before[0] + 0.1, (before, accuracy)


def test_an_interrupted_training_resumes_from_its_checkpoint(trained, tmp_path, monkeypatch):
    tokenizer, target, corpus, features, _ = trained
    train_index, held_index = corpus.split()
    config = TrainConfig("medusa", heads=2, vocab=40, epochs=2, batch_segments=4)
    checkpoint = tmp_path / "medusa.ckpt"
    first = Trainer(config, target, features.select(train_index), features.select(held_index), checkpoint)

    def interrupt(state):
        if state.step == 5:
            raise KeyboardInterrupt

    first.progress = interrupt
    with pytest.raises(KeyboardInterrupt):
        first.run()
    assert checkpoint.exists()
    second = Trainer(config, target, features.select(train_index), features.select(held_index), checkpoint)
    assert second.resume() and second.step == 5
    second.run()
    whole = Trainer(config, target, features.select(train_index), features.select(held_index), tmp_path / "other.ckpt")
    whole.run()
    for a, b in zip(second.module.state_dict().values(), whole.module.state_dict().values()):
        torch.testing.assert_close(a, b)
    # Another run's checkpoint is not taken.
    other = TrainConfig("medusa", heads=3, vocab=40, epochs=2, batch_segments=4)
    assert not Trainer(other, target, features.select(train_index), features.select(held_index), checkpoint).resume()


# --------------------------------------------------------------------------- saving and refusing


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_heads_round_trip_and_are_refused_for_another_target(trained, tmp_path, kind):
    tokenizer, target, _, _, results = trained
    trainer = results[kind]
    identity = target_identity(target, "tiny-target")
    path = save_heads(
        trainer.heads(identity, {"tokens": 2432, "accuracy": trainer.accuracy()}), tmp_path / f"{kind}.safetensors"
    )
    loaded = load_heads(path, target, "tiny-target", kind)
    assert loaded.kind == kind and torch.equal(loaded.vocab.ids, trainer.vocab.ids)
    assert loaded.training["tokens"] == 2432
    saved = load_file(str(path))
    for name, value in trainer.module.state_dict().items():
        if "embed_tokens" not in name:
            assert torch.equal(saved[f"head.{name}"], value)
    # The same weights in bfloat16 are the same target.
    load_heads(path, tiny_llama(len(tokenizer), seed=7, hidden=32, logit_scale=4.0).to(torch.bfloat16), "tiny", kind)
    other = tiny_llama(len(tokenizer), seed=8, hidden=32, logit_scale=4.0)
    with pytest.raises(HeadsMismatch, match="was trained for tiny-target, not other .*output weights differ") as error:
        load_heads(path, other, "other", kind)
    assert error.value.hint == f"train heads for this target: specgen train {kind} --target other"
    wider = tiny_llama(len(tokenizer), seed=7, hidden=48, logit_scale=4.0)
    with pytest.raises(HeadsMismatch, match="hidden_size 32 there, 48 here"):
        load_heads(path, wider, "wider", kind)
    with pytest.raises(HeadsMismatch, match=f"holds {kind} heads, not"):
        load_heads(path, target, "tiny-target", "eagle" if kind == "medusa" else "medusa")
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    with pytest.raises(HeadsMismatch, match="is not a heads file"):
        load_heads(tmp_path / "junk.safetensors", target, "tiny-target")


# --------------------------------------------------------------------------- drafting, lossless


def medusa_drafter(target, vocab: DraftVocab | None = None, heads: int = 3, seed: int = 0) -> MedusaDrafter:
    """Untrained heads whose blocks are random (not the identity they start as): guesses
    that are sometimes right, which is all losslessness needs."""
    size = target.config.vocab_size
    vocab = vocab or DraftVocab(torch.arange(size), size)
    torch.manual_seed(seed)
    module = MedusaHeads(target.config.hidden_size, len(vocab), heads)
    module.init_output(target.lm_head.weight.detach()[vocab.ids])
    with torch.no_grad():
        for block in module.blocks:
            block[0].linear.weight.normal_(0, 0.3)
    return MedusaDrafter(module, vocab, torch.float32)


def eagle_drafter(target, vocab: DraftVocab | None = None, seed: int = 0) -> EagleDrafter:
    size = target.config.vocab_size
    vocab = vocab or DraftVocab(torch.arange(size), size)
    torch.manual_seed(seed)
    head = EagleHead(target.config)
    head.init_from_target(target)
    rows = target.lm_head.weight.detach()[vocab.ids]
    return EagleDrafter(head, vocab, target.get_input_embeddings(), OutputRows(rows), dtype=torch.float32)


DRAFTERS = {"medusa": medusa_drafter, "eagle": eagle_drafter}


def trained_drafter(trained, kind: str):
    _, target, _, _, results = trained
    trainer = results[kind]
    if kind == "medusa":
        return MedusaDrafter(trainer.module, trainer.vocab, torch.float32)
    rows = target.lm_head.weight.detach()[trainer.vocab.ids]
    return EagleDrafter(
        trainer.module, trainer.vocab, target.get_input_embeddings(), OutputRows(rows), dtype=torch.float32
    )


CODE_PROMPTS = [
    "def add(a, b):\n",
    "for i in range(10):\n    print(",
    "class Point:\n    def",
    "def mul(a, b):\n    return",
]


@pytest.mark.parametrize("k, tree", [(1, False), (3, False), ("auto", False), (3, True), ("auto", True)])
@pytest.mark.parametrize("backend", [wrap, wrap_static], ids=["dynamic", "static"])
@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_head_drafts_equal_target_greedy(trained, kind, backend, k, tree):
    """Trained heads (a draft vocabulary of 40 of the 99 ids: the others are never
    proposed) on a target whose text they learned: drafts are accepted, and the output is
    the target's own, token for token; chains and trees."""
    tokenizer, target = trained[0], trained[1]
    decoder = SpeculativeDecoder(backend(target), tokenizer, [EOS], trained_drafter(trained, kind))
    accepted = 0
    branched = False
    for prompt in CODE_PROMPTS + PROMPTS[:6]:
        ids = encode(tokenizer, prompt)
        events = list(decoder.generate(ids, SamplingConfig(), SpecConfig(k=k, max_new_tokens=32, tree=tree)))
        assert emitted(events) == target_greedy(target, ids), prompt
        steps = [e for e in events if isinstance(e, StepEvent)]
        accepted += sum(e.accepted for e in steps)
        branched |= any(e.tree and e.fed > e.drafted + 1 for e in steps)
    if tree and k != "auto":
        assert branched  # some pass checked more than one chain
    if k != "auto":  # k auto may judge drafting on so tiny a model not worth it (its costs are timed)
        assert accepted > (0 if tree else 5)


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_every_tree_step_has_the_features_it_needs(trained, kind):
    """After a tree step the decoder hands over the path's features, then rolls the drafter
    back to the settled text: the feature of the last settled token must survive that, or
    the next tree is empty."""
    tokenizer, target = trained[0], trained[1]
    decoder = SpeculativeDecoder(wrap(target), tokenizer, [EOS], trained_drafter(trained, kind))
    ids = encode(tokenizer, CODE_PROMPTS[0])
    events = list(decoder.generate(ids, SamplingConfig(), SpecConfig(k=3, max_new_tokens=24, tree=True)))
    steps = [e for e in events if isinstance(e, StepEvent)]
    # (The last step may have no room left to draft.)
    assert len(steps) > 3 and all(e.tree and e.fed > 1 for e in steps[:-1]), [(e.fed, e.accepted) for e in steps]


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_head_drafters_count_the_seconds_of_their_own_passes(trained, kind):
    """The heads' passes are drafting work, as a draft model's backend passes are: the
    benchmark's time outside forward passes must not count them."""
    tokenizer, target = trained[0], trained[1]
    drafter = trained_drafter(trained, kind)
    decoder = SpeculativeDecoder(wrap(target), tokenizer, [EOS], drafter)
    ids = encode(tokenizer, CODE_PROMPTS[0])
    list(decoder.generate(ids, SamplingConfig(), SpecConfig(k=0, max_new_tokens=8)))
    assert drafter.forward_seconds == 0.0  # nothing drafted, no pass of the heads
    list(decoder.generate(ids, SamplingConfig(), SpecConfig(k=3, max_new_tokens=16)))
    chains = drafter.forward_seconds
    assert chains > 0.0
    list(decoder.generate(ids, SamplingConfig(), SpecConfig(k=3, max_new_tokens=16, tree=True)))
    assert drafter.forward_seconds > chains


def test_eagle_state_after_steps_equals_a_fresh_start(pairs, tokenizer):
    """The draft's cache after rollbacks and real features is what a fresh drafter builds
    from the same context: same draft, same q."""
    target = pairs[0].target
    drafter = eagle_drafter(target)
    decoder = SpeculativeDecoder(wrap(target), tokenizer, [EOS], drafter)
    ids = encode(tokenizer, "for i in range(10):")
    events = list(decoder.generate(ids, SamplingConfig(), SpecConfig(k=3, max_new_tokens=20)))
    context = ids + emitted(events)
    sampling = SamplingConfig(temperature=1.0, seed=5)
    kept = drafter.propose(context, 4, sampling, torch.Generator().manual_seed(1))

    fresh = eagle_drafter(target)
    lm = wrap(target)
    lm.capture_hidden()
    lm.forward(context[:-1], all_logits=False)
    fresh.start(context)
    fresh.observe_features(0, lm.last_hidden)
    new = fresh.propose(context, 4, sampling, torch.Generator().manual_seed(1))
    assert kept.tokens == new.tokens
    torch.testing.assert_close(kept.probs, new.probs, rtol=1e-4, atol=1e-5)
    # Features handed over again from an earlier position replace what was fed from there.
    drafter.observe_features(0, lm.last_hidden)
    again = drafter.propose(context, 4, sampling, torch.Generator().manual_seed(1))
    assert again.tokens == new.tokens
    torch.testing.assert_close(again.probs, new.probs, rtol=1e-4, atol=1e-5)


def test_a_second_generation_reuses_the_prompt_and_stays_exact(pairs, tokenizer):
    target = pairs[0].target
    for kind in DRAFTERS:
        decoder = SpeculativeDecoder(wrap(target), tokenizer, [EOS], DRAFTERS[kind](target))
        ids = encode(tokenizer, "def fib(n):")
        first = emitted(decoder.generate(ids, SamplingConfig(), SpecConfig(k=3, max_new_tokens=16)))
        longer = ids + first + encode(tokenizer, "\n#")
        second = emitted(decoder.generate(longer, SamplingConfig(), SpecConfig(k=3, max_new_tokens=16)))
        assert second == target_greedy(target, longer)[:16]


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_seeded_head_sampling_is_the_targets_own_sample(pairs, tokenizer, kind):
    target = pairs[0].target
    plain = SpeculativeDecoder(wrap(target), tokenizer, [EOS])
    spec = SpeculativeDecoder(wrap(target), tokenizer, [EOS], DRAFTERS[kind](target))
    sampling = SamplingConfig(temperature=0.8, seed=99)
    for prompt in PROMPTS[:6]:
        ids = encode(tokenizer, prompt)
        want = emitted(plain.generate(ids, sampling, SpecConfig(k=0, max_new_tokens=24)))
        assert emitted(spec.generate(ids, sampling, SpecConfig(k=3, max_new_tokens=24))) == want, prompt


@pytest.mark.slow
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_head_samples_follow_the_exact_target_distribution(kind, tree, monkeypatch):
    monkeypatch.setattr(decoder_module, "coupled", lambda sampling: False)
    tokenizer = char_tokenizer(ALPHABET)
    vocab = len(tokenizer)
    target = tiny_llama(vocab, seed=5, hidden=16, layers=1, logit_scale=6.0)
    drafter = DRAFTERS[kind](target, DraftVocab(torch.arange(2, vocab), vocab))
    assert_samples_follow_the_target(SpeculativeDecoder(wrap(target), tokenizer, [], drafter), target, tokenizer, tree)


def assert_samples_follow_the_target(decoder: SpeculativeDecoder, target, tokenizer, tree: bool) -> None:
    """Continuations of "abc" sampled at temperature 1 with k 2 follow the target's exact
    distribution, and every provenance (accepted, resampled, bonus) occurred."""
    vocab = len(tokenizer)
    prompt = tokenizer("abc", add_special_tokens=False)["input_ids"]
    sampling = SamplingConfig(temperature=1.0)
    spec = SpecConfig(k=2, max_new_tokens=CONTINUATION, tree=tree)
    draws = 5_000  # the first-token and first-two-tokens checks find a wrong rule from far fewer
    seeds = torch.Generator().manual_seed(4321)
    counts = torch.zeros(vocab**CONTINUATION, dtype=torch.long)
    provenances = collections.Counter()
    for _ in range(draws):
        seed = int(torch.randint(0, 2**62, (1,), generator=seeds))
        run = SamplingConfig(sampling.temperature, seed=seed)
        tokens = [e for e in decoder.generate(prompt, run, spec) if isinstance(e, TokenEvent)]
        index = 0
        for event in tokens:
            index = index * vocab + event.token_id
            provenances[event.provenance] += 1
        counts[index] += 1
    assert {Provenance.ACCEPTED, Provenance.RESAMPLED, Provenance.BONUS} <= set(provenances), provenances
    assert_follows(counts, exact_continuation_distribution(target, prompt, sampling), vocab)


def test_corpus_from_jsonl_and_refusals(tmp_path, tokenizer):
    data = tmp_path / "chats.jsonl"
    data.write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}\n'
        '{"prompt": "a", "response": "b"}\n{"text": "' + "x = 1\\n" * 200 + '"}\n'
    )
    corpus = build_corpus(tokenizer, 512, [data], segment_tokens=64)
    assert isinstance(corpus, Corpus) and corpus.tokens == 512
    from speccli.errors import UsageError

    with pytest.raises(UsageError, match="no such file or folder"):
        build_corpus(tokenizer, 512, [tmp_path / "missing"])
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(UsageError, match="bad.jsonl:1 is not JSON"):
        build_corpus(tokenizer, 512, [tmp_path / "bad.jsonl"])
    (tmp_path / "tiny.txt").write_text("ab")
    with pytest.raises(UsageError, match="no training text found"):
        build_corpus(tokenizer, 512, [tmp_path / "tiny.txt"], segment_tokens=64)


def test_default_corpus_is_the_standard_library(tokenizer):
    corpus = build_corpus(tokenizer, 4096, segment_tokens=256)
    assert corpus.tokens == 4096 and corpus.description.startswith("default")
    assert corpus.segments == build_corpus(tokenizer, 4096, segment_tokens=256).segments  # the same on every run


def test_heads_dataclass_state_names(trained):
    _, target, _, _, results = trained
    heads = results["eagle"].heads(target_identity(target, "t"), {})
    assert isinstance(heads, Heads)
    assert "vocab.ids" in heads.state() and not any("embed_tokens" in k for k in heads.state())
