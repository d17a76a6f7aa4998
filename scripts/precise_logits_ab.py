"""What float32-precise top logits (speccli.models.kernels.precise_logits) cost, side by side in one run.

    python scripts/precise_logits_ab.py --dtype bfloat16 --limit 12 --max-new-tokens 64

Loads the target and draft once; for each prompt, runs plain decoding and speculative
decoding (k auto) with the target's output layer wrapped and unwrapped, in alternating
order, and prints each prompt's tokens/s ratio (precise over bfloat16 logits) and the
median and geometric mean over prompts. Greedy; the prompts are scripts/prompts/default.jsonl.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from speccli.bench.prompts import encode_bench_prompt, load_prompts
from speccli.config import AUTO_K, LoadConfig, SamplingConfig, SpecConfig
from speccli.models.loading import cpu_name
from speccli.models.kernels.precise_logits import set_precise_logits
from speccli.pipeline import load_pipeline

DEFAULT_PROMPTS = Path(__file__).parent / "prompts" / "default.jsonl"


def geomean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    parser.add_argument("--limit", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    target_config = LoadConfig(dtype=args.dtype)
    pipeline = load_pipeline(args.target, args.draft, target_config, LoadConfig(for_draft=True), progress=log)
    model = pipeline.target.model
    if not set_precise_logits(model):
        log(f"the target's output layer is not refined in {args.dtype}: nothing to compare")
        return 2
    generator = pipeline.speculator(log)
    sampling = SamplingConfig()
    spec = SpecConfig(k=AUTO_K, max_new_tokens=args.max_new_tokens)
    generator.calibrate(spec.max_k)
    prompts = load_prompts(args.prompts)[: args.limit]

    def run(ids: list[int], precise: bool, plain: bool) -> float:
        set_precise_logits(model, enabled=precise)
        generation = generator.stream(ids, sampling, spec, plain=plain, cold=True).run()
        return generation.stats.tokens_per_second

    run(encode_bench_prompt(pipeline.tokenizer, prompts[0]), True, True)  # warm-up
    rows = []
    print(f"CPU: {cpu_name()}; target {args.target} in {args.dtype}; ratio = precise / {args.dtype} logits tokens/s")
    print(f"{'prompt':<24} {'plain':>7} {'speculative':>12}")
    for index, prompt in enumerate(prompts):
        ids = encode_bench_prompt(pipeline.tokenizer, prompt)
        row = {"prompt": prompt.name}
        for plain in (True, False):
            order = (True, False) if index % 2 == 0 else (False, True)
            speeds = {precise: run(ids, precise, plain) for precise in order}
            row["plain" if plain else "speculative"] = {"precise": speeds[True], "coarse": speeds[False]}
        rows.append(row)
        ratios = [row[m]["precise"] / row[m]["coarse"] for m in ("plain", "speculative")]
        print(f"{prompt.name:<24} {ratios[0]:>6.3f}x {ratios[1]:>11.3f}x", flush=True)
    summary = {}
    for method in ("plain", "speculative"):
        ratios = [r[method]["precise"] / r[method]["coarse"] for r in rows]
        summary[method] = {"median": statistics.median(ratios), "geomean": geomean(ratios)}
        print(
            f"{method}: precise / {args.dtype} logits median {summary[method]['median']:.3f}x,"
            f" geomean {summary[method]['geomean']:.3f}x over {len(ratios)} prompts"
        )
    if args.json_out:
        payload = {
            "cpu": cpu_name(),
            "args": {k: str(v) for k, v in vars(args).items()},
            "rows": rows,
            "summary": summary,
        }
        args.json_out.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
