"""Calibrate a loaded pipeline's pass costs once per target and device, and keep the result
on disk (``<cache>/calibration/<key>.json``) so later sessions start from it, whichever the
drafter. A draft model's token cost is kept apart (``<cache>/calibration/draft/<key>.json``),
once per draft model and device.

Beside them (``<cache>/calibration/acceptance/<key>.json``, keyed by the target's calibration
and the drafter: see prior_identity) lies what `k auto` learned about the draft's acceptance
by position, saved after each generation (`remember`) and read back with the calibration to
seed the next session's policy. Any of these files, missing or damaged, only costs what it
would have saved. A calibration that a generation's own passes show was measured on a
busier machine is dropped and measured again (`drop_if_overstated`).

A first run does not wait a minute or two for the full table: it probes a few sizes in a few
seconds (PROBE_SIZES), starts generating from that (k auto refines the costs from the passes
it runs, see autok.policy.StepCosts), and after each generation the passes it ran are merged
into the table (`refine`), until every size has ROUNDS measurements and the table is complete.
`--recalibrate` measures the full table at once."""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, TypeVar

import torch

from speccli.autok.costs import CONTEXT_TOKENS, ROUNDS, CostCurve, measure_costs, measure_draft_seconds
from speccli.autok.policy import AcceptancePrior
from speccli.backends.llamacpp import llama_cpp_version
from speccli.loop import SpeculativeDecoder
from speccli.models.names import offline
from speccli.models.pairs.drafts import LOOKAHEAD, PROMPT_LOOKUP, TRAINED_HEAD_KINDS
from speccli.models.loading import LoadedModel, cpu_name, dtype_name

T = TypeVar("T")


class LoadedPair(Protocol):
    """What calibrating needs of a loaded pipeline (speccli.pipeline.Pipeline)."""

    target: LoadedModel
    draft: LoadedModel | None  # the draft model, if the drafter has one
    drafter_name: str
    decoder: SpeculativeDecoder


PROBE_SIZES = (1, 2, 4, 8)  # and the largest: what a first run times before generating
PROBE_ROUNDS = 1

# 4: 8 rounds (a table without "samples" is a full one); 3: 3 rounds of each size's median
# ratio to a one-token pass timed just before it; 2: the fastest round; 1: the median
FORMAT = 4
PROGRESS_EVERY = 20.0  # seconds between the calibration's progress lines, after the first


class RoundProgress:
    """Says how a calibration goes: after its first timed round, the time it will take, then
    at most one line every PROGRESS_EVERY seconds (it takes a minute or two on a CPU, all
    of it before the first token of `chat`)."""

    def __init__(self, say: Callable[[str], None], clock: Callable[[], float] = time.perf_counter) -> None:
        self.say = say
        self.clock = clock
        self.warmed_at: float | None = None
        self.said_at: float | None = None

    def __call__(self, done: int, rounds: int) -> None:
        now = self.clock()
        if done == 0:  # the warm-up: slower than the rounds after it, so not a measure of them
            self.warmed_at = now
            return
        if self.warmed_at is None or done == rounds:
            return
        if self.said_at is not None and now - self.said_at < PROGRESS_EVERY:
            return
        left = (now - self.warmed_at) / done * (rounds - done)
        self.said_at = now
        self.say(f"calibrating: round {done} of {rounds} done, about {left:.0f} s left")


def _model_identity(model: LoadedModel) -> dict[str, Any]:
    identity: dict[str, Any] = {
        "name": model.name,
        "location": f"{model.resolved.location}/{model.resolved.gguf_file or ''}",
        "dtype": dtype_name(model.dtype),
        "quant": model.quant,
        "linear": model.linear,
        "device": str(model.device),
        "backend": model.backend,
    }
    if model.stock_rows:  # which kernel takes a pass's rows: its costs
        identity["stock_rows"] = model.stock_rows
    return identity


def hardware_name(device: torch.device) -> str:
    """What the calibration store keys a machine by: the GPU's name, or the CPU's."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def _machine_identity(model: LoadedModel) -> dict[str, Any]:
    """The hardware, threads and library versions a model's passes were timed on."""
    import transformers

    device = model.device
    return {
        "hardware": hardware_name(device),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        **({"llama_cpp": llama_cpp_version()} if model.backend == "llama.cpp" else {}),
    }


def calibration_identity(pipeline: LoadedPair, max_fed: int) -> dict[str, Any]:
    """Everything the target's measured pass costs depend on: the target as loaded, the
    hardware, the threads and the library versions. Every drafter times the same target
    passes, so they share one calibration per target: switching drafters (a draft model,
    prompt lookup, lookahead, heads) does not measure them again. A draft model's token
    is timed apart (draft_identity)."""
    return {
        "format": FORMAT,
        "target": _model_identity(pipeline.target),
        "draft": None,
        "max_fed": max_fed,
        **_machine_identity(pipeline.target),
    }


def draft_identity(draft: LoadedModel) -> dict[str, Any]:
    """What a draft model's measured token cost depends on: the draft as loaded, the hardware,
    the threads and the library versions (not the target: it is timed alone)."""
    return {
        "format": FORMAT,
        "draft": _model_identity(draft),
        "context_tokens": CONTEXT_TOKENS,
        **_machine_identity(draft),
    }


def prior_identity(pipeline: LoadedPair, max_fed: int) -> dict[str, Any]:
    """What an acceptance prior belongs to: the target's calibration and the drafter (the
    draft model as loaded, or the name of a drafter without one)."""
    identity = calibration_identity(pipeline, max_fed)
    identity["draft"] = _model_identity(pipeline.draft) if pipeline.draft else pipeline.drafter_name
    return identity


def calibration_path(identity: dict[str, Any], cache_dir: Path | None = None) -> Path:
    root = Path(cache_dir) if cache_dir is not None else offline.default_cache_dir()
    return root / "calibration" / f"{offline.identity_digest(identity)}.json"


def draft_cost_path(identity: dict[str, Any], cache_dir: Path | None = None) -> Path:
    """Where a draft model's token cost (draft_identity) lies: ``calibration/draft/<key>.json``."""
    path = calibration_path(identity, cache_dir)
    return path.parent / "draft" / path.name


def _read_entry(path: Path, identity: dict[str, Any], parse: Callable[[dict[str, Any]], T | None]) -> T | None:
    """What `parse` reads from the JSON file at `path` if it was written for `identity`; None if
    the file is missing, damaged, another identity's, or `parse` finds it invalid."""
    try:
        data = json.loads(path.read_text())
        if data.get("identity") != identity:
            return None
        return parse(data)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # missing or damaged: measure again


def _write_entry(path: Path, identity: dict[str, Any], entry: dict[str, Any], stamp: str = "measured") -> None:
    """Write `entry` for `identity` at `path`, with the time under `stamp`."""
    offline.write_json(path, {"identity": identity, stamp: time.strftime("%Y-%m-%dT%H:%M:%S%z"), **entry})


@dataclass(frozen=True)
class StoredCosts:
    """A calibration as kept: the target's pass costs, and how many passes of each size they
    rest on while the table is still filling in (empty for a complete table)."""

    costs: CostCurve
    samples: dict[int, int] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return not self.samples


def _stored_from(data: dict[str, Any]) -> StoredCosts:
    samples = {int(fed): int(count) for fed, count in data.get("samples", {}).items()}
    return StoredCosts(CostCurve.from_dict(data["costs"]), samples)


def _read(path: Path, identity: dict[str, Any]) -> StoredCosts | None:
    return _read_entry(path, identity, _stored_from)


def _write(path: Path, identity: dict[str, Any], costs: CostCurve, samples: dict[int, int] | None = None) -> None:
    entry: dict[str, Any] = {"costs": costs.as_dict()}
    if samples:
        entry["samples"] = {str(fed): count for fed, count in sorted(samples.items())}
    _write_entry(path, identity, entry)


def probe_sizes(max_fed: int) -> list[int]:
    return sorted({size for size in PROBE_SIZES if size <= max_fed} | {max_fed})


def _positive_seconds(data: dict[str, Any]) -> float | None:
    seconds = float(data["draft_seconds"])
    return seconds if 0 < seconds < float("inf") else None


def _read_draft_seconds(path: Path, identity: dict[str, Any]) -> float | None:
    return _read_entry(path, identity, _positive_seconds)


def _write_draft_seconds(path: Path, identity: dict[str, Any], seconds: float) -> None:
    _write_entry(path, identity, {"draft_seconds": seconds})


def prior_path(calibration: Path) -> Path:
    """Where the acceptance prior lies whose identity (prior_identity) keys `calibration`:
    ``acceptance/<key>.json`` beside it."""
    return calibration.parent / "acceptance" / calibration.name


def read_prior(path: Path, identity: dict[str, Any]) -> AcceptancePrior | None:
    """The acceptance prior saved at `path` for this identity; None if missing or damaged."""
    return _read_entry(path, identity, _learned_prior_from)


# Drafters without a model of their own whose measured gains `--draft auto` weighs.
MEASURED_DRAFTERS = (*TRAINED_HEAD_KINDS, LOOKAHEAD, PROMPT_LOOKUP)


def measured_draft_gains(
    target_name: str, cache_dir: Path | None = None, device: torch.device | None = None
) -> dict[str, float]:
    """For each draft model a session of `target_name` drafted with on this hardware (`device`,
    default: this CPU), and each of MEASURED_DRAFTERS (heads trained here, alone or taking turns,
    lookahead, prompt lookup), the best gain over plain decoding its ways of drafting measured
    (the `methods` of its saved acceptance prior): what `--draft auto` weighs a draft of another
    tokenizer, trained heads or lookahead by."""
    hardware = hardware_name(device or torch.device("cpu"))
    gains: dict[str, float] = {}
    root = Path(cache_dir) if cache_dir is not None else offline.default_cache_dir()
    for path in sorted((root / "calibration" / "acceptance").glob("*.json")):
        try:
            data = json.loads(path.read_text())
            identity, methods = data["identity"], data.get("methods", {})
            draft, target = identity.get("draft"), identity["target"]["name"]
            if target != target_name or identity.get("hardware") != hardware:
                continue
            if isinstance(draft, dict):
                name, ways = str(draft["name"]), "model "
            elif isinstance(draft, str) and draft.partition("+")[0] in MEASURED_DRAFTERS:
                name = draft.partition("+")[0]  # heads trained here (alone or taking turns), lookahead, ngram
                ways = f"{name} "
            else:
                continue
            best = max(float(entry["gain"]) for way, entry in methods.items() if f"{way} ".startswith(ways))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # damaged, of another format, or no drafting measured
        gains[name] = max(best, gains.get(name, 0.0))
    return gains


def _learned_prior_from(data: dict[str, Any]) -> AcceptancePrior | None:
    prior = _prior_from(data)
    read = [(int(match), _prior_from(entry)) for match, entry in data.get("by_match", {}).items()]
    by_match = tuple((match, learned) for match, learned in read if learned is not None)
    if prior is None or len(by_match) < len(read):
        return None
    opening = _prior_from(data["opening"]) if "opening" in data else None
    if "opening" in data and opening is None:
        return None
    methods = tuple(
        (str(way), float(entry["gain"]), float(entry["steps"])) for way, entry in data.get("methods", {}).items()
    )
    if not all(0.0 < gain < float("inf") and 0.0 < steps < float("inf") for _, gain, steps in methods):
        return None
    return AcceptancePrior(prior.acceptance, prior.steps, by_match, opening, methods)


def _prior_from(data: dict[str, Any]) -> AcceptancePrior | None:
    acceptance = tuple(float(a) for a in data["acceptance"])
    steps = float(data["steps"])
    if not acceptance or not all(0.0 <= a <= 1.0 for a in acceptance) or not 0.0 <= steps < float("inf"):
        return None
    return AcceptancePrior(acceptance, steps)


def _prior_payload(prior: AcceptancePrior) -> dict[str, Any]:
    return {"acceptance": [round(a, 4) for a in prior.acceptance], "steps": prior.steps}


def remember(
    pipeline: LoadedPair, max_k: int, cache_dir: Path | None = None, decoder: SpeculativeDecoder | None = None
) -> AcceptancePrior | None:
    """Save what `decoder` (default: the pipeline's) learned about the draft's acceptance
    (with the prior it started from), beside the calibration for `max_k`."""
    learned = (decoder or pipeline.decoder).learned()
    if learned is None:
        return None
    identity = prior_identity(pipeline, max_k + 1)
    entry = _prior_payload(learned)
    if learned.by_match:
        entry["by_match"] = {str(match): _prior_payload(prior) for match, prior in learned.by_match}
    if learned.opening is not None:
        entry["opening"] = _prior_payload(learned.opening)
    if learned.methods:
        entry["methods"] = {way: {"gain": gain, "steps": steps} for way, gain, steps in learned.methods}
    _write_entry(prior_path(calibration_path(identity, cache_dir)), identity, entry, stamp="saved")
    return learned


def drop_if_overstated(
    pipeline: LoadedPair, max_k: int, cache_dir: Path | None = None, decoder: SpeculativeDecoder | None = None
) -> str | None:
    """After a generation with `k auto` by `decoder` (default: the pipeline's): when its passes
    ran well below what the calibration says they cost (it was measured on a busier machine),
    delete the cached calibration (and the draft model's token cost, timed with it) and take
    it from the decoder, so that the next generation, here or in a later session, measures
    again. Returns what to tell the user, or None when the calibration holds."""
    decoder = decoder or pipeline.decoder
    if decoder.costs is None:
        return None
    found = decoder.pass_times.overstatement(decoder.costs)
    if found is None:
        return None
    paths = [calibration_path(calibration_identity(pipeline, max_k + 1), cache_dir)]
    if pipeline.draft is not None:  # its token was timed on the same busy machine, most likely
        paths.append(draft_cost_path(draft_identity(pipeline.draft), cache_dir))
    for path in paths:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass  # read-only cache: this session still measures again
    decoder.costs = None
    return (
        f"the cached pass costs were measured on a busier machine: {found.fed}-token passes took"
        f" {found.measured_seconds * 1000:.0f} ms, not {found.calibrated_seconds * 1000:.0f} ms;"
        " they are measured again before the next generation"
    )


def refine(
    pipeline: LoadedPair, max_k: int, cache_dir: Path | None = None, decoder: SpeculativeDecoder | None = None
) -> bool:
    """After a generation with `k auto`: merge the target passes it ran (by tokens fed) into a
    table that is still filling in, and mark it complete once every size rests on ROUNDS
    passes. False (nothing done) when the table is complete or missing."""
    decoder = decoder or pipeline.decoder
    max_fed = max_k + 1
    identity = calibration_identity(pipeline, max_fed)
    path = calibration_path(identity, cache_dir)
    stored = _read(path, identity)
    if stored is None or stored.complete:
        return False
    verify, samples = dict(stored.costs.verify_seconds), dict(stored.samples)
    for fed, times in decoder.pass_times.seconds.items():
        if not 1 <= fed <= max_fed or not times:
            continue
        before, added = samples.get(fed, 0), len(times)
        median = statistics.median(times)
        verify[fed] = median if before == 0 else (verify[fed] * before + median * added) / (before + added)
        samples[fed] = before + added
    decoder.pass_times.seconds.clear()  # merged: the next generation's passes are its own
    done = all(samples.get(fed, 0) >= ROUNDS for fed in range(1, max_fed + 1))
    _write(path, identity, CostCurve(verify, None), None if done else samples)
    return True


def calibrate(
    pipeline: LoadedPair,
    max_k: int,
    progress: Callable[[str], None] | None = None,
    refresh: bool = False,
    cache_dir: Path | None = None,
) -> CostCurve | None:
    """Give the pipeline's decoder measured costs for `k=auto`: from the cache, else by a quick
    probe of a few sizes (a full measurement, a minute or two on a CPU, with `refresh`) that is
    cached and refined later (`refine`); and the acceptance prior saved beside them, if any.
    None when there is no drafter."""
    decoder = pipeline.decoder
    if decoder.drafter is None:
        return None
    say = progress or (lambda message: None)
    max_fed = max_k + 1
    identity = calibration_identity(pipeline, max_fed)
    path = calibration_path(identity, cache_dir)
    stored = None if refresh else _read(path, identity)
    costs = stored.costs if stored is not None else None
    # A draft model's token is timed apart from the target's passes, and cached apart.
    draft = pipeline.draft
    draft_model = decoder.drafter.draft_model if decoder.drafter is not None and draft else None
    drafted = draft_identity(draft) if draft_model is not None and draft is not None else None
    draft_path = draft_cost_path(drafted, cache_dir) if drafted is not None else None
    draft_seconds = (
        None if draft_path is None or drafted is None or refresh else _read_draft_seconds(draft_path, drafted)
    )
    time_draft = draft_model is not None and draft_seconds is None
    started = time.perf_counter() if costs is None or time_draft else None
    with_draft = " and one draft token" if time_draft else ""
    if costs is None:
        if refresh:
            say(
                f"calibrating: timing target passes over 1-{max_fed} tokens{with_draft}"
                f" in {ROUNDS} rounds (a minute or two on a CPU)"
            )
            measured = measure_costs(
                decoder.target, draft_model if time_draft else None, max_fed, on_round=RoundProgress(say)
            )
            samples = None
        else:
            sizes = probe_sizes(max_fed)
            say(
                f"calibrating: timing target passes over {', '.join(map(str, sizes))} tokens{with_draft}"
                " (a few seconds; the other sizes are learned from the passes generating runs)"
            )
            measured = measure_costs(
                decoder.target, draft_model if time_draft else None, max_fed, repeats=PROBE_ROUNDS, sizes=sizes
            )
            samples = {size: PROBE_ROUNDS for size in sizes}
        costs = CostCurve(measured.verify_seconds, None)
        _write(path, identity, costs, samples)
        draft_seconds = measured.draft_seconds if time_draft else draft_seconds
    elif draft_model is not None and time_draft:
        say("calibrating: timing one draft token (the target's passes are calibrated already)")
        draft_seconds = measure_draft_seconds(draft_model)
    if time_draft:
        # A draft model timed: it has an identity and a path, and measure_costs timed its token.
        assert draft_path is not None and drafted is not None and draft_seconds is not None
        _write_draft_seconds(draft_path, drafted, draft_seconds)
    costs = CostCurve(costs.verify_seconds, draft_seconds)
    if started is not None:
        say(f"calibrated in {time.perf_counter() - started:.1f} s: {describe(costs)}")
    beside = prior_identity(pipeline, max_fed)
    decoder.prior = read_prior(prior_path(calibration_path(beside, cache_dir)), beside)
    decoder.costs = costs
    return costs


def describe(costs: CostCurve) -> str:
    sizes = sorted(costs.verify_seconds)
    first, last = sizes[0], sizes[-1]
    text = (
        f"a target pass costs {costs.verify_seconds[first] * 1000:.0f} ms for {first} token(s),"
        f" {costs.verify_seconds[last] * 1000:.0f} ms for {last}"
    )
    if costs.draft_seconds is not None:
        text += f"; a draft token {costs.draft_seconds * 1000:.0f} ms"
    return text
