"""Drafters that take turns (`--draft A+B`): every method mixed in one generation keeps the
target's own greedy tokens, its exact distribution when sampling, and its seeded sample."""

from __future__ import annotations

import collections
import json

import pytest
import torch

import speccli.loop as decoder_module
from conftest import ON_CPU, char_tokenizer, perturbed_copy, tiny_llama, wrap
from speccli.autok.chooser import MethodChooser
from speccli.autok.plan import DraftSignal, Graft, StepPlan
from speccli.autok.policy import DraftLengthPolicy
from speccli.config import SamplingConfig, SpecConfig
from speccli.drafters.candidates import CandidateDrafter
from speccli.drafters.model import ModelDrafter
from speccli.drafters.ngram import PromptLookupDrafter
from speccli.events import StepEvent, TokenEvent
from speccli.loop import SpeculativeDecoder
from test_cli_generate import folders, invoke, reference_text
from test_decoder_greedy import EOS, MAX_NEW, PROMPTS, emitted, encode, target_greedy
from test_decoder_sampling import ALPHABET, CONTINUATION, assert_follows, exact_continuation_distribution


class Rotation(DraftLengthPolicy):
    """Each step the next of `plans` in turn: every method in one generation."""

    def __init__(self, plans: list[StepPlan]) -> None:
        self.plans = plans
        self.step = 0

    def plan(self, signal: DraftSignal, room: int, trees: bool) -> StepPlan:
        plan = self.plans[self.step % len(self.plans)]
        self.step += 1
        k = min(plan.k, room)
        graft = None if plan.graft is None or k == 0 else Graft(plan.graft.source, min(plan.graft.k, room))
        return StepPlan(k, tree=plan.tree and k > 0, source=plan.source if k > 0 else None, graft=graft)

    def next_k(self) -> int:
        raise AssertionError("plans whole steps")

    def observe(self, step: StepEvent) -> None:
        pass


ROTATION = [
    StepPlan(3, source="model"),
    StepPlan(4, source="ngram"),
    StepPlan(3, tree=True, source="model"),
    StepPlan(0),
    StepPlan(4, tree=True, source="ngram"),
    StepPlan(2, tree=True, source="model", graft=Graft("ngram", 4)),
]


def candidates(pair, tokenizer) -> CandidateDrafter:
    return CandidateDrafter([ModelDrafter(wrap(pair.draft), len(tokenizer)), PromptLookupDrafter()])


@pytest.mark.parametrize("pair_index", [0, 1])
def test_every_method_mixed_in_one_generation_equals_the_targets_greedy_output(pairs, tokenizer, pair_index):
    pair = pairs[pair_index]
    decoder = SpeculativeDecoder(wrap(pair.target), tokenizer, [EOS], candidates(pair, tokenizer))
    methods = collections.Counter()
    for prompt in PROMPTS:
        ids = encode(tokenizer, prompt)
        events = list(decoder.generate(ids, SamplingConfig(), SpecConfig(max_new_tokens=MAX_NEW), Rotation(ROTATION)))
        assert emitted(events) == target_greedy(pair.target, ids), prompt
        methods.update(e.method for e in events if isinstance(e, StepEvent))
    assert {"model chain", "model tree", "model tree+ngram", "plain"} <= set(methods), methods
    assert methods["ngram chain"] + methods["ngram tree"] > 0, methods


@pytest.mark.parametrize("tree", [False, True])
def test_k_auto_chooses_between_candidates_and_keeps_the_greedy_output(pairs, tokenizer, tree):
    pair = pairs[0]
    decoder = SpeculativeDecoder(wrap(pair.target), tokenizer, [EOS], candidates(pair, tokenizer))
    spec = SpecConfig(k="auto", max_new_tokens=MAX_NEW, tree=tree)
    policy = decoder.policy_for(spec).inner
    assert isinstance(policy, MethodChooser) and list(policy.policies) == ["model", "ngram"]
    assert decoder.policy_for(spec).inner is policy  # kept across generations, with what is over it
    assert decoder.policy_for(spec) is decoder.policy_for(spec)
    methods = collections.Counter()
    for prompt in PROMPTS:
        ids = encode(tokenizer, prompt)
        events = list(decoder.generate(ids, SamplingConfig(), spec))
        assert emitted(events) == target_greedy(pair.target, ids), prompt
        methods.update(e.method for e in events if isinstance(e, StepEvent))
    form = "tree" if tree else "chain"
    assert methods[f"model {form}"] > 0 and methods[f"ngram {form}"] > 0, methods
    # The first candidate's k auto is the decoder's own (what the next session inherits).
    assert decoder.learned() is not None and decoder.k_auto.kept is policy.policies["model"]


def test_a_fixed_k_drafts_with_prompt_lookup_where_its_match_is_long(pairs, tokenizer):
    pair = pairs[0]
    decoder = SpeculativeDecoder(wrap(pair.target), tokenizer, [EOS], candidates(pair, tokenizer))
    prompt = encode(tokenizer, "the cat sat on the mat. the cat sat on the")
    events = list(decoder.generate(prompt, SamplingConfig(), SpecConfig(k=4, max_new_tokens=MAX_NEW)))
    assert emitted(events) == target_greedy(pair.target, prompt)
    first = next(e for e in events if isinstance(e, StepEvent))
    assert first.method == "ngram chain"  # " the" ends the prompt and occurred before: a 3+ token match


@pytest.fixture(scope="module")
def lettered_pair():
    tokenizer = char_tokenizer(ALPHABET)
    target = tiny_llama(len(tokenizer), seed=5, hidden=16, layers=1, logit_scale=6.0)
    return tokenizer, target, perturbed_copy(target, noise=1.0, seed=6)


@pytest.mark.slow
@pytest.mark.parametrize(
    "sampling",
    [SamplingConfig(temperature=1.0, seed=97), SamplingConfig(temperature=0.7, top_p=0.9, seed=98)],
    ids=["t1", "t0.7-topp0.9"],
)
def test_switching_samples_follow_the_exact_target_distribution(lettered_pair, sampling, monkeypatch):
    monkeypatch.setattr(decoder_module, "coupled", lambda sampling: False)  # the rejection rule
    tokenizer, target, draft = lettered_pair
    vocab = len(tokenizer)
    # The prompt ends with a token seen before: prompt lookup has a guess on the first step.
    prompt = tokenizer("abcab", add_special_tokens=False)["input_ids"]
    drafter = CandidateDrafter([ModelDrafter(wrap(draft), vocab), PromptLookupDrafter()])
    decoder = SpeculativeDecoder(wrap(target), tokenizer, [], drafter)
    rotation = [
        StepPlan(2, source="ngram"),
        StepPlan(2, source="model"),
        StepPlan(2, tree=True, source="model"),
        StepPlan(1, tree=True, source="model", graft=Graft("ngram", 2)),
    ]
    seeds = torch.Generator().manual_seed(sampling.seed)
    counts = torch.zeros(vocab**CONTINUATION, dtype=torch.long)
    methods = collections.Counter()
    for draw in range(6_000):
        seed = int(torch.randint(0, 2**62, (1,), generator=seeds))
        run = SamplingConfig(sampling.temperature, sampling.top_k, sampling.top_p, seed=seed)
        # Each generation starts the rotation at another place: every method at every position.
        policy = Rotation(rotation[draw % 4 :] + rotation[: draw % 4])
        events = list(decoder.generate(prompt, run, SpecConfig(max_new_tokens=CONTINUATION), policy))
        methods.update(e.method for e in events if isinstance(e, StepEvent))
        index = 0
        for event in (e for e in events if isinstance(e, TokenEvent)):
            index = index * vocab + event.token_id
        counts[index] += 1
    assert {"ngram chain", "model chain", "model tree", "model tree+ngram"} <= set(methods), methods
    assert_follows(counts, exact_continuation_distribution(target, prompt, sampling), vocab)


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.8, 0.9)])
def test_a_seeded_sample_is_the_targets_own_whatever_drafts_it(pairs, tokenizer, temperature, top_p):
    pair = pairs[1]
    plain = SpeculativeDecoder(wrap(pair.target), tokenizer, [EOS])
    switching = SpeculativeDecoder(wrap(pair.target), tokenizer, [EOS], candidates(pair, tokenizer))
    for seed, prompt in enumerate(PROMPTS[:4]):
        ids = encode(tokenizer, prompt)
        sampling = SamplingConfig(temperature=temperature, top_p=top_p, seed=seed)
        spec = SpecConfig(max_new_tokens=24)
        alone = emitted(plain.generate(ids, sampling, spec))
        assert emitted(switching.generate(ids, sampling, spec, Rotation(ROTATION))) == alone, prompt


def test_candidates_need_two_drafters_of_different_names(pairs, tokenizer):
    with pytest.raises(ValueError, match="two or more"):
        CandidateDrafter([PromptLookupDrafter()])
    with pytest.raises(ValueError, match="two or more"):
        CandidateDrafter([PromptLookupDrafter(), PromptLookupDrafter()])


def test_draft_a_plus_ngram_is_the_targets_text_and_counts_each_method(folders):
    expected = reference_text(folders, "abcabc abcabc", 24)
    args = ["generate", "abcabc abcabc", "--target", folders["target"], "--draft", folders["draft"] + "+ngram"]
    result = invoke([*args, "-n", "24", "--k", "4", "--json", "-q", *ON_CPU, "--dtype", "float32"])
    assert result.exit_code == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["text"] == expected
    methods = payload["stats"]["steps_by_method"]
    assert sum(methods.values()) == payload["stats"]["steps"]
    assert methods.get("ngram chain", 0) > 0 and methods.get("model chain", 0) > 0, methods
    stats = invoke([*args, "-n", "24", "--k", "4", "--stats", *ON_CPU, "--dtype", "float32"])
    assert stats.exit_code == 0 and stats.stdout == expected
    assert "steps by method: " in stats.stderr


@pytest.mark.parametrize("suffix", ["+bogus", "+ngram+ngram", "+lookahead"])
def test_what_may_follow_a_plus_is_checked_in_one_line(folders, suffix):
    result = invoke(["generate", "hi", "--target", folders["target"], "--draft", folders["draft"] + suffix, *ON_CPU])
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert result.stderr.splitlines()[0].startswith(f"error: --draft {folders['draft']}{suffix}: after '+'")
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("draft", ["ngram+ngram", "lookahead+ngram", "none+ngram"])
def test_a_drafter_without_a_model_cannot_lead_others(folders, draft):
    result = invoke(["generate", "hi", "--target", folders["target"], "--draft", draft, *ON_CPU])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines()[0].startswith(f"error: --draft {draft}: ")
    assert "Traceback" not in result.stderr


def test_draft_auto_lets_suffix_drafting_take_turns_with_the_draft_it_picks_and_keeps_no_store(
    folders, monkeypatch, tmp_path
):
    from speccli.models.pairs.drafts import DraftChoice

    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))

    monkeypatch.setattr(
        "speccli.pipeline.choose_draft",
        lambda target, cuda=False, measured=None, trained=(): DraftChoice(folders["draft"], "picked"),
    )
    expected = reference_text(folders, "abcabc abcabc", 24)
    args = ["generate", "abcabc abcabc", "--target", folders["target"], "-n", "24", "--json", *ON_CPU]
    result = invoke([*args, "--dtype", "float32"])
    assert result.exit_code == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["text"] == expected
    assert payload["settings"]["drafter"] == "model+suffix" and payload["settings"]["tree"] == "auto"
    assert f"draft: {folders['draft']} and suffix, each step the one k auto expects more of" in result.stderr
    assert not (tmp_path / "cache" / "suffix").exists()  # the history of a one-shot run is not kept
    named = invoke([*args, "--draft", folders["draft"], "--dtype", "float32"])  # a draft given by hand drafts alone
    assert named.exit_code == 0 and json.loads(named.stdout)["settings"]["drafter"] == "model"


def test_prompt_lookup_says_how_its_guess_fared_in_a_step_another_drafted():
    from speccli.autok.plan import ShadowGuess

    lookup = PromptLookupDrafter()
    context = [1, 2, 3, 4, 1, 2]
    lookup.start(context)
    assert lookup.signal(context) == DraftSignal(match=2)  # it would guess 3 4 1 2 (after the earlier 1 2)
    context += [3, 4, 9]  # a step another drafter drafted settled three tokens: two as guessed, then not
    assert lookup.signal(context).shadow == ShadowGuess(match=2, compared=3, kept=2)
    context += [5]  # no n-gram ending in 4 9 occurred earlier: nothing was guessed
    assert lookup.signal(context).shadow is None
    context += [1, 2, 3]
    lookup.signal(context)  # guesses 4 9 5 1 2 3 after the earlier 1 2 3
    assert lookup.signal([*context, 4, 9]).shadow == ShadowGuess(match=3, compared=2, kept=2)  # all it could see


def test_the_guesses_of_steps_others_drafted_teach_prompt_lookups_k_auto():
    from speccli.autok.chooser import MethodChooser
    from speccli.autok.plan import ShadowGuess
    from speccli.autok.policy import AdaptiveDraftLength, DraftLengthByMatch

    model = AdaptiveDraftLength(max_k=8)
    lookup = DraftLengthByMatch(lambda match: AdaptiveDraftLength(max_k=8, prior_acceptance=0.3))
    chooser = MethodChooser({"model": model, "ngram": lookup})
    before = lookup.policy(3).acceptance()[0]
    right = DraftSignal(parts=(("model", DraftSignal()), ("ngram", DraftSignal(match=3, shadow=ShadowGuess(3, 4, 4)))))
    for number in range(10):
        chooser.plan(right, 16, False)
        chooser.observe(StepEvent(number, 4, 4, 0.0, 0.1, method="model chain"))
    assert lookup.policy(3).acceptance()[0] > max(before, 0.9)
    assert model.acceptance()[0] > 0.7  # the model's own steps, all accepted


def test_a_cheap_candidate_that_would_draft_too_is_grafted_into_the_chosen_ones_tree():
    from speccli.autok.policy import AdaptiveDraftLength, DraftLengthByMatch

    def seeded(policy):
        policy.costs.seed({fed: 1.0 + 0.01 * fed for fed in range(1, 20)}, draft_per_token=0.05)
        return policy

    model = seeded(AdaptiveDraftLength(max_k=8, prior_acceptance=0.9))
    lookup = seeded(DraftLengthByMatch(lambda match: AdaptiveDraftLength(max_k=8, prior_acceptance=0.6)))
    chooser = MethodChooser({"model": model, "ngram": lookup}, graftable=["ngram"])
    matched = DraftSignal(parts=(("model", DraftSignal()), ("ngram", DraftSignal(match=2))))
    plan = chooser.plan(matched, 16, True)
    assert plan.source == "model" and plan.graft is not None and plan.graft.source == "ngram"
    assert plan.graft.k == lookup.policy(2).next_k() > 0
    assert len(plan.graft.survival) == plan.graft.k and plan.graft.rate > 0
    assert 1 > plan.graft.survival[0] > plan.graft.survival[-1] > 0  # each token needs those before it
    # No match: prompt lookup would not draft, so nothing is grafted.
    assert chooser.plan(DraftSignal(parts=(("model", DraftSignal()), ("ngram", DraftSignal()))), 16, True).graft is None
    assert MethodChooser({"model": model, "ngram": lookup}).plan(matched, 16, True).graft is None  # none graftable

    # The model learns from its own nodes: 2 of its 3 deep; the graft's 3 more accepted are not its.
    chooser.plan(matched, 16, True)
    chooser.observe(StepEvent(1, 6, 5, 0.0, 0.1, fed=9, tree=True, own=(3, 2), method="model tree+ngram"))
    assert model._session_tried == [1, 1, 1, 0, 0, 0, 0, 0]  # nothing counted past its own depth
    assert model._session_kept == [1, 1, 0, 0, 0, 0, 0, 0]
