"""Prompt lookup's k auto replayed over a benchmark's greedy answers, timed by its calibration.

Each benchmark JSON written by scripts/benchmark.py (greedy, k auto) holds hf-plain's tokens
for every prompt and the calibration: seconds of a target pass by tokens fed. Here the target
is a script that answers each pass with hf-plain's next tokens, and each pass costs what the
calibration measured for its size. specgen's decoder, prompt lookup and k auto run as they
are, over the prompts in the benchmark's order (one policy for the session, as the
benchmark's). So a change to the policy is compared on the same texts and the same costs,
free of the shared machine's noise, in seconds instead of the benchmark's half hour.

Plain decoding is replayed the same way; the ratio printed is specgen-ngram / specgen-plain
per prompt, as scripts/benchmark.py models it from the passes. Where no lookahead shape
pays (float32 on the CPUs measured so far), specgen-lookahead's steps are exactly these.

Policies:
  by-match  k auto as specgen runs it: acceptance kept by the length of the n-gram matched
  pooled    one acceptance for every match (specgen before 2026-12-02)

Usage:
  python scripts/replay_lookup.py benchmarks/results/benchmark-2026-12-05-amx-float32-lookahead-trees.json
  python scripts/replay_lookup.py benchmarks/results/benchmark-2026-12-05-amx-*.json \
      --policies by-match,pooled --json-out out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

import speccli.loop as decoder_module
from speccli.autok.costs import CostCurve
from speccli.bench.prompts import encode_bench_prompt, load_prompts
from speccli.config import LoadConfig, SamplingConfig, SpecConfig
from speccli.drafters.ngram import PromptLookupDrafter
from speccli.events import StepEvent, TokenEvent
from speccli.loop import SpeculativeDecoder
from speccli.models.loading import load_tokenizer

POLICIES = ("by-match", "pooled")


class VirtualClock:
    """The decoder's clock: it moves only when the scripted target charges a pass."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class ScriptedTarget:
    """A CausalLM that predicts a known text: the logits of each position put all weight on
    the text's next token while what was fed agrees with the text (after a wrong drafted
    token the rows are never read), and on `eos` after the text's end. A pass costs the
    calibration's seconds for its size; reading the prompt costs nothing, as the benchmark's
    modelled times leave prefill out."""

    def __init__(self, vocab_size: int, costs: dict[int, float], clock: VirtualClock, eos: int) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device("cpu")
        self.max_length = None
        self.costs = costs
        self.clock = clock
        self.eos = eos
        self.text: list[int] = []
        self._cached: list[int] = []

    @property
    def cached_tokens(self) -> Sequence[int]:
        return self._cached

    def _next(self, fed: list[int]) -> int:
        length = len(fed)
        if fed != self.text[:length]:
            return self.eos
        return self.text[length] if length < len(self.text) else self.eos

    def forward(self, token_ids: Sequence[int], all_logits: bool = True) -> torch.Tensor:
        ids = list(token_ids)
        if all_logits:
            self.clock.now += self.costs[len(ids)]
        start = len(self._cached)
        self._cached += ids
        rows = [self._next(self._cached[: start + i + 1]) for i in range(len(ids))]
        if not all_logits:
            rows = rows[-1:]
        logits = torch.zeros(len(rows), self.vocab_size)
        logits[torch.arange(len(rows)), torch.tensor(rows)] = 1.0
        return logits

    def rollback(self, length: int) -> None:
        del self._cached[length:]


class PooledLookup:
    """Prompt lookup without its match length: k auto keeps one acceptance for every match."""

    name = "ngram"

    def __init__(self) -> None:
        self.inner = PromptLookupDrafter()

    def start(self, context: Sequence[int]) -> None:
        self.inner.start(context)

    def propose(self, *args, **kwargs):  # noqa: ANN002, ANN003 - the Drafter protocol
        return self.inner.propose(*args, **kwargs)

    def rollback(self, length: int) -> None:
        self.inner.rollback(length)


@dataclass
class Replayed:
    tokens: int
    seconds: float
    steps: int
    drafted: int
    accepted: int


def run(
    decoder: SpeculativeDecoder,
    target: ScriptedTarget,
    clock: VirtualClock,
    prompt: list[int],
    answer: list[int],
    max_new: int,
) -> Replayed:
    target.rollback(0)
    clock.now = 0.0
    tokens, steps = [], []
    for event in decoder.generate(prompt, SamplingConfig(), SpecConfig(k="auto", max_new_tokens=max_new)):
        if isinstance(event, TokenEvent):
            tokens.append(event.token_id)
        elif isinstance(event, StepEvent):
            steps.append(event)
    if tokens != answer:
        raise SystemExit("replay: the decoder's output is not the scripted text (a bug in the replay or the decoder)")
    return Replayed(len(tokens), clock.now, len(steps), sum(s.drafted for s in steps), sum(s.accepted for s in steps))


def replay(path: Path, policies: list[str], tokenizers: dict) -> dict:
    data = json.loads(path.read_text())
    result = data["dtypes"][0]
    if data.get("k") != "auto" or not result.get("calibration"):
        raise SystemExit(f"{path}: needs a benchmark run with --k auto (a calibration)")
    costs = {int(fed): seconds for fed, seconds in result["calibration"]["verify_seconds"].items()}
    name = data["target"]
    if name not in tokenizers:
        tokenizers[name] = load_tokenizer(name, LoadConfig(device="cpu", dtype="float32")).tokenizer
    tokenizer = tokenizers[name]
    prompts_file = Path(data["prompts_file"])
    if not prompts_file.exists():  # written on another machine: this checkout's copy
        prompts_file = Path(__file__).parent / "prompts" / prompts_file.name
    prompts = {p.name: p for p in load_prompts(prompts_file)}
    eos = tokenizer.eos_token_id
    clock = VirtualClock()
    decoder_module.time = clock  # the decoder times its steps by the scripted passes
    target = ScriptedTarget(len(tokenizer), costs, clock, eos)
    profile = CostCurve(costs, None)
    plain = SpeculativeDecoder(target, tokenizer, [eos], None, profile)
    decoders = {
        "by-match": SpeculativeDecoder(target, tokenizer, [eos], PromptLookupDrafter(), profile),
        "pooled": SpeculativeDecoder(target, tokenizer, [eos], PooledLookup(), profile),
    }
    rows = []
    for row in result["rows"]:
        prompt = encode_bench_prompt(tokenizer, prompts[row["prompt"]])
        answer = row["methods"]["hf-plain"]["tokens"]
        ends = len(answer) < data["max_new_tokens"]
        target.text = prompt + answer + ([eos] if ends else [])
        base = run(plain, target, clock, prompt, answer, data["max_new_tokens"])
        entry = {"prompt": row["prompt"], "tokens": base.tokens}
        for policy in policies:
            got = run(decoders[policy], target, clock, prompt, answer, data["max_new_tokens"])
            entry[policy] = {
                "ratio": (got.tokens / got.seconds) / (base.tokens / base.seconds),
                "steps": got.steps,
                "drafted": got.drafted,
                "accepted": got.accepted,
            }
        rows.append(entry)
    summary = {}
    for policy in policies:
        ratios = [r[policy]["ratio"] for r in rows]
        summary[policy] = {
            "median": statistics.median(ratios),
            "lowest": min(ratios),
            "below_1": sum(r < 1.0 for r in ratios),
        }
    curve = {fed: round(seconds / costs[1], 2) for fed, seconds in sorted(costs.items())}
    return {"file": str(path), "dtype": result["dtype"], "curve": curve, "rows": rows, "summary": summary}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("benchmarks", nargs="+", type=Path, help="benchmark JSON files (scripts/benchmark.py)")
    parser.add_argument("--policies", default="by-match,pooled", help=f"comma-separated: {', '.join(POLICIES)}")
    parser.add_argument("--json-out", type=Path, help="also write the results here")
    args = parser.parse_args()
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        parser.error(f"unknown policy {unknown[0] if unknown else '(none)'}; choose from {', '.join(POLICIES)}")
    tokenizers: dict = {}
    results = []
    everything: dict[str, list[float]] = {p: [] for p in policies}
    for path in args.benchmarks:
        replayed = replay(path, policies, tokenizers)
        results.append(replayed)
        print(
            f"\n{path.name} ({replayed['dtype']}; a pass over 2 tokens costs {replayed['curve'][2]}x one, "
            f"over 16 {replayed['curve'].get(16, '?')}x)"
        )
        print(f"  {'prompt':22} {'tokens':>6} " + " ".join(f"{p:>22}" for p in policies))
        for row in replayed["rows"]:
            cells = " ".join(f"{row[p]['ratio']:>8.3f} ({row[p]['drafted']:>3} drafted)" for p in policies)
            print(f"  {row['prompt']:22} {row['tokens']:>6} {cells}")
        for policy in policies:
            s = replayed["summary"][policy]
            everything[policy] += [r[policy]["ratio"] for r in replayed["rows"]]
            print(
                f"  {policy}: ngram / plain median {s['median']:.3f}, lowest {s['lowest']:.3f}, "
                f"{s['below_1']} prompts below 1.0"
            )
    if len(results) > 1:
        print("\nall files:")
        for policy, ratios in everything.items():
            print(
                f"  {policy}: median {statistics.median(ratios):.3f}, geometric mean "
                f"{statistics.geometric_mean(ratios):.3f}, lowest {min(ratios):.3f}, "
                f"{sum(r < 1.0 for r in ratios)} of {len(ratios)} prompts below 1.0"
            )
    if args.json_out:
        args.json_out.write_text(json.dumps({"results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
