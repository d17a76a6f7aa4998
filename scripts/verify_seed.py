"""Check, on real models, that a sampling seed gives the same text whatever the drafter and k.

    python scripts/verify_seed.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
        --temperature 0.8 --seeds 1,2,3 --max-new-tokens 32 "def fib(n):" "def quicksort(arr):"

For each prompt and seed: the plain target's sample (no draft), then speculative decoding with
the draft model at each --k (auto twice in a row) and with prompt lookup (ngram). With a seed,
sampling is coupled per output position (speccli.coupling), so every run must print
exactly the plain target's tokens. Prints one line per run and exits 1 on any difference.

Then the acceptance of the two sampling rules side by side, for each k: the coupled rule
(the runs above, with seeds) and the rejection rule of Leviathan et al. (the same runs
without a seed), pooled over prompts and seeds.
"""

from __future__ import annotations

import argparse
import sys
import time

from speccli.bench.divergence import first_difference
from speccli.config import LoadConfig, SamplingConfig, SpecConfig, parse_draft_length
from speccli.drafters.ngram import PromptLookupDrafter
from speccli.pipeline import load_pipeline
from speccli.prompts import Prompt
from speccli.stats import GenerationStats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompts", nargs="+")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--k", default="1,4,auto")
    parser.add_argument("--no-ngram", action="store_true", help="Leave out the prompt-lookup runs.")
    args = parser.parse_args(argv)
    if args.temperature <= 0:
        parser.error("--temperature must be > 0: greedy output is checked by scripts/verify_greedy.py")

    ks = [parse_draft_length(k) for k in args.k.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    target_config = LoadConfig(dtype=args.dtype)
    draft_config = LoadConfig(dtype=args.dtype, for_draft=True)
    pipeline = load_pipeline(
        args.target, args.draft, target_config, draft_config, progress=lambda m: print(m, file=sys.stderr)
    )
    generator = pipeline.speculator(progress=lambda m: print(m, file=sys.stderr))
    model_drafter = generator.drafter
    runs: list[tuple[str, object, int | str]] = []
    if model_drafter is not None:
        for k in ks:
            runs.append((f"k={k}", model_drafter, k))
            if k == "auto":
                runs.append(("k=auto again", model_drafter, k))
    if not args.no_ngram:
        runs.append(("ngram k=auto", PromptLookupDrafter(), "auto"))

    coupled: dict[str, GenerationStats] = {}
    rejection: dict[str, GenerationStats] = {}
    failures = checked = 0
    for prompt in args.prompts:
        ids = generator.encode(Prompt.of(prompt))
        for seed in seeds:
            sampling = SamplingConfig(args.temperature, args.top_k, args.top_p, seed)
            spec = lambda k: SpecConfig(k=k, max_new_tokens=args.max_new_tokens)  # noqa: E731
            reference = generator.stream(ids, sampling, spec(1), plain=True).run().token_ids
            for label, drafter, k in runs:
                generator.use_drafter(drafter)
                started = time.perf_counter()
                generation = generator.stream(ids, sampling, spec(k)).run()
                seconds = time.perf_counter() - started
                coupled.setdefault(label, GenerationStats()).add(generation.stats)
                position = first_difference(generation.token_ids, reference)
                checked += 1
                failures += position is not None
                detail = "" if position is None else f" first difference at new token {position}"
                acceptance = generation.stats.acceptance_rate or 0.0
                print(
                    f"{'OK  ' if position is None else 'DIFF'} seed={seed} {label} {prompt!r}:"
                    f" {len(generation.token_ids)} tokens,"
                    f" acceptance {acceptance:.0%}, {seconds:.1f} s{detail}",
                    flush=True,
                )
                # The same run without a seed: the rejection rule.
                unseeded = SamplingConfig(args.temperature, args.top_k, args.top_p)
                rejection.setdefault(label, GenerationStats()).add(generator.stream(ids, unseeded, spec(k)).run().stats)
            generator.use_drafter(model_drafter)
        print(repr(pipeline.tokenizer.decode(reference)), flush=True)

    print(f"\n{checked - failures}/{checked} runs printed the plain target's sample for their seed")
    print(
        f"acceptance at temperature {args.temperature}, pooled over {len(args.prompts)} prompts x {len(seeds)} seeds:"
    )
    for label in coupled:
        c, r = coupled[label], rejection[label]
        print(
            f"  {label:14} coupled {c.acceptance_rate or 0:.1%} ({c.accepted}/{c.drafted},"
            f" {c.tokens_per_step or 0:.2f} tokens/step)"
            f"   rejection {r.acceptance_rate or 0:.1%} ({r.accepted}/{r.drafted},"
            f" {r.tokens_per_step or 0:.2f} tokens/step)"
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
