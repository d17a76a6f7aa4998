"""Compare specgen with transformers' own generation methods on real models, greedy.

    python scripts/benchmark.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
        --dtypes float32,bfloat16 --limit 12 --max-new-tokens 128 --json-out bench.json

One process, one machine. For each dtype the target and draft are loaded once; then, for
each prompt, these methods run one after another on the same prompt ids (interleaved per
prompt, so slow drift of the machine hits every method alike):

  hf-plain          target.generate(ids, do_sample=False)
  hf-assisted       target.generate(..., assistant_model=draft), the draft as loaded for the target
  hf-assisted-int8  the same with specgen's draft (int8 on the CPU): what the cheaper draft alone gives
  hf-prompt-lookup  target.generate(..., prompt_lookup_num_tokens=10)
  specgen-auto      specgen with its defaults (--draft auto, --tree auto, k auto): the draft and suffix
                    drafting taking turns (no history: as a one-shot generate), chains or trees as each
                    has measured faster, plain where drafting has not paid; suffix drafting's guess grafted
                    into the draft's trees where its k auto says it would draft too
  specgen-auto-ungrafted  the same without grafting: what the grafts give
  specgen-draft     the draft alone drafting chains (--no-tree): the draft loaded as specgen loads a
                    draft (int8 on the CPU), k auto from a calibration made before timing, early stop
                    on the draft's confidence
  specgen-ngram     specgen's SpeculativeDecoder with PromptLookupDrafter
  specgen-suffix    suffix drafting (--draft suffix, --tree auto): the text so far and the prompts before this
                    one with their answers (the target's own, hf-plain's; no store, nothing from warm-up
                    or from a repeat of the same prompt)
  specgen-plain     specgen's decode loop with no drafter (k = 0): what specgen's loading alone gives,
                    so that specgen-draft / specgen-plain is the gain of speculation alone
  specgen-plain-stock  the same loop on PyTorch's stock linear kernels (as --cpu-linear stock): what
                    specgen's CPU kernels (oneDNN in float32, one-row products as two in bfloat16) give
  specgen-tree      specgen-draft drafting token trees (--tree): the draft branches where unsure
  specgen-ngram-tree  specgen-ngram drafting trees of several earlier continuations
  specgen-lookahead lookahead decoding (--draft lookahead): no draft model, a Jacobi window in every pass
  specgen-draft-ngram  the draft and prompt lookup taking turns, drafting chains (--draft auto --no-tree)
  specgen-medusa    Medusa heads trained by `specgen train medusa` for the target (from the cache)
  specgen-eagle     the EAGLE head trained by `specgen train eagle` (from the cache)
  specgen-medusa-tree, specgen-eagle-tree   the same drafting trees

transformers' methods run on the models with PyTorch's stock kernels, as transformers
loads them; specgen's run as specgen loads them: in float32 on the CPU, its linear layers
run through oneDNN, in bfloat16 one-row products as two where that is measured faster
(speccli.models.kernels.onednn; the same weights, switched in place before
each method's run, outside its timing).

With --repeats R each method runs R times per prompt and its fastest run counts; the JSON
keeps every run's seconds. The order of the methods changes every round (prompts and
repeats alike) so that each runs first, and right after each other method, equally often.

Tokens/s is new tokens / wall time of the whole call, prefill included, for every method
(specgen's caches are emptied before each run, so it prefills the whole prompt as
transformers does). Every method's tokens are checked against hf-plain's and each divergence
classified as `specgen bench` does (speccli.bench.divergence): a near-tie (the target's logits
for the two choices within the rounding of the dtype; never in float32) is reported, a
MISMATCH is an error (exit 1).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import torch

from speccli.api import Speculator
from speccli.autok.costs import CostCurve, measure_costs
from speccli.calibration import describe
from speccli.bench.divergence import classify, first_difference
from speccli.bench.prompts import encode_bench_prompt, load_prompts
from speccli.config import LoadConfig, SamplingConfig, SpecConfig
from speccli.drafters.heads import HeadPasses
from speccli.drafters.lookahead import LookaheadDrafter
from speccli.drafters.candidates import CandidateDrafter
from speccli.drafters.suffix import SuffixDrafter, SuffixHistory
from speccli.drafters.ngram import PromptLookupDrafter
from speccli.models.loading import load_model
from speccli.models.kernels.onednn import set_cpu_linear
from speccli.pipeline import backend_label, causal_lm, head_drafter, model_drafter, vocab_bridge
from speccli.stats import speedup

METHODS = (
    "hf-plain",
    "hf-assisted",
    "hf-assisted-int8",
    "hf-prompt-lookup",
    "specgen-auto",
    "specgen-auto-ungrafted",
    "specgen-draft",
    "specgen-ngram",
    "specgen-plain",
    "specgen-plain-stock",
    "specgen-tree",
    "specgen-ngram-tree",
    "specgen-lookahead",
    "specgen-draft-ngram",
    "specgen-suffix",
    "specgen-medusa",
    "specgen-medusa-tree",
    "specgen-eagle",
    "specgen-eagle-tree",
)
TREE_METHODS = ("specgen-tree", "specgen-ngram-tree", "specgen-medusa-tree", "specgen-eagle-tree")
HEAD_METHODS = {
    "specgen-medusa": "medusa",
    "specgen-medusa-tree": "medusa",
    "specgen-eagle": "eagle",
    "specgen-eagle-tree": "eagle",
}
WARMUP_TOKENS = 8
DEFAULT_PROMPTS = Path(__file__).resolve().parent / "prompts" / "default.jsonl"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def strip_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """specgen emits no end-of-sequence token; transformers keeps it. Compare without it."""
    cut = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokens[:cut]


class Bench:
    def __init__(
        self, target, draft, spec_draft, k: int | str, cuda_graphs: str = "auto", methods=None, bridge=None
    ) -> None:
        self.head_drafters: dict = {}
        self.target = target
        self.draft = draft
        self.spec_draft = spec_draft
        self.model = target.model
        self.eos = list(target.eos_token_ids)
        self.eos_set = set(self.eos)
        self.k = k
        self.earlier_texts: list[list[int]] = []  # the prompts so far with their answers, for specgen-suffix
        pad = target.tokenizer.pad_token_id
        self.pad = pad if pad is not None else self.eos[0]
        # As specgen runs them: on CUDA over a static cache replayed as CUDA graphs (--cuda-graphs).
        target_lm = causal_lm(target, cuda_graphs)
        self.target_lm = target_lm
        # One generator per drafter, reused across prompts as a session would (the auto-k
        # policy keeps what it has learnt); caches are emptied before each timed run.
        # A draft of another tokenizer (`bridge`) drafts by text, as specgen's pipeline has it do.
        self.bridge = bridge
        self.draft_drafter = model_drafter(
            target_lm, target.tokenizer, spec_draft, cuda_graphs=cuda_graphs, bridge=bridge
        )
        self.ngram_drafter = PromptLookupDrafter()
        # Calibrated before timing, as a user's cached calibration would be.
        costs = None
        if k == "auto":
            costs = measure_costs(target_lm, self.draft_drafter.model, SpecConfig().max_k + 1)
            log(f"calibration: {describe(costs)}")
            log(
                "pass cost by tokens fed: "
                + ", ".join(f"{fed}: {1000 * seconds:.0f} ms" for fed, seconds in sorted(costs.verify_seconds.items()))
            )
        draft_generator = Speculator.over(target_lm, target.tokenizer, self.eos, self.draft_drafter, costs)
        self.generators = {
            "specgen-draft": draft_generator,
            # Prompt lookup costs no draft pass: the same verification costs, no draft cost.
            "specgen-ngram": Speculator.over(
                target_lm,
                target.tokenizer,
                self.eos,
                self.ngram_drafter,
                CostCurve(costs.verify_seconds, None) if costs else None,
            ),
            "specgen-plain": draft_generator,  # streamed with plain=True: the target alone
            "specgen-plain-stock": draft_generator,
            # Their own generators, so that what k auto learns of trees stays apart from chains.
            "specgen-tree": Speculator.over(target_lm, target.tokenizer, self.eos, self.draft_drafter, costs),
            "specgen-ngram-tree": Speculator.over(
                target_lm,
                target.tokenizer,
                self.eos,
                self.ngram_drafter,
                CostCurve(costs.verify_seconds, None) if costs else None,
            ),
            "specgen-draft-ngram": Speculator.over(
                target_lm,
                target.tokenizer,
                self.eos,
                CandidateDrafter([self.draft_drafter, PromptLookupDrafter()]),
                costs,
            ),
            "specgen-auto": Speculator.over(
                target_lm,
                target.tokenizer,
                self.eos,
                CandidateDrafter([self.draft_drafter, SuffixDrafter()]),
                costs,
            ),
            "specgen-auto-ungrafted": Speculator.over(
                target_lm,
                target.tokenizer,
                self.eos,
                CandidateDrafter([self.draft_drafter, SuffixDrafter()], graft=False),
                costs,
            ),
            # Its history: the prompts and answers of its own earlier runs in this process.
            "specgen-suffix": Speculator.over(
                target_lm,
                target.tokenizer,
                self.eos,
                SuffixDrafter(),
                CostCurve(costs.verify_seconds, None) if costs else None,
            ),
            "specgen-lookahead": Speculator.over(
                target_lm,
                target.tokenizer,
                self.eos,
                LookaheadDrafter(),
                CostCurve(costs.verify_seconds, None) if costs else None,
            ),
        }
        # Heads trained with `specgen train` for this target (from the cache), when a method asks for them.
        for method, kind in HEAD_METHODS.items():
            if method in (methods or ()):
                free = CostCurve(costs.verify_seconds, None) if costs else None
                drafter = self.head_drafters.get(kind) or head_drafter(target, target_lm, kind, progress=log)
                self.head_drafters[kind] = drafter
                self.generators[method] = Speculator.over(target_lm, target.tokenizer, self.eos, drafter, free)
        self.costs = costs
        self.specgen_linear = target.linear

    def _hf(self, method: str, ids: list[int], max_new: int) -> tuple[list[int], dict]:
        from transformers import GenerationConfig

        # A fresh, neutral generation config: pure greedy, none of the model's sampling or
        # repetition-penalty defaults, so every method computes the same argmax chain.
        config = GenerationConfig(do_sample=False, max_new_tokens=max_new, eos_token_id=self.eos, pad_token_id=self.pad)
        kwargs = {}
        if method == "hf-assisted":
            kwargs["assistant_model"] = self.draft.model
        elif method == "hf-assisted-int8":
            kwargs["assistant_model"] = self.spec_draft.model
        elif method == "hf-prompt-lookup":
            config.prompt_lookup_num_tokens = 10
        if "assistant_model" in kwargs and self.bridge is not None:
            # transformers' universal assisted generation: the draft's text re-tokenized.
            kwargs.update(tokenizer=self.target.tokenizer, assistant_tokenizer=self.draft.tokenizer)
        inputs = torch.tensor([ids], device=self.model.device)
        with torch.inference_mode():
            out = self.model.generate(
                inputs, attention_mask=torch.ones_like(inputs), generation_config=config, **kwargs
            )
        return out[0, len(ids) :].tolist(), {}

    def _spec(self, method: str, ids: list[int], max_new: int) -> tuple[list[int], dict]:
        generator = self.generators[method]
        plain = method in ("specgen-plain", "specgen-plain-stock")
        drafter = None if plain else generator.drafter
        # Trees for the tree methods, chains for the others, and k auto's own choice for specgen-auto and -suffix.
        tree = (
            None if method in ("specgen-auto", "specgen-auto-ungrafted", "specgen-suffix") else method in TREE_METHODS
        )
        spec = SpecConfig(k=self.k, max_new_tokens=max_new, tree=tree)
        # The target's passes and the drafter's own: a draft model's backend, or the heads' (HeadPasses).
        draft_model = drafter.draft_model if drafter is not None else None
        models = [self.target_lm] + ([draft_model] if draft_model is not None else [])
        models += [drafter] if isinstance(drafter, HeadPasses) else []
        forward_before = sum(m.forward_seconds for m in models)
        started = time.perf_counter()
        if isinstance(drafter, SuffixDrafter):
            drafter.history = SuffixHistory()
            for text in self.earlier_texts:
                drafter.history.add(text)
        with torch.inference_mode():
            # No run learns from another: suffix drafting's history is set above, or none.
            generation = generator.stream(ids, SamplingConfig(), spec, plain=plain, cold=True, learn=False).run()
        wall = time.perf_counter() - started
        forward = sum(m.forward_seconds for m in models) - forward_before
        stats = generation.stats
        return generation.token_ids, {
            "steps": stats.steps,
            "drafted": stats.drafted,
            "accepted": stats.accepted,
            "acceptance": stats.acceptance_rate,
            "tokens_per_step": stats.tokens_per_step,
            "pass_size": stats.mean_pass_size,
            "steps_by_method": dict(sorted(stats.methods.items())),
            "passes": dict(sorted(stats.passes.items())),  # tokens fed: count (keys become strings in the JSON)
            "forward_seconds": forward,
            "overhead": (wall - forward) / wall if wall > 0 else None,
        }

    def run(self, method: str, ids: list[int], max_new: int) -> dict:
        specgen = method.startswith("specgen")
        runner = self._spec if specgen else self._hf
        set_cpu_linear(self.model, self.specgen_linear, enabled=specgen and method != "specgen-plain-stock")
        started = time.perf_counter()
        tokens, extra = runner(method, ids, max_new)
        seconds = time.perf_counter() - started
        tokens = strip_eos(tokens, self.eos_set)
        self.target_lm.rollback(0)  # free specgen's cache before the next method
        return {
            "tokens": tokens,
            "new_tokens": len(tokens),
            "seconds": seconds,
            "tokens_per_second": len(tokens) / seconds if seconds > 0 else None,
            **extra,
        }

    def next_logits(self, ids: list[int], prefix: list[int]) -> torch.Tensor:
        """The target's logits for the token after the prompt and `prefix`, as plain decoding scores them."""
        with torch.inference_mode():
            return self.model(torch.tensor([ids + prefix], device=self.model.device)).logits[0, -1].float()


def fastest_run(runs: list[dict]) -> dict:
    """Of one method's repeated runs on one prompt, the fastest, with every run's seconds
    (`seconds_all`) and whether every run gave the same tokens (greedy: it must). Noise on a
    shared machine only ever adds time, so the fastest run is the one least disturbed."""
    best = min(runs, key=lambda run: run["seconds"])
    return {
        **best,
        "seconds_all": [run["seconds"] for run in runs],
        "repeats_identical": all(run["tokens"] == best["tokens"] for run in runs),
    }


def balanced_order(methods: Sequence[str], sequence: int) -> list[str]:
    """The order of the `sequence`-th round of methods: rows of a Williams design, so that
    over len(methods) rounds (twice that for an odd count) each method runs first equally
    often and right after each other method equally often. A rotation alone kept each
    method right after the same one: on a 2-core AMD EPYC lookahead, always right after
    specgen-plain, measured 0.93x prompt lookup where their passes modelled 1.01x, and
    1.06x (modelled 1.02x) in a run without specgen-plain."""
    count = len(methods)
    first, low, high = [0], 1, count - 1
    while len(first) < count:
        first.append(low)
        low += 1
        if len(first) < count:
            first.append(high)
            high -= 1
    row = [methods[(position + sequence) % count] for position in first]
    return row[::-1] if count % 2 and (sequence // count) % 2 else row


def round_robin_by_category(prompts: list, limit: int) -> list:
    """The first prompt of each category, then the second of each, and so on, up to limit."""
    queues: dict[str, list] = {}
    for prompt in prompts:
        queues.setdefault(prompt.category or "", []).append(prompt)
    chosen = []
    while len(chosen) < limit and any(queues.values()):
        for queue in queues.values():
            if queue and len(chosen) < limit:
                chosen.append(queue.pop(0))
    return chosen


def fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def run_dtype(dtype: str, args, prompts) -> dict:
    methods = args.methods
    config = LoadConfig(device=args.device, dtype=dtype, quant=args.quant, cuda_graphs=args.cuda_graphs)
    started = time.perf_counter()
    target = load_model(args.target, config, progress=log)
    # The draft transformers' assisted generation gets: loaded as transformers would, stock kernels.
    draft = load_model(args.draft, replace(config, cpu_linear="stock"), progress=log)
    spec_draft = load_model(args.draft, replace(config, for_draft=True), progress=log)
    bridge = vocab_bridge(target.tokenizer, draft.tokenizer, args.draft, log)
    load_seconds = time.perf_counter() - started
    target_description = target.describe()
    log(
        f"[{dtype}] loaded target and drafts in {load_seconds:.0f} s; target: {target_description};"
        f" specgen's draft: {spec_draft.describe()}"
    )
    bench = Bench(target, draft, spec_draft, args.k, args.cuda_graphs, methods, bridge)
    encoded = [(p, encode_bench_prompt(target.tokenizer, p)) for p in prompts]

    # Warm-up: one short generate per method, untimed.
    for method in methods:
        bench.run(method, encoded[0][1], WARMUP_TOKENS)
    log(f"[{dtype}] warmed up")

    rows = []
    errors = []
    print(
        f"\n== dtype {dtype}: target {args.target}, draft {args.draft}, max_new_tokens {args.max_new_tokens},"
        f" specgen k={args.k}; tokens/s = new tokens / wall time of the whole generate (prefill included)"
        + (f", the fastest of {args.repeats} runs" if args.repeats > 1 else "")
    )
    header = f"{'prompt':<24} {'len':>4} " + " ".join(f"{m:>17}" for m in methods) + "  check"
    print(header)
    for index, (prompt, ids) in enumerate(encoded):
        runs: dict[str, list[dict]] = {method: [] for method in methods}
        orders = []
        for round_index in range(args.repeats):
            order = balanced_order(methods, index * args.repeats + round_index)
            orders.append(list(order))
            for method in order:
                runs[method].append(bench.run(method, ids, args.max_new_tokens))
                log(
                    f"[{dtype}] {prompt.name} {method}: {runs[method][-1]['new_tokens']} tokens,"
                    f" {runs[method][-1]['seconds']:.1f} s"
                )
        results = {method: fastest_run(runs[method]) for method in methods}
        reference = results["hf-plain"]["tokens"]
        bench.earlier_texts.append([*ids, *reference])  # what suffix drafting has seen at the next prompt
        divergences = []
        for method in methods[1:]:
            position = first_difference(reference, results[method]["tokens"])
            results[method]["identical"] = position is None
            if position is None:
                continue
            tokens = results[method]["tokens"]
            # A run that stopped at `position` short of the budget ended by end-of-sequence.
            plain_ended = list(bench.eos) if position == len(reference) < args.max_new_tokens else []
            spec_ended = list(bench.eos) if position == len(tokens) < args.max_new_tokens else []
            divergence = classify(
                position,
                reference,
                tokens,
                bench.next_logits(ids, reference[:position]),
                getattr(torch, dtype),
                plain_ended,
                spec_ended,
            )
            entry = {
                "prompt": prompt.name,
                "method": method,
                **divergence.as_dict(),
                "describe": divergence.describe(),
                "plain_tokens": len(reference),
                "method_tokens": len(tokens),
            }
            results[method]["divergence"] = entry
            divergences.append(entry)
            if not divergence.near_tie:
                errors.append(entry)
        check = (
            "all identical" if not divergences else "; ".join(f"{d['method']}: {d['describe']}" for d in divergences)
        )
        cells = " ".join(f"{fmt(results[m]['tokens_per_second']):>10} ({results[m]['new_tokens']:>3})" for m in methods)
        print(f"{prompt.name:<24} {len(ids):>4} {cells}  {check}", flush=True)
        rows.append(
            {
                "prompt": prompt.name,
                "category": prompt.category,
                "prompt_tokens": len(ids),
                "orders": orders,
                "methods": {m: {k: v for k, v in r.items()} for m, r in results.items()},
            }
        )

    medians = {m: statistics.median(r["methods"][m]["tokens_per_second"] for r in rows) for m in methods}
    pairs = [
        (a, b) for a in ("specgen-draft", "specgen-ngram") for b in ("hf-plain", "hf-assisted", "hf-prompt-lookup")
    ]
    pairs += [("specgen-ngram-tree", "hf-prompt-lookup")]
    pairs += [("specgen-draft", "hf-assisted-int8"), ("specgen-draft", "specgen-plain"), ("specgen-plain", "hf-plain")]
    pairs += [("specgen-plain", "specgen-plain-stock"), ("specgen-plain-stock", "hf-plain")]
    pairs += [
        ("specgen-draft-ngram", "specgen-draft"),
        ("specgen-draft-ngram", "specgen-ngram"),
        ("specgen-lookahead", "specgen-plain"),
        ("specgen-lookahead", "specgen-ngram"),
        ("specgen-lookahead", "hf-prompt-lookup"),
        ("specgen-tree", "specgen-draft"),
        ("specgen-tree", "specgen-plain"),
        ("specgen-ngram-tree", "specgen-ngram"),
        ("specgen-ngram-tree", "specgen-plain"),
        ("specgen-suffix", "specgen-ngram"),
        ("specgen-suffix", "specgen-ngram-tree"),
        ("specgen-suffix", "specgen-draft"),
        ("specgen-suffix", "specgen-plain"),
        ("specgen-auto", "specgen-auto-ungrafted"),
    ]
    pairs += [("specgen-auto", b) for b in FIXED_CHOICES]
    pairs += [(a, b) for a in HEAD_METHODS for b in ("specgen-plain", "specgen-draft")]
    pairs += [("specgen-eagle-tree", "specgen-eagle"), ("specgen-medusa-tree", "specgen-medusa")]
    pairs += [(a, "hf-plain") for a in ("hf-assisted", "hf-assisted-int8", "hf-prompt-lookup")]
    ratios = {f"{a} / {b}": speedup(medians[a], medians[b]) for a, b in pairs if a in medians and b in medians}

    # Per-prompt ratios too: the median of ratios is less sensitive to which prompt is slow.
    def prompt_ratios(key: str) -> list[float]:
        a, b = key.split(" / ")
        return [speedup(r["methods"][a]["tokens_per_second"], r["methods"][b]["tokens_per_second"]) for r in rows]

    per_prompt_ratio = {key: statistics.median(prompt_ratios(key)) for key in ratios}
    worst_prompt_ratio = {key: min(prompt_ratios(key)) for key in ratios}
    print(f"\n-- summary, {dtype}: median tokens/s over {len(rows)} prompts (cells above: tokens/s (new tokens))")
    for m in methods:
        extra = ""
        if m.startswith("specgen"):
            acc = [r["methods"][m]["acceptance"] for r in rows if r["methods"][m]["acceptance"] is not None]
            tps = [r["methods"][m]["tokens_per_step"] for r in rows if r["methods"][m]["tokens_per_step"]]
            overhead = [r["methods"][m]["overhead"] for r in rows if r["methods"][m]["overhead"] is not None]
            passes = [r["methods"][m]["pass_size"] for r in rows if r["methods"][m].get("pass_size")]
            extra = (
                f"  (median acceptance {fmt(statistics.median(acc) if acc else None, '.0%')},"
                f" median tokens/step {fmt(statistics.median(tps) if tps else None)},"
                f" median tokens/pass {fmt(statistics.median(passes) if passes else None, '.1f')},"
                f" time outside forward passes: median {fmt(statistics.median(overhead) if overhead else None, '.1%')},"
                f" max {fmt(max(overhead) if overhead else None, '.1%')})"
            )
        print(f"{m:<18} {medians[m]:8.2f}{extra}")
    print(f"{'ratio':<40} {'of medians':>10} {'median of per-prompt':>21} {'lowest prompt':>14}")
    for key, value in ratios.items():
        print(
            f"{key:<40} {fmt(value, '.2f') + 'x':>10} {fmt(per_prompt_ratio[key], '.2f') + 'x':>21}"
            f" {fmt(worst_prompt_ratio[key], '.2f') + 'x':>14}"
        )
    modelled = modelled_ratios(rows, methods, pairs, bench.costs)
    if modelled:
        print(
            "modelled: new tokens / the calibration's seconds for the passes each method made (no draft model;"
            " decode only), free of the machine's noise while it ran"
        )
        for key, (of_medians, per_prompt, lowest) in modelled.items():
            print(
                f"{key:<40} {fmt(of_medians, '.2f') + 'x':>10} {fmt(per_prompt, '.2f') + 'x':>21}"
                f" {fmt(lowest, '.2f') + 'x':>14}"
            )
    auto_check = default_against_fixed(rows, methods)
    if auto_check:
        print(
            f"default (specgen-auto) pooled: {auto_check['pooled_against_best_fixed']:.2f}x the best fixed choice"
            f" ({auto_check['best_fixed']}); lowest prompt {fmt(auto_check['lowest_against_plain'], '.2f')}x"
            f" specgen-plain ({auto_check['lowest_prompt']})"
        )
    n_div = sum(1 for r in rows for m in methods[1:] if not r["methods"][m]["identical"])
    print(f"divergences from hf-plain: {n_div}, of them mismatches: {len(errors)}" + (" (ERRORS)" if errors else ""))

    backends = {
        "target": backend_label(bench.target_lm),
        "draft": backend_label(bench.draft_drafter.model),
        "target_graphs_error": getattr(bench.target_lm, "graphs_error", None),
        "draft_graphs_error": getattr(bench.draft_drafter.model, "graphs_error", None),
    }
    print(f"specgen backends: {backends}")
    costs = bench.costs
    del bench, target, draft, spec_draft
    return {
        "dtype": dtype,
        "load_seconds": load_seconds,
        "specgen_target": target_description,
        "calibration": costs.as_dict() if costs else None,
        "specgen_backends": backends,
        "rows": rows,
        "median_tokens_per_second": medians,
        "ratio_of_medians": ratios,
        "median_of_per_prompt_ratios": per_prompt_ratio,
        "lowest_per_prompt_ratios": worst_prompt_ratio,
        "default_against_fixed": auto_check,
        "modelled_ratios": {
            key: dict(zip(("of_medians", "median_of_per_prompt", "lowest_prompt"), values))
            for key, values in modelled.items()
        },
        "divergences": [
            r["methods"][m]["divergence"] for r in rows for m in methods[1:] if "divergence" in r["methods"][m]
        ],
        "errors": errors,
    }


# The choices a user can fix by hand, against which the default (specgen-auto) is judged.
FIXED_CHOICES = (
    "specgen-draft",
    "specgen-tree",
    "specgen-ngram",
    "specgen-ngram-tree",
    "specgen-draft-ngram",
    "specgen-lookahead",
    "specgen-plain",
)


def default_against_fixed(rows: list[dict], methods: Sequence[str]) -> dict | None:
    """specgen-auto against every fixed choice that ran: pooled tokens/s (all prompts' tokens
    over all their seconds) against the best of them, and its lowest prompt against specgen-plain."""
    fixed = [m for m in FIXED_CHOICES if m in methods]
    if "specgen-auto" not in methods or not fixed:
        return None

    def pooled(method: str) -> float:
        runs = [r["methods"][method] for r in rows]
        return sum(run["new_tokens"] for run in runs) / sum(run["seconds"] for run in runs)

    rates = {m: pooled(m) for m in ["specgen-auto", *fixed]}
    best = max(fixed, key=lambda m: rates[m])
    check: dict = {
        "pooled_tokens_per_second": rates,
        "best_fixed": best,
        "pooled_against_best_fixed": rates["specgen-auto"] / rates[best],
        "lowest_against_plain": None,
        "lowest_prompt": None,
    }
    if "specgen-plain" in methods:
        against = {
            r["prompt"]: r["methods"]["specgen-auto"]["tokens_per_second"]
            / r["methods"]["specgen-plain"]["tokens_per_second"]
            for r in rows
        }
        lowest = min(against, key=lambda name: against[name])
        check["lowest_against_plain"], check["lowest_prompt"] = against[lowest], lowest
    return check


# Methods whose whole cost is their target passes (no draft model): their speed can also be
# modelled from the calibration, free of the shared machine's noise.
MODELLED = ("specgen-plain", "specgen-ngram", "specgen-ngram-tree", "specgen-lookahead")


def modelled_ratios(
    rows: list[dict], methods: list[str], pairs: list[tuple[str, str]], costs: CostCurve | None
) -> dict[str, tuple[float, float, float]]:
    """(of medians, median per prompt, lowest prompt) of modelled tokens/s, for the pairs of MODELLED methods."""
    chosen = [m for m in methods if m in MODELLED]
    if costs is None or len(chosen) < 2:
        return {}
    rates = {
        m: [r["methods"][m]["new_tokens"] / costs.modelled_seconds(r["methods"][m]["passes"]) for r in rows]
        for m in chosen
    }
    out = {}
    for a, b in pairs:
        if a in rates and b in rates:
            per_prompt = [x / y for x, y in zip(rates[a], rates[b])]
            out[f"{a} / {b}"] = (
                statistics.median(rates[a]) / statistics.median(rates[b]),
                statistics.median(per_prompt),
                min(per_prompt),
            )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    parser.add_argument(
        "--quant",
        default="auto",
        help="for target and drafts: auto (4-bit on CUDA, none on the CPU; specgen's draft: int8 on"
        " the CPU), none, 4bit, 8bit",
    )
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    parser.add_argument(
        "--limit", type=int, default=None, help="take N prompts, one category after another (file order within each)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", default="auto", help="specgen draft length: a number or auto")
    parser.add_argument(
        "--cuda-graphs",
        default="auto",
        choices=("auto", "off"),
        help="specgen's backend on CUDA: auto (static cache + CUDA graphs for bf16/fp16/4-bit/8-bit)"
        " or off (DynamicCache)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run every method this many times per prompt (the order rotated each round) and keep"
        " each one's fastest run: two methods that make the same passes then measure alike"
        " on a noisy machine",
    )
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument(
        "--methods",
        default=",".join(METHODS),
        help="comma-separated subset of the methods (hf-plain always runs: it is the reference)",
    )
    args = parser.parse_args()
    args.k = args.k if args.k == "auto" else int(args.k)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    chosen = {m.strip() for m in args.methods.split(",") if m.strip()}
    unknown = chosen - set(METHODS)
    if unknown:
        parser.error(f"unknown methods: {', '.join(sorted(unknown))} (known: {', '.join(METHODS)})")
    args.methods = tuple(m for m in METHODS if m in chosen or m == "hf-plain")

    prompts = load_prompts(args.prompts)
    if args.limit:
        prompts = round_robin_by_category(prompts, args.limit)
    import transformers

    out = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "target": args.target,
        "draft": args.draft,
        "max_new_tokens": args.max_new_tokens,
        "k": args.k,
        "repeats": args.repeats,
        "prompts_file": str(args.prompts),
        "prompts": [p.name for p in prompts],
        "methods": list(args.methods),
        "timing": "new tokens / wall time of the whole generate call, prefill included, every method",
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "torch_threads": torch.get_num_threads(),
            "machine": platform.machine(),
            "processor": platform.processor(),
        },
        "dtypes": [],
    }
    failed = False
    for dtype in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
        result = run_dtype(dtype, args, prompts)
        out["dtypes"].append(result)
        failed |= bool(result["errors"])
        if args.json_out:  # written after each dtype, so a cut-short run keeps what it measured
            args.json_out.write_text(json.dumps(out, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
