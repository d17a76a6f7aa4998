"""Suffix drafting (`--draft suffix`, speccli.drafters.suffix): guesses from the text so far and
the session's earlier texts, lossless, bounded, and kept across runs in the cache."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import speccli.loop as decoder_module
from conftest import ON_CPU, char_tokenizer, tiny_llama, wrap
from speccli.api import Speculator
from speccli.cli import app
from speccli.config import SamplingConfig, SpecConfig
from speccli.drafters.candidates import CandidateDrafter
from speccli.drafters.model import ModelDrafter
from speccli.drafters.suffix import (
    MIN_SHARE,
    Guess,
    SuffixDrafter,
    SuffixHistory,
    TokenIndex,
    bucket,
    chain,
    frequent_tree,
)
from speccli.events import Provenance, StepEvent
from speccli.loop import SpeculativeDecoder
from speccli.tree import ROOT
from test_cli_generate import folders, reference_text  # noqa: F401 - fixtures
from test_decoder_greedy import EOS, MAX_NEW, PROMPTS, emitted, encode, target_greedy
from test_decoder_sampling import (
    ALPHABET,
    CONTINUATION,
    assert_follows,
    continuation_counts,
    exact_continuation_distribution,
)


def steps(events) -> list[StepEvent]:
    return [e for e in events if isinstance(e, StepEvent)]


# -- the index and the guess ----------------------------------------------------------------


def test_the_index_finds_the_longest_match_latest_first_and_never_across_texts():
    index = TokenIndex()
    for text in ([1, 2, 3, 4, 5], [9, 2, 3, 4, 6], [7, 8, 2, 3, 4, 7]):
        index.extend(text)
        index.close()
    index.index_upto(len(index))
    # The tail 1 2 3 4: only the first text has it all; the others match 2 3 4 (the latest first).
    assert index.matches([1, 2, 3, 4]) == [(4, 4), (3, 17), (3, 10)]
    assert index.continuation(4, 5) == [5]  # stops at the end of its text
    assert index.matches([5, 1]) == [(1, 1)]  # no pair 5 1 (texts do not run into each other)
    assert index.matches([42]) == []
    index.truncate(6)
    index.index_upto(len(index))
    assert index.matches([2, 3]) == [(2, 3)]


def test_a_chain_follows_the_most_frequent_continuation_while_enough_share_it():
    guess = Guess(3, ((5, 6, 7), (5, 6, 8), (5, 9), (4,)))
    assert chain(guess, 8) == [5, 6, 7]  # 6 (2 of 4), then 7 and 8 tie: the latest occurrence's
    rare = Guess(2, tuple([(1, 2)] * 10 + [(3,)]))
    assert chain(rare, 1) == [1]
    assert 1 / 11 < MIN_SHARE
    assert (
        chain(
            Guess(
                2, ((1, 2), (3, 4), (5, 6), (7, 8), (9, 10), (11, 12), (13, 14), (15, 16), (17, 18), (19, 20), (21, 22))
            ),
            3,
        )
        == []
    )


def test_a_tree_takes_the_nodes_most_occurrences_reach_parents_first_most_frequent_sibling_first():
    guess = Guess(3, ((5, 6, 7), (4, 1), (5, 6, 8), (5, 9), (4, 2)))
    tree = frequent_tree(guess, depth=3, max_nodes=4)
    assert tree.tokens == [5, 4, 6, 1] and tree.parents == [ROOT, ROOT, 0, 1]
    deep = frequent_tree(guess, depth=2, max_nodes=10)
    assert sorted(zip(deep.tokens, deep.parents)) == sorted([(5, ROOT), (4, ROOT), (6, 0), (9, 0), (1, 1), (2, 1)])


def test_match_lengths_count_in_buckets():
    assert [bucket(m) for m in (0, 1, 2, 3, 4, 7, 8, 15, 16, 40)] == [0, 1, 2, 3, 4, 4, 8, 8, 16, 16]


def test_the_history_keeps_the_latest_texts_within_its_cap_and_in_its_store(tmp_path):
    from speccli.pipeline import stored_suffix_history

    store = tmp_path / "suffix" / "target.json"
    history = stored_suffix_history(store, "t 16", max_tokens=10)
    history.add([1, 2, 3, 4])
    history.add([5, 6, 7, 8])
    history.add([9, 10, 11])  # 11 tokens: the oldest text goes
    assert history.texts == [[5, 6, 7, 8], [9, 10, 11]]
    assert history.index.matches([6, 7]) == [(2, 3)]
    again = stored_suffix_history(store, "t 16", max_tokens=10)
    assert again.texts == history.texts and again.index.matches([6, 7]) == [(2, 3)]
    assert stored_suffix_history(store, "another tokenizer").texts == []
    store.write_text("{damaged")
    assert stored_suffix_history(store, "t 16").texts == []


def test_an_index_cut_back_finds_what_a_fresh_index_of_the_same_tokens_finds():
    tokens = [1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 2, 3]
    cut = TokenIndex(tokens)
    cut.index_upto(len(tokens))
    for length in (11, 7, 3, 1, 0):
        cut.truncate(length)
        fresh = TokenIndex(tokens[:length])
        fresh.index_upto(length)
        for suffix in ([1, 2], [2, 3], [3], [1], [2, 3, 1, 2]):
            assert cut.matches(suffix) == fresh.matches(suffix), (length, suffix)
        assert cut._pairs == fresh._pairs and cut._singles == fresh._singles


def test_a_chats_next_turn_takes_the_place_of_the_conversation_before_it():
    history = SuffixHistory()
    history.add([1, 2, 3])
    history.add([1, 2, 3, 4, 5])  # the same conversation, one turn on
    history.add([7, 8])
    assert history.texts == [[1, 2, 3, 4, 5], [7, 8]]
    assert history.index.matches([1, 2]) == [(2, 2)]  # counted once
    assert history.index.matches([4]) == [(1, 4)]


# -- lossless -------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [SpecConfig(k=4), SpecConfig(k="auto"), SpecConfig(k="auto", tree=True)])
def test_greedy_output_is_the_targets_own_and_a_repeated_request_is_drafted_from_the_answer_before(
    pairs, tokenizer, spec
):
    pair = pairs[0]
    drafter = SuffixDrafter()
    speculator = Speculator.over(wrap(pair.target), tokenizer, [EOS], drafter)
    spec = SpecConfig(k=spec.k, tree=spec.tree, max_new_tokens=MAX_NEW)
    for prompt in PROMPTS[:6]:
        ids = encode(tokenizer, prompt)
        first = speculator.stream(ids, SamplingConfig(), spec).run()
        assert first.token_ids == target_greedy(pair.target, ids), prompt
        assert drafter.history.texts[-1] == [*ids, *first.token_ids]
        again = speculator.stream(ids, SamplingConfig(), spec)
        events = [response.event for response in again]
        assert again.token_ids == first.token_ids
        drafted = sum(s.drafted for s in steps(events))
        if len(first.token_ids) >= 8:  # the answer before is the guess: most of it comes true
            assert sum(s.accepted for s in steps(events)) >= 0.8 * len(first.token_ids) - len(steps(events)), prompt
            assert drafted > 0


def test_prompt_lookup_within_the_text_so_far_keeps_the_greedy_output(pairs, tokenizer):
    for pair in pairs:
        decoder = SpeculativeDecoder(wrap(pair.target), tokenizer, [EOS], SuffixDrafter())
        for prompt in PROMPTS:
            ids = encode(tokenizer, prompt)
            for spec in (SpecConfig(k=3, max_new_tokens=MAX_NEW), SpecConfig(k="auto", max_new_tokens=MAX_NEW)):
                assert emitted(decoder.generate(ids, SamplingConfig(), spec)) == target_greedy(pair.target, ids)


@pytest.fixture(scope="module")
def lettered():
    tokenizer = char_tokenizer(ALPHABET)
    return tokenizer, tiny_llama(len(tokenizer), seed=5, hidden=16, layers=1, logit_scale=6.0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "sampling",
    [SamplingConfig(temperature=1.0, seed=61), SamplingConfig(temperature=0.7, top_p=0.9, seed=62)],
    ids=["t1", "t0.7-topp0.9"],
)
@pytest.mark.parametrize("tree", [False, True])
def test_samples_drafted_from_the_history_follow_the_exact_target_distribution(lettered, sampling, tree, monkeypatch):
    monkeypatch.setattr(decoder_module, "coupled", lambda sampling: False)  # the rejection rule
    tokenizer, target = lettered
    prompt = tokenizer("abcab", add_special_tokens=False)["input_ids"]
    history = SuffixHistory()
    for text in ("abcabcd", "cabce", "abcabcf", "bcabd"):  # several continuations of the prompt's tail
        history.add(tokenizer(text, add_special_tokens=False)["input_ids"])
    decoder = SpeculativeDecoder(wrap(target), tokenizer, [], SuffixDrafter(history))
    spec = SpecConfig(k=2, tree=tree, max_new_tokens=CONTINUATION)
    counts, provenances = continuation_counts(
        decoder, prompt, sampling, 6_000, sampling.seed * 10_000, len(tokenizer), spec
    )
    assert provenances[Provenance.ACCEPTED] > 300, provenances
    assert_follows(counts, exact_continuation_distribution(target, prompt, sampling), len(tokenizer))


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.8, 0.9)])
def test_a_seeded_sample_is_the_targets_own_whatever_the_history_guesses(pairs, tokenizer, temperature, top_p):
    pair = pairs[1]
    plain = SpeculativeDecoder(wrap(pair.target), tokenizer, [EOS])
    history = SuffixHistory()
    for prompt in PROMPTS:
        history.add(encode(tokenizer, prompt + prompt))
    suffix = SpeculativeDecoder(wrap(pair.target), tokenizer, [EOS], SuffixDrafter(history))
    for seed, prompt in enumerate(PROMPTS[:4]):
        ids = encode(tokenizer, prompt)
        sampling = SamplingConfig(temperature=temperature, top_p=top_p, seed=seed)
        for spec in (SpecConfig(k=3, max_new_tokens=24), SpecConfig(k=3, tree=True, max_new_tokens=24)):
            assert emitted(suffix.generate(ids, sampling, spec)) == emitted(plain.generate(ids, sampling, spec))


def test_suffix_drafting_takes_turns_with_a_draft_and_both_learn(pairs, tokenizer):
    pair = pairs[0]
    suffix = SuffixDrafter()
    drafter = CandidateDrafter([ModelDrafter(wrap(pair.draft), len(tokenizer)), suffix])
    speculator = Speculator.over(wrap(pair.target), tokenizer, [EOS], drafter)
    ids = encode(tokenizer, PROMPTS[4])
    spec = SpecConfig(k=4, max_new_tokens=MAX_NEW)
    first = speculator.stream(ids, SamplingConfig(), spec).run()
    again = speculator.stream(ids, SamplingConfig(), spec)
    methods = {response.event.method for response in again if isinstance(response.event, StepEvent)}
    assert first.token_ids == again.token_ids == target_greedy(pair.target, ids)
    assert suffix.history.texts == [[*ids, *first.token_ids]]  # the same text again is kept once
    assert "suffix chain" in methods  # the repeated request: a long match, suffix drafting's


def test_bench_learns_each_prompt_once_after_its_runs_so_no_run_drafts_from_another(pairs, tokenizer):
    from speccli.bench.prompts import BenchPrompt
    from speccli.bench.results import BenchSettings
    from speccli.bench.runner import BenchRunner

    pair = pairs[0]
    suffix = SuffixDrafter()
    runner = BenchRunner(
        Speculator.over(wrap(pair.target), tokenizer, [EOS], suffix),
        None,
        BenchSettings(max_new_tokens=MAX_NEW, ks=(4,), repeat=2, warmup=True),
    )
    prompts = [BenchPrompt("a", text=PROMPTS[4]), BenchPrompt("b", text=PROMPTS[1])]
    rows = runner.run(prompts).rows
    encoded = [runner.encode(prompt) for prompt in prompts]
    assert suffix.history.texts == [[*encoded[0], *rows[0].plain.token_ids], [*encoded[1], *rows[2].plain.token_ids]]
    for first, second in (rows[:2], rows[2:]):  # a repeat drafts from the same history as the run before it
        assert (first.spec.stats.steps, first.spec.stats.accepted) == (
            second.spec.stats.steps,
            second.spec.stats.accepted,
        )


# -- the command line -----------------------------------------------------------------------


def test_generate_with_draft_suffix_keeps_its_history_in_the_cache_unless_told_not_to(folders, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))
    args = [
        "generate",
        "def fib(n):",
        "--target",
        folders["target"],
        "--draft",
        "suffix",
        *ON_CPU,
        "-n",
        "32",
        "--k",
        "4",
    ]
    expected = reference_text(folders, "def fib(n):", 32)
    first = CliRunner().invoke(app, [*args, "--json", "-q"])
    assert first.exit_code == 0, first.output
    assert json.loads(first.stdout)["text"] == expected
    stores = list((tmp_path / "cache" / "suffix").glob("*.json"))
    assert len(stores) == 1 and len(json.loads(stores[0].read_text())["texts"]) == 1
    again = CliRunner().invoke(app, [*args, "--json", "-q"])
    payload = json.loads(again.stdout)
    assert payload["text"] == expected
    # The second run drafts the first run's answer: nearly every token accepted.
    assert payload["stats"]["accepted"] >= 0.8 * 32 - payload["stats"]["steps"]
    kept = stores[0].read_text()
    assert len(json.loads(kept)["texts"]) == 1  # the same text again is kept once
    other = [*args[:1], "class Point:", *args[2:]]
    unkept = CliRunner().invoke(app, [*other, "--no-cache", "-q"])
    assert unkept.exit_code == 0 and unkept.stdout == reference_text(folders, "class Point:", 32)
    assert stores[0].read_text() == kept
