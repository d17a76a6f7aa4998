"""The upfront cost calibration: what it measures, how it seeds k=auto, and its cache."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import save_model_folder, wrap
from speccli import calibration as calibration_cache
from speccli.autok.costs import CostCurve, measure_costs
from speccli.autok.policy import AdaptiveDraftLength
from speccli.calibration import (
    calibrate,
    calibration_identity,
    calibration_path,
    draft_cost_path,
    draft_identity,
    prior_identity,
)
from speccli.config import LoadConfig, SamplingConfig, SpecConfig
from speccli.drafters.model import ModelDrafter
from speccli.events import StepEvent
from speccli.loop import SpeculativeDecoder
from speccli.pipeline import load_pipeline

STEEP = CostCurve({n: 0.1 * n for n in range(1, 10)}, 0.05)  # float32 on a CPU, roughly
FLAT = CostCurve({n: 0.2 for n in range(1, 10)}, 0.01)  # bfloat16 here, roughly


def test_measure_costs_times_every_size_and_leaves_the_caches_empty(pairs):
    target, draft = wrap(pairs[0].target), wrap(pairs[0].draft)
    costs = measure_costs(target, draft, max_fed=5, repeats=1, context_tokens=8)
    assert sorted(costs.verify_seconds) == [1, 2, 3, 4, 5]
    assert all(seconds > 0 for seconds in costs.verify_seconds.values())
    assert costs.draft_seconds is not None and costs.draft_seconds > 0
    assert list(target.cached_tokens) == [] and list(draft.cached_tokens) == []


def test_measure_costs_without_a_draft_model(pairs):
    costs = measure_costs(wrap(pairs[0].target), None, max_fed=2, repeats=1, context_tokens=4)
    assert sorted(costs.verify_seconds) == [1, 2] and costs.draft_seconds is None


def test_measure_costs_times_each_size_beside_a_one_token_pass_and_alternates_the_order(pairs, monkeypatch):
    from speccli.autok import costs as calibration

    order: list[int] = []
    # A spell that slows the machine down for a moment slows both passes of a pair: the
    # four-token passes of rounds 1 and 2 and the one-token passes just before them (calls
    # 4-5 and 8-9, counting from 1) run 1.5x slower.
    slowed = {4, 5, 8, 9}

    def timed(model, settled, tokens):
        order.append(len(tokens))
        return (0.1 + 0.01 * len(tokens)) * (1.5 if len(order) in slowed else 1)

    monkeypatch.setattr(calibration, "_seconds", timed)
    costs = measure_costs(wrap(pairs[0].target), None, max_fed=4, repeats=3, context_tokens=4, sizes=[1, 4])
    # A warm-up round, then three, each the other way round; every size right after one token.
    assert order == [1, 1, 4] + [1, 4, 1] + [1, 1, 4] + [1, 4, 1]
    assert costs.verify_seconds == pytest.approx({1: 0.11, 4: 0.14})  # the ratio of each pair: 0.14 / 0.11


def test_measure_costs_takes_the_curve_from_pairs_not_from_moments_that_never_met(pairs, monkeypatch):
    from speccli.autok import costs as calibration

    # Calls in order, sizes [1, 4]: round 0 (warm-up) 1 | 1 4; round 1: 1 4 | 1; round 2: 1 | 1 4;
    # round 3: 1 4 | 1. The machine is quiet only for the lone one-token passes of rounds 1 and 3
    # (calls 5 and 11) and 1.5x slower for everything else: the fastest of each size taken alone
    # would say four tokens cost 3x one; every pair says 2x.
    calls: list[int] = []

    def timed(model, settled, tokens):
        calls.append(len(tokens))
        return {1: 0.1, 4: 0.2}[len(tokens)] * (1.0 if len(calls) - 1 in (5, 11) else 1.5)

    monkeypatch.setattr(calibration, "_seconds", timed)
    costs = measure_costs(wrap(pairs[0].target), None, max_fed=4, repeats=3, context_tokens=4, sizes=[1, 4])
    assert calls == [1, 1, 4, 1, 4, 1, 1, 1, 4, 1, 4, 1]
    assert costs.verify_seconds == pytest.approx({1: 0.1, 4: 0.2})


def test_measure_costs_takes_eight_rounds_after_the_warm_up_by_default(pairs, monkeypatch):
    # Three rounds put a 16-token pass anywhere from 1.37x to 1.59x a one-token pass on a
    # 2-core AMD EPYC; lookahead's shape turns on such ratios.
    from speccli.autok import costs as calibration

    calls: list[int] = []

    def timed(model, settled, tokens):
        calls.append(len(tokens))
        return 0.1 * len(tokens)

    monkeypatch.setattr(calibration, "_seconds", timed)
    rounds: list[tuple[int, int]] = []
    measure_costs(wrap(pairs[0].target), None, max_fed=2, context_tokens=4, on_round=lambda *done: rounds.append(done))
    assert len(calls) == (1 + 8) * (1 + 2)  # rounds x (size 1 alone, size 2 after one token)
    assert rounds == [(done, 8) for done in range(9)]  # 0: the warm-up


def test_round_progress_says_the_time_left_after_the_first_round_then_every_twenty_seconds():
    from speccli.calibration import RoundProgress

    now = [100.0]
    said: list[str] = []
    progress = RoundProgress(said.append, clock=lambda: now[0])
    progress(0, 8)  # the warm-up ends: the rounds are timed from here
    for done in range(1, 9):
        now[0] += 6.0
        progress(done, 8)
    assert said == [
        "calibrating: round 1 of 8 done, about 42 s left",
        "calibrating: round 5 of 8 done, about 18 s left",
    ]


def test_measure_costs_over_chosen_sizes(pairs):
    target = wrap(pairs[0].target)
    costs = measure_costs(target, None, max_fed=12, repeats=1, context_tokens=4, sizes=[12, 1, 4, 4])
    assert sorted(costs.verify_seconds) == [1, 4, 12] and list(target.cached_tokens) == []
    with pytest.raises(ValueError, match="sizes must lie in 1..8"):
        measure_costs(target, None, max_fed=8, repeats=1, sizes=[4, 12])


class AsyncDevice:
    """A backend that says it runs on CUDA: its passes must be waited for before timing."""

    def __init__(self, model, log: list[str]) -> None:
        self.model, self.log = model, log

    device = property(lambda self: torch.device("cuda", 0))
    vocab_size = property(lambda self: self.model.vocab_size)
    cached_tokens = property(lambda self: self.model.cached_tokens)

    def forward(self, token_ids, all_logits=True):
        self.log.append("forward")
        return self.model.forward(token_ids, all_logits)

    def rollback(self, length):
        self.model.rollback(length)


def test_measure_costs_waits_for_each_cuda_pass_before_reading_the_clock(pairs, monkeypatch):
    log: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append(f"wait {device}"))
    measure_costs(AsyncDevice(wrap(pairs[0].target), log), None, max_fed=2, repeats=1, context_tokens=4)
    timed = log[1:]  # after the untimed prefill of the context
    assert timed == ["forward", "wait cuda:0"] * 6  # (1 + (1 + 2)) passes x (1 warm-up + 1 repeat)


def test_cost_profile_round_trips_and_refuses_nonsense():
    assert CostCurve.from_dict(json.loads(json.dumps(STEEP.as_dict()))) == STEEP
    with pytest.raises(ValueError):
        CostCurve.from_dict({"verify_seconds": {}, "draft_seconds": None})
    with pytest.raises(ValueError):
        CostCurve.from_dict({"verify_seconds": {"1": 0.0}, "draft_seconds": None})
    with pytest.raises(ValueError):
        CostCurve.from_dict({"verify_seconds": {"1": 0.1}, "draft_seconds": -1})


def seeded(costs: CostCurve) -> AdaptiveDraftLength:
    policy = AdaptiveDraftLength(max_k=8)
    policy.costs.seed(costs.verify_seconds, costs.draft_seconds)
    return policy


def test_a_pass_of_an_unmeasured_size_is_interpolated_or_continued_and_passes_are_summed():
    costs = CostCurve({1: 0.2, 2: 0.16, 4: 0.2, 8: 0.28}, None)
    assert costs.interpolated(2) == 0.16
    assert costs.interpolated(3) == pytest.approx(0.18)  # between 2 and 4
    assert costs.interpolated(12) == pytest.approx(0.36)  # 0.02 a token, as from 4 to 8
    assert CostCurve({2: 0.2}, None).interpolated(1) == pytest.approx(0.1)
    assert costs.modelled_seconds({1: 10, 3: 2, 12: 1}) == pytest.approx(2.0 + 0.36 + 0.36)


def test_seeded_policy_decides_from_the_first_step():
    assert AdaptiveDraftLength(max_k=8).next_k() == 4  # unseeded: a guess, then explore
    assert seeded(STEEP).next_k() == 0  # a pass over n tokens costs n passes: never draft
    assert seeded(FLAT).next_k() >= 4  # verifying more costs nothing: draft long


def test_seeded_costs_still_learn_from_steps():
    policy = seeded(FLAT)
    for _ in range(20):
        policy.observe(StepEvent(1, 0, 0, 0.0, 2.0))  # plain steps turn out 10x dearer
    assert policy.costs.verify_seconds(1) > 1.5


def test_decoder_with_steep_costs_decodes_plainly_from_the_start(pairs, tokenizer):
    pair = pairs[0]
    drafter = ModelDrafter(wrap(pair.draft), len(tokenizer))
    decoder = SpeculativeDecoder(wrap(pair.target), tokenizer, [2], drafter, costs=STEEP)
    events = list(
        decoder.generate(tokenizer("abc")["input_ids"], SamplingConfig(), SpecConfig(k="auto", max_new_tokens=8))
    )
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert steps and all(s.drafted == 0 for s in steps)


@pytest.fixture(scope="module")
def folders(pairs, tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("calibration-models")
    return (
        str(save_model_folder(pairs[0].target, tokenizer, root / "target")),
        str(save_model_folder(pairs[0].draft, tokenizer, root / "draft")),
    )


def pipeline_for(folders, draft: str | None = None):
    target, draft_folder = folders
    return load_pipeline(
        target, draft or draft_folder, LoadConfig("cpu", "float32"), LoadConfig("cpu", "float32", for_draft=True)
    )


def test_calibrate_measures_once_then_reads_the_cache(folders, tmp_path, monkeypatch):
    pipeline = pipeline_for(folders)
    messages: list[str] = []
    costs = calibrate(pipeline, max_k=3, progress=messages.append, refresh=True, cache_dir=tmp_path)
    assert sorted(costs.verify_seconds) == [1, 2, 3, 4] and costs.draft_seconds > 0
    assert pipeline.decoder.costs == costs
    assert messages[0].startswith("calibrating: timing") and messages[-1].startswith("calibrated in")
    assert messages[1].startswith("calibrating: round 1 of 8 done, about ") and len(messages) == 3
    path = calibration_path(calibration_identity(pipeline, 4), tmp_path)
    assert "samples" not in json.loads(path.read_text())  # the full table: complete
    assert json.loads(path.read_text())["costs"]["draft_seconds"] is None  # the target's passes alone
    drafted = draft_cost_path(draft_identity(pipeline.draft), tmp_path)
    assert json.loads(drafted.read_text())["identity"]["draft"]["quant"] == "int8"
    assert json.loads(drafted.read_text())["draft_seconds"] == costs.draft_seconds

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured although the calibration was cached")

    monkeypatch.setattr(calibration_cache, "measure_costs", no_measuring)
    again = pipeline_for(folders)
    messages.clear()
    assert calibrate(again, max_k=3, progress=messages.append, cache_dir=tmp_path) == costs
    assert messages == [] and again.decoder.costs == costs

    monkeypatch.setattr(calibration_cache, "measure_costs", lambda *a, **k: STEEP)
    assert calibrate(again, max_k=3, refresh=True, cache_dir=tmp_path) == STEEP
    assert calibrate(again, max_k=8, cache_dir=tmp_path) == STEEP  # another max_k: another entry
    assert len(list((tmp_path / "calibration").glob("*.json"))) == 2

    # Passes whose rows go to other kernels (float32's stock rows) cost otherwise: measured again
    # (the target's; the draft's token stays as measured with STEEP).
    again.target.stock_rows = {"64x32": 4}
    assert calibration_identity(again, 4)["target"]["stock_rows"] == {"64x32": 4}
    monkeypatch.setattr(calibration_cache, "measure_costs", lambda *a, **k: FLAT)
    assert calibrate(again, max_k=3, cache_dir=tmp_path) == CostCurve(FLAT.verify_seconds, STEEP.draft_seconds)


def test_a_damaged_cache_file_is_measured_again(folders, tmp_path, monkeypatch):
    pipeline = pipeline_for(folders)
    path = calibration_path(calibration_identity(pipeline, 4), tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    monkeypatch.setattr(calibration_cache, "measure_costs", lambda *a, **k: FLAT)
    assert calibrate(pipeline, max_k=3, cache_dir=tmp_path) == FLAT
    assert CostCurve.from_dict(json.loads(path.read_text())["costs"]) == CostCurve(FLAT.verify_seconds, None)


def test_prompt_lookup_is_calibrated_without_a_draft_pass_and_plain_not_at_all(folders, tmp_path):
    ngram = pipeline_for(folders, draft="ngram")
    costs = calibrate(ngram, max_k=2, cache_dir=tmp_path)
    assert sorted(costs.verify_seconds) == [1, 2, 3] and costs.draft_seconds is None
    assert calibrate(pipeline_for(folders, draft="none"), max_k=2, cache_dir=tmp_path) is None


def test_the_target_is_calibrated_once_for_every_drafter_and_a_draft_model_times_only_its_token(
    folders, tmp_path, monkeypatch
):
    ngram = pipeline_for(folders, draft="ngram")
    costs = calibrate(ngram, max_k=2, cache_dir=tmp_path)
    assert costs.draft_seconds is None

    def no_target_passes(*args, **kwargs):
        raise AssertionError("timed the target's passes again for another drafter")

    monkeypatch.setattr(calibration_cache, "measure_costs", no_target_passes)
    timed: list[object] = []
    monkeypatch.setattr(calibration_cache, "measure_draft_seconds", lambda draft: timed.append(draft) or 0.02)
    with_draft = pipeline_for(folders)
    messages: list[str] = []
    assert calibrate(with_draft, max_k=2, progress=messages.append, cache_dir=tmp_path) == CostCurve(
        costs.verify_seconds, 0.02
    )
    assert timed == [with_draft.decoder.drafter.model]
    assert messages[0] == "calibrating: timing one draft token (the target's passes are calibrated already)"
    assert messages[1].startswith("calibrated in") and messages[1].endswith("a draft token 20 ms")
    # Both cached now: nothing is timed, nothing said.
    messages.clear()
    assert calibrate(pipeline_for(folders), max_k=2, progress=messages.append, cache_dir=tmp_path).draft_seconds == 0.02
    assert timed == [with_draft.decoder.drafter.model] and messages == []
    # --recalibrate times both again.
    monkeypatch.setattr(calibration_cache, "measure_costs", lambda *a, **k: STEEP)
    assert calibrate(pipeline_for(folders), max_k=2, refresh=True, cache_dir=tmp_path) == STEEP


def test_drafters_without_a_model_share_one_calibration_and_keep_their_priors_apart(folders, tmp_path, monkeypatch):
    from speccli.autok.policy import AcceptancePrior
    from speccli.calibration import prior_path

    ngram = pipeline_for(folders, draft="ngram")
    costs = calibrate(ngram, max_k=2, cache_dir=tmp_path)

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured although the target's passes were calibrated for prompt lookup")

    monkeypatch.setattr(calibration_cache, "measure_costs", no_measuring)
    lookahead = pipeline_for(folders, draft="lookahead")
    assert calibrate(lookahead, max_k=2, cache_dir=tmp_path) == costs
    assert lookahead.decoder.prior is None  # prompt lookup's prior is not lookahead's
    assert len(list((tmp_path / "calibration").glob("*.json"))) == 1

    # Each drafter's learned acceptance lies under its own key.
    assert prior_identity(ngram, 3)["draft"] == "ngram" and prior_identity(lookahead, 3)["draft"] == "lookahead"
    learned = AcceptancePrior((0.5, 0.25), 10.0)
    monkeypatch.setattr(type(ngram.decoder), "learned", lambda self: learned)
    calibration_cache.remember(ngram, max_k=2, cache_dir=tmp_path)
    assert prior_path(calibration_path(prior_identity(ngram, 3), tmp_path)).exists()
    again = pipeline_for(folders, draft="ngram")
    calibrate(again, max_k=2, cache_dir=tmp_path)
    assert again.decoder.prior == learned
    third = pipeline_for(folders, draft="lookahead")
    calibrate(third, max_k=2, cache_dir=tmp_path)
    assert third.decoder.prior is None


def test_the_learned_acceptance_is_kept_beside_the_calibration_and_seeds_the_next_session(
    folders, tmp_path, monkeypatch
):
    from speccli.autok.policy import AcceptancePrior
    from speccli.calibration import prior_path, read_prior, remember

    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(calibration_cache, "measure_costs", lambda *a, **k: FLAT)
    pipeline = pipeline_for(folders)
    generator = pipeline.speculator(recalibrate=True)  # a complete table: the generation leaves it as it is
    auto = SpecConfig(k="auto", max_new_tokens=16)
    assert remember(pipeline, auto.max_k) is None  # nothing learned yet: nothing written
    generator.stream([5, 6, 7], SamplingConfig(), auto).run()
    assert pipeline.decoder.prior is None  # the first session starts from the default
    identity = prior_identity(pipeline, auto.max_k + 1)
    path = prior_path(calibration_path(identity))
    saved = read_prior(path, identity)
    learned = pipeline.decoder.learned()
    assert learned.opening is not None  # the generation's opening drafted (no costs yet: k 4)
    assert saved is not None and saved == AcceptancePrior(
        tuple(round(a, 4) for a in learned.acceptance),
        learned.steps,
        opening=AcceptancePrior(tuple(round(a, 4) for a in learned.opening.acceptance), learned.opening.steps),
        methods=learned.methods,
    )
    assert saved.steps > 0 and len(saved.acceptance) == 8  # FLAT measured passes over up to 9 tokens
    assert {way for way, _, _ in saved.methods} == {"model chain", "model tree"}  # --tree auto tried both

    # The next session reads it back with the calibration, and its policy starts from it.
    again = pipeline_for(folders)
    policy_generator = again.speculator()
    policy_generator.calibrate(auto.max_k)
    assert again.decoder.prior == saved
    policy = again.decoder.policy_for(auto).inner
    assert policy.prior == list(saved.acceptance) and policy.prior_steps == saved.steps
    assert AcceptancePrior((policy.opening_prior,), policy.opening_prior_steps) == saved.opening
    # And how each way of drafting paid, worth a few steps (speccli.autok.measured.PRIOR_STEPS).
    seeded = again.decoder.method_rates.ways
    for way, gain, steps in saved.methods:
        assert seeded[way].gain == pytest.approx(gain) and seeded[way].steps == min(steps, 6.0)

    # Damaged or foreign files are ignored: the default prior, and the costs still load.
    for damage in (
        "{not json",
        json.dumps({"identity": identity, "acceptance": [2.0], "steps": 1}),
        json.dumps({"identity": {}, "acceptance": [0.5], "steps": 1}),
        json.dumps({"identity": identity, "acceptance": [], "steps": 1}),
        json.dumps({"identity": identity, "acceptance": "x", "steps": None}),
        json.dumps(
            {"identity": identity, "acceptance": [0.5], "steps": 1, "opening": {"acceptance": [1.5], "steps": 1}}
        ),
        json.dumps({"identity": identity, "acceptance": [0.5], "steps": 1, "opening": [0.5]}),
    ):
        path.write_text(damage)
        third = pipeline_for(folders)
        assert calibrate(third, max_k=auto.max_k) == FLAT and third.decoder.prior is None


def test_prompt_lookup_remembers_its_acceptance_by_match_length(folders, tmp_path, monkeypatch):
    from speccli.calibration import prior_path, read_prior, remember
    from speccli.drafters.ngram import LOOKUP_ACCEPTANCE

    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(calibration_cache, "measure_costs", lambda *a, **k: CostCurve(FLAT.verify_seconds, None))
    pipeline = pipeline_for(folders, draft="ngram")
    auto = SpecConfig(k="auto", max_new_tokens=48)
    pipeline.speculator().stream([5, 6, 7, 5, 6, 7, 5, 6], SamplingConfig(), auto).run()
    learned = pipeline.decoder.learned()
    assert learned.by_match and remember(pipeline, auto.max_k) == learned
    identity = prior_identity(pipeline, auto.max_k + 1)
    saved = read_prior(prior_path(calibration_path(identity)), identity)
    assert [match for match, _ in saved.by_match] == [match for match, _ in learned.by_match]
    for match, prior in learned.by_match:
        assert saved.for_match(match).acceptance == tuple(round(a, 4) for a in prior.acceptance)
        assert saved.for_match(match).steps == prior.steps

    # The next session starts each match length from what it learned, the others from the default.
    again = pipeline_for(folders, draft="ngram")
    again.speculator().calibrate(auto.max_k)
    policy = again.decoder.policy_for(auto).inner
    for match in (1, 2, 3):
        remembered = saved.for_match(match)
        expected = list(remembered.acceptance) if remembered else list(LOOKUP_ACCEPTANCE[match])
        assert policy.policy(match).prior[: len(expected)] == expected


def test_pass_times_tell_a_calibration_that_overstates_the_costs():
    from speccli.autok.costs import OVERSTATED_BY, MIN_PASSES, Overstatement, PassTimes

    loaded = CostCurve({1: 0.722, 16: 1.286, 17: 0.765}, None)  # measured while the test suite ran
    times = PassTimes()
    for _ in range(MIN_PASSES - 1):
        times.record(17, 0.43)
    times.record(40, 0.01)  # a size the calibration never measured says nothing
    assert times.overstatement(loaded) is None  # too few passes of any size to tell
    times.record(17, 0.44)
    found = times.overstatement(loaded)
    assert found == Overstatement(17, 0.765, 0.43) and found.ratio == pytest.approx(0.765 / 0.43)

    # Passes slower than the calibration (this moment is the busy one), or faster by less
    # than OVERSTATED_BY, leave it standing.
    assert times.overstatement(CostCurve({17: 0.3}, None)) is None
    assert times.overstatement(CostCurve({17: 0.43 * OVERSTATED_BY * 0.99}, None)) is None
    for _ in range(MIN_PASSES):
        times.record(1, 0.2)
    assert times.overstatement(loaded).fed == 1  # the size it overstates most


def test_a_calibration_the_passes_show_overstated_is_dropped_and_measured_again(folders, tmp_path, monkeypatch):
    from speccli.autok.costs import MIN_PASSES

    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path))
    measured: list[CostCurve] = []
    slow = CostCurve({n: 10.0 for n in range(1, 10)}, 0.5)  # tiny models' passes take milliseconds

    def measure(*args, **kwargs):
        measured.append(slow)
        return slow

    monkeypatch.setattr(calibration_cache, "measure_costs", measure)
    pipeline = pipeline_for(folders)
    messages: list[str] = []
    generator = pipeline.speculator(progress=messages.append, recalibrate=True)  # complete tables
    auto = SpecConfig(k="auto", max_new_tokens=MIN_PASSES * 6)  # k auto drafts 1-2 tokens a step here
    generator.stream([5, 6, 7], SamplingConfig(), auto).run()
    path = calibration_path(calibration_identity(pipeline, auto.max_k + 1))
    assert len(measured) == 1 and not path.exists() and pipeline.decoder.costs is None
    assert not draft_cost_path(draft_identity(pipeline.draft)).exists()  # timed on the same busy machine
    # Said after the output (a one-shot command takes it), not in the middle of it.
    assert not any("busier machine" in m for m in messages)
    [notice] = generator.notices
    assert "measured on a busier machine" in notice and "not 10000 ms" in notice

    # The next generation says it, then measures again; costs the passes bear out stay cached.
    honest = CostCurve({n: 1e-6 for n in range(1, 10)}, 1e-7)
    measured.clear()
    monkeypatch.setattr(calibration_cache, "measure_costs", lambda *a, **k: measured.append(honest) or honest)
    messages.clear()
    generator.stream([5, 6, 7], SamplingConfig(), auto).run()
    assert measured == [honest] and path.exists() and pipeline.decoder.costs == honest
    assert messages[0] == notice and messages[1].startswith("calibrating") and generator.take_notices() == []

    # Plain decoding and fixed k never read the costs: nothing is checked after them.
    pipeline.decoder.costs = slow
    generator.stream([5, 6, 7], SamplingConfig(), SpecConfig(k=2, max_new_tokens=MIN_PASSES * 2)).run()
    assert pipeline.decoder.costs == slow


def test_the_check_after_a_generation_reads_the_decoder_that_ran_it(folders, tmp_path, monkeypatch):
    # bench's make_drafter (and scripts/verify_seed.py) swap in another drafter, so another
    # decoder: its passes and what it learned are the ones to check and keep.
    import copy

    from speccli.autok.costs import MIN_PASSES
    from speccli.calibration import prior_path, read_prior

    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path))
    slow = CostCurve({n: 10.0 for n in range(1, 10)}, 0.5)
    monkeypatch.setattr(calibration_cache, "measure_costs", lambda *a, **k: slow)
    pipeline = pipeline_for(folders)
    generator = pipeline.speculator(recalibrate=True)
    auto = SpecConfig(k="auto", max_new_tokens=MIN_PASSES * 6)
    generator.calibrate(auto.max_k)
    generator.use_drafter(copy.copy(pipeline.decoder.drafter))
    ran = generator.decoder
    assert ran is not pipeline.decoder and ran.costs == slow
    generator.stream([5, 6, 7], SamplingConfig(), auto).run()
    [notice] = generator.take_notices()
    assert "measured on a busier machine" in notice and ran.costs is None
    assert not calibration_path(calibration_identity(pipeline, auto.max_k + 1)).exists()
    identity = prior_identity(pipeline, auto.max_k + 1)
    saved = read_prior(prior_path(calibration_path(identity)), identity)
    assert saved is not None and saved.steps == ran.learned().steps > 0 and pipeline.decoder.learned() is None


def test_a_first_run_probes_a_few_sizes_and_the_generations_fill_in_the_rest(folders, tmp_path, monkeypatch):
    from speccli.autok.costs import ROUNDS
    from speccli.calibration import refine

    calls: list[tuple[list[int], int]] = []
    probe = CostCurve({1: 0.1, 2: 0.12, 4: 0.14, 8: 0.2}, 0.01)

    def measure(target, draft, max_fed, repeats=ROUNDS, sizes=None, **kwargs):
        calls.append((sizes, repeats))
        return probe

    monkeypatch.setattr(calibration_cache, "measure_costs", measure)
    pipeline = pipeline_for(folders)
    messages: list[str] = []
    costs = calibrate(pipeline, max_k=7, progress=messages.append, cache_dir=tmp_path)
    assert calls == [([1, 2, 4, 8], 1)] and costs == probe
    assert messages[0] == (
        "calibrating: timing target passes over 1, 2, 4, 8 tokens and one draft token"
        " (a few seconds; the other sizes are learned from the passes generating runs)"
    )
    path = calibration_path(calibration_identity(pipeline, 8), tmp_path)
    assert json.loads(path.read_text())["samples"] == {"1": 1, "2": 1, "4": 1, "8": 1}

    # A generation's passes are merged in: a probed size by its share of the passes, a new one as measured.
    decoder = pipeline.decoder
    for seconds in (0.3, 0.3, 0.4):
        decoder.pass_times.record(4, seconds)
    decoder.pass_times.record(5, 0.15)
    assert refine(pipeline, 7, tmp_path) is True
    saved = json.loads(path.read_text())
    assert saved["costs"]["verify_seconds"]["4"] == pytest.approx((0.14 * 1 + 0.3 * 3) / 4)
    assert saved["costs"]["verify_seconds"]["5"] == pytest.approx(0.15)
    assert saved["samples"] == {"1": 1, "2": 1, "4": 4, "5": 1, "8": 1}
    assert decoder.pass_times.seconds == {}  # merged once, not again after the next generation

    # Once every size rests on ROUNDS passes the table is complete, and no longer refined.
    for fed in range(1, 9):
        for _ in range(ROUNDS):
            decoder.pass_times.record(fed, 0.1 + 0.01 * fed)
    assert refine(pipeline, 7, tmp_path) is True
    assert "samples" not in json.loads(path.read_text())
    decoder.pass_times.record(1, 5.0)
    assert refine(pipeline, 7, tmp_path) is False
    monkeypatch.setattr(calibration_cache, "measure_costs", lambda *a, **k: pytest.fail("measured again"))
    assert calibrate(pipeline_for(folders), max_k=7, cache_dir=tmp_path).verify_seconds[1] == pytest.approx(
        (0.1 * 1 + 0.11 * ROUNDS) / (1 + ROUNDS)
    )


def test_a_table_still_filling_in_is_refined_not_dropped_after_a_generation(folders, tmp_path, monkeypatch):
    from speccli.autok.costs import MIN_PASSES

    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path))
    slow = CostCurve({n: 10.0 for n in range(1, 10)}, 0.5)  # overstated: tiny models' passes take milliseconds
    monkeypatch.setattr(calibration_cache, "measure_costs", lambda *a, **k: slow)
    pipeline = pipeline_for(folders)
    generator = pipeline.speculator()
    auto = SpecConfig(k="auto", max_new_tokens=MIN_PASSES * 6)
    generator.stream([5, 6, 7], SamplingConfig(), auto).run()
    assert generator.take_notices() == []
    saved = json.loads(calibration_path(calibration_identity(pipeline, auto.max_k + 1)).read_text())
    fed = [int(size) for size, count in saved["samples"].items() if count > 2]
    assert fed and all(saved["costs"]["verify_seconds"][str(size)] < 10.0 for size in fed)
