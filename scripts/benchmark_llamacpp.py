"""specgen on its llama.cpp backend beside llama.cpp's own decoding and transformers', greedy.

    python scripts/benchmark_llamacpp.py --limit 12 --max-new-tokens 128 --json-out bench-llamacpp.json

One process, one machine; the target and draft GGUF files are loaded once through llama.cpp
(and the target once more through transformers, in the fastest dtype of this CPU, for
hf-plain). For each prompt, these methods run one after another on the same prompt ids,
in an order rotated per prompt:

  (llama-bench itself, given --llama-bench PATH: its tg64 before and after the prompts)
  (with --repeats N, N rounds per prompt, each in a further rotated order; a cell is the
  round with the median tokens/s)
  llamacpp-tg       llama-bench's tg procedure through the same library: after the prefill, one
                    llama_decode of one token per new token, the same id fed again and
                    nothing read back, as llama-bench does. Its decode tok/s is llama.cpp's
                    own decoding speed for the file and threads.
  llamacpp-greedy   a bare greedy loop over llama.cpp: llama_decode, then argmax of the
                    logits in NumPy. The plain decoding specgen's tokens are checked against.
  specgen-plain     specgen's decode loop on the llama.cpp backend with no drafter (k = 0)
  specgen-draft     specgen's defaults on llama.cpp: the draft GGUF in llama.cpp, k auto from a
                    calibration made before timing
  specgen-ngram     prompt lookup (--draft ngram)
  specgen-lookahead lookahead decoding (--draft lookahead)
  specgen-tree      specgen-draft drafting trees (--tree)
  hf-plain          transformers' target.generate(do_sample=False), the GGUF dequantized

Tokens/s: new tokens / wall time of the whole call, prefill included; "decode tok/s" leaves
the prefill out (what llama-bench's tg reports). Every llama.cpp method's tokens are
checked against llamacpp-greedy's: a divergence is reported with the target's top-two
logit gap there (llama.cpp's batched passes round differently from one-token passes).
hf-plain computes in floating point from dequantized weights, so its tokens may differ
from llama.cpp's beyond near-ties: it is timed, not checked.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark import DEFAULT_PROMPTS, fmt, log, round_robin_by_category, strip_eos  # noqa: E402

from speccli.api import Speculator  # noqa: E402
from speccli.autok.costs import CostCurve, measure_costs  # noqa: E402
from speccli.calibration import describe  # noqa: E402
from speccli.backends.llamacpp import LlamaCppLM, llama_cpp_version  # noqa: E402
from speccli.bench.divergence import first_difference  # noqa: E402
from speccli.bench.prompts import encode_bench_prompt, load_prompts  # noqa: E402
from speccli.config import LoadConfig, SamplingConfig, SpecConfig  # noqa: E402
from speccli.drafters.lookahead import LookaheadDrafter  # noqa: E402
from speccli.drafters.ngram import PromptLookupDrafter  # noqa: E402
from speccli.models.pairs.compat import check_tokenizers_compatible  # noqa: E402
from speccli.models.loading import cpu_name, load_model  # noqa: E402
from speccli.pipeline import model_drafter  # noqa: E402
from speccli.stats import speedup  # noqa: E402

METHODS = (
    "llamacpp-greedy",
    "llamacpp-tg",
    "specgen-plain",
    "specgen-draft",
    "specgen-ngram",
    "specgen-lookahead",
    "specgen-tree",
    "hf-plain",
)
SPECGEN = ("specgen-plain", "specgen-draft", "specgen-ngram", "specgen-lookahead", "specgen-tree")
WARMUP_TOKENS = 8


class Bench:
    def __init__(self, target, draft, hf_target, methods) -> None:
        self.target, self.hf_target = target, hf_target
        self.eos = list(target.eos_token_ids)
        self.eos_set = set(self.eos)
        self.lm = LlamaCppLM(target.model)
        self.drafter = model_drafter(self.lm, target.tokenizer, draft)
        self.costs = measure_costs(self.lm, self.drafter.model, SpecConfig().max_k + 1)
        log(f"calibration: {describe(self.costs)}")
        free = CostCurve(self.costs.verify_seconds, None)
        tokenizer = target.tokenizer
        self.generators = {
            "specgen-plain": Speculator.over(self.lm, tokenizer, self.eos, self.drafter, self.costs),
            "specgen-draft": Speculator.over(self.lm, tokenizer, self.eos, self.drafter, self.costs),
            "specgen-ngram": Speculator.over(self.lm, tokenizer, self.eos, PromptLookupDrafter(), free),
            "specgen-lookahead": Speculator.over(self.lm, tokenizer, self.eos, LookaheadDrafter(), free),
            "specgen-tree": Speculator.over(self.lm, tokenizer, self.eos, self.drafter, self.costs),
        }
        self.methods = methods

    def _llamacpp(self, method: str, ids: list[int], max_new: int) -> tuple[list[int], dict]:
        """The bare loops: prefill, then one llama_decode per new token (decode time counts
        every new token's pass, as specgen's statistics do)."""
        lm = self.lm
        lm.rollback(0)
        started = time.perf_counter()
        # Prefilled as specgen's decoder does (all but the last token, then the last one
        # alone), so that specgen-plain computes the very same passes.
        lm.forward(ids[:-1], all_logits=False)
        prefill = time.perf_counter() - started
        logits = lm.forward(ids[-1:], all_logits=False)[-1].numpy()
        token = int(np.argmax(logits))
        tokens = [token]
        if method == "llamacpp-tg":
            tokens = self._tg(lm, len(ids), max_new - 1, token)
        else:
            while len(tokens) < max_new and token not in self.eos_set:
                token = int(np.argmax(lm.forward([token], all_logits=False)[-1].numpy()))
                tokens.append(token)
        decode = time.perf_counter() - started - prefill
        return tokens, {"decode_seconds": decode, "decode_tokens": len(tokens)}

    @staticmethod
    def _tg(lm: LlamaCppLM, start: int, count: int, token: int) -> list[int]:
        """llama-bench's test_gen: llama_batch_get_one of one token, llama_decode, repeat."""
        lc = lm._lc
        one = (lc.llama_token * 1)(token)
        for i in range(count):
            if lc.llama_decode(lm.context, lc.llama_batch_get_one(one, 1)) != 0:
                raise RuntimeError("llama_decode failed in the tg loop")
        lc.llama_synchronize(lm.context)
        lc.llama_memory_clear(lm._memory, True)
        lm._tokens.clear()
        return [token] * (count + 1)

    def _spec(self, method: str, ids: list[int], max_new: int) -> tuple[list[int], dict]:
        generator = self.generators[method]
        plain = method == "specgen-plain"
        spec = SpecConfig(k="auto", max_new_tokens=max_new, tree=method == "specgen-tree")
        with torch.inference_mode():
            generation = generator.stream(ids, SamplingConfig(), spec, plain=plain, cold=True).run()
        stats = generation.stats
        return generation.token_ids, {
            "decode_seconds": stats.decode_seconds,
            "decode_tokens": stats.new_tokens,
            "acceptance": stats.acceptance_rate,
            "tokens_per_step": stats.tokens_per_step,
            "pass_size": stats.mean_pass_size,
        }

    def _hf(self, method: str, ids: list[int], max_new: int) -> tuple[list[int], dict]:
        from transformers import GenerationConfig

        model = self.hf_target.model
        config = GenerationConfig(
            do_sample=False, max_new_tokens=max_new, eos_token_id=self.eos, pad_token_id=self.eos[0]
        )
        inputs = torch.tensor([ids])
        with torch.inference_mode():
            out = model.generate(inputs, attention_mask=torch.ones_like(inputs), generation_config=config)
        return out[0, len(ids) :].tolist(), {}

    def run(self, method: str, ids: list[int], max_new: int) -> dict:
        runner = self._spec if method in SPECGEN else self._hf if method == "hf-plain" else self._llamacpp
        started = time.perf_counter()
        tokens, extra = runner(method, ids, max_new)
        seconds = time.perf_counter() - started
        self.lm.rollback(0)
        self.drafter.model.rollback(0)
        if method != "llamacpp-tg":
            tokens = strip_eos(tokens, self.eos_set)
        decode = extra.get("decode_seconds")
        return {
            "tokens": tokens,
            "new_tokens": len(tokens),
            "seconds": seconds,
            "tokens_per_second": len(tokens) / seconds if seconds > 0 else None,
            "decode_tokens_per_second": extra["decode_tokens"] / decode if decode else None,
            **extra,
        }

    def top2_gap(self, ids: list[int], prefix: list[int]) -> float:
        self.lm.rollback(0)
        top = torch.topk(self.lm.forward(ids + prefix, all_logits=False)[-1], 2).values
        self.lm.rollback(0)
        return float(top[0] - top[1])


def median_round(runs: list[dict]) -> dict:
    """The run with the median tokens/s (the lower middle one of an even count), with every
    round's tokens/s beside it."""
    ranked = sorted(runs, key=lambda run: run["tokens_per_second"] or 0.0)
    chosen = dict(ranked[(len(ranked) - 1) // 2])
    if len(runs) > 1:
        chosen["rounds_tokens_per_second"] = [run["tokens_per_second"] for run in runs]
    return chosen


def llama_bench_tg(binary: Path, model: Path, threads: int, tokens: int = 64) -> float:
    """llama-bench's own tg tokens/s (the mean over its 5 repetitions)."""
    import subprocess

    out = subprocess.run(
        [str(binary), "-m", str(model), "-t", str(threads), "-p", "0", "-n", str(tokens), "-r", "5", "-o", "json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=900,
    )
    return float(json.loads(out.stdout)[0]["avg_ts"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--hf-dtype", default="auto", help="dtype of transformers' target for hf-plain")
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument(
        "--llama-bench",
        type=Path,
        default=None,
        help="a llama-bench binary built from the same llama.cpp: its tg64 with the same file and"
        " threads, run before and after the prompts, is set beside specgen-plain's decode tok/s",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds per prompt, the methods' order rotated each round; each cell is the round with"
        " the median tokens/s (single runs of 100 tokens vary by 10%% here)",
    )
    parser.add_argument(
        "--methods",
        default=",".join(METHODS),
        help="comma-separated subset (llamacpp-greedy always runs: it is the reference)",
    )
    args = parser.parse_args()
    chosen = {m.strip() for m in args.methods.split(",") if m.strip()}
    unknown = chosen - set(METHODS)
    if unknown:
        parser.error(f"unknown methods: {', '.join(sorted(unknown))} (known: {', '.join(METHODS)})")
    methods = tuple(m for m in METHODS if m in chosen or m == "llamacpp-greedy")

    prompts = load_prompts(args.prompts)
    if args.limit:
        prompts = round_robin_by_category(prompts, args.limit)
    config = LoadConfig(device="cpu", backend="llama.cpp")
    target = load_model(args.target, config, progress=log)
    draft = load_model(args.draft, LoadConfig(device="cpu", backend="llama.cpp", for_draft=True), progress=log)
    check_tokenizers_compatible(target.tokenizer, draft.tokenizer)
    hf_target = None
    if "hf-plain" in methods:
        hf_target = load_model(
            args.target, LoadConfig(device="cpu", dtype=args.hf_dtype, backend="transformers"), progress=log
        )
    log(
        f"target: {target.describe()}; draft: {draft.describe()}"
        + (f"; hf-plain: {hf_target.describe()}" if hf_target else "")
    )
    bench = Bench(target, draft, hf_target, methods)
    costs = bench.costs
    curve = ", ".join(f"{fed}: {1000 * s:.0f} ms" for fed, s in sorted(costs.verify_seconds.items()))
    print(f"CPU: {cpu_name()}, {bench.lm.threads} threads; llama-cpp-python {llama_cpp_version()}")
    print(f"target pass cost by tokens fed (llama.cpp): {curve}; draft token: {1000 * costs.draft_seconds:.0f} ms")
    bench_tg = []
    if args.llama_bench:
        bench_tg.append(llama_bench_tg(args.llama_bench, target.resolved.gguf_path, bench.lm.threads))
        log(f"llama-bench tg64: {bench_tg[-1]:.2f} tok/s")
    encoded = [(p, encode_bench_prompt(target.tokenizer, p)) for p in prompts]
    for method in methods:
        bench.run(method, encoded[0][1], WARMUP_TOKENS)
    log("warmed up")

    print(f"\n{'prompt':<24} {'len':>4} " + " ".join(f"{m:>17}" for m in methods) + "  check")
    rows = []
    for index, (prompt, ids) in enumerate(encoded):
        rounds: dict[str, list[dict]] = {method: [] for method in methods}
        for repeat in range(args.repeats):
            shift = (index + repeat) % len(methods)
            for method in methods[shift:] + methods[:shift]:
                rounds[method].append(bench.run(method, ids, args.max_new_tokens))
        results = {method: median_round(runs) for method, runs in rounds.items()}
        reference = results["llamacpp-greedy"]["tokens"]
        notes = []
        for method in SPECGEN:
            if method not in results:
                continue
            position = first_difference(reference, results[method]["tokens"])
            results[method]["identical"] = position is None
            if position is not None:
                gap = bench.top2_gap(ids, reference[:position])
                results[method]["divergence"] = {"position": position, "top2_logit_gap": gap}
                notes.append(f"{method} differs at {position} (gap {gap:.3f})")
        cells = " ".join(f"{fmt(results[m]['tokens_per_second']):>10} ({results[m]['new_tokens']:>3})" for m in methods)
        print(f"{prompt.name:<24} {len(ids):>4} {cells}  {'; '.join(notes) or 'all identical'}", flush=True)
        rows.append({"prompt": prompt.name, "category": prompt.category, "prompt_tokens": len(ids), "methods": results})

    def median(method: str, key: str = "tokens_per_second") -> float | None:
        values = [r["methods"][method][key] for r in rows if r["methods"][method].get(key)]
        return statistics.median(values) if values else None

    print(f"\n-- median over {len(rows)} prompts")
    print(f"{'method':<18} {'tok/s':>7} {'decode tok/s':>13} {'acceptance':>11} {'tok/step':>9} {'tok/pass':>9}")
    for m in methods:
        print(
            f"{m:<18} {fmt(median(m)):>7} {fmt(median(m, 'decode_tokens_per_second')):>13}"
            f" {fmt(median(m, 'acceptance'), '.0%'):>11} {fmt(median(m, 'tokens_per_step')):>9}"
            f" {fmt(median(m, 'pass_size'), '.1f'):>9}"
        )
    pairs = [("specgen-plain", "llamacpp-tg", "decode_tokens_per_second"), ("specgen-plain", "llamacpp-greedy", None)]
    pairs += [(m, "specgen-plain", None) for m in SPECGEN[1:]]
    pairs += [
        (m, "hf-plain", None)
        for m in (
            "llamacpp-greedy",
            "specgen-plain",
            "specgen-draft",
            "specgen-ngram",
            "specgen-lookahead",
            "specgen-tree",
        )
    ]
    ratios = {}
    print(f"{'ratio':<44} {'of medians':>10} {'lowest prompt':>14}")
    for a, b, key in pairs:
        if a not in methods or b not in methods:
            continue
        key = key or "tokens_per_second"
        per_prompt = [speedup(r["methods"][a][key], r["methods"][b][key]) for r in rows]
        name = f"{a} / {b}" + (" (decode)" if key != "tokens_per_second" else "")
        ratios[name] = {
            "of_medians": speedup(median(a, key), median(b, key)),
            "lowest_prompt": min(per_prompt),
            "per_prompt": per_prompt,
        }
        print(f"{name:<44} {fmt(ratios[name]['of_medians']) + 'x':>10} {fmt(min(per_prompt)) + 'x':>14}")
    if args.llama_bench and "specgen-plain" in methods:
        bench_tg.append(llama_bench_tg(args.llama_bench, target.resolved.gguf_path, bench.lm.threads))
        tg = statistics.mean(bench_tg)
        plain = median("specgen-plain", "decode_tokens_per_second")
        ratios["specgen-plain (decode) / llama-bench tg64"] = {
            "of_medians": speedup(plain, tg),
            "llama_bench": bench_tg,
        }
        print(
            f"llama-bench tg64 (before, after the prompts): {', '.join(f'{t:.2f}' for t in bench_tg)} tok/s;"
            f" specgen-plain decode / llama-bench: {fmt(speedup(plain, tg))}x"
        )
    divergences = [
        (r["prompt"], m, r["methods"][m]["divergence"])
        for r in rows
        for m in SPECGEN
        if m in r["methods"] and "divergence" in r["methods"][m]
    ]
    print(
        f"divergences from llamacpp-greedy: {len(divergences)}"
        + "".join(f"\n  {p} {m}: at {d['position']}, gap {d['top2_logit_gap']:.3f}" for p, m, d in divergences)
    )
    if args.json_out:
        out = {
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "cpu": cpu_name(),
            "threads": bench.lm.threads,
            "llama_cpp_python": llama_cpp_version(),
            "python": platform.python_version(),
            "target": target.describe(),
            "draft": draft.describe(),
            "hf_target": hf_target.describe() if hf_target else None,
            "calibration": costs.as_dict(),
            "max_new_tokens": args.max_new_tokens,
            "repeats": args.repeats,
            "methods": list(methods),
            "rows": rows,
            "ratios": ratios,
        }
        args.json_out.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
