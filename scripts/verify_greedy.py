"""Check, on real models, that specgen's greedy output equals the target's own greedy generate.

    python scripts/verify_greedy.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
        --dtype float32 --max-new-tokens 32 "def fib(n):" "def quicksort(arr):"
    python scripts/verify_greedy.py --prompts scripts/prompts/default.jsonl   # chat prompts through the template

`--tree` drafts token trees, `--no-tree` chains, neither as specgen's default (k auto chooses);
`--draft lookahead` (or `ngram`, `auto`: the default's drafters taking turns) checks those drafters.

Prints one line per prompt and draft length, and exits 1 on any difference, each classified
as `specgen bench` does (speccli.bench.divergence): a near-tie (bfloat16 rounding) or a
MISMATCH (a bug).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from speccli.bench.divergence import classify, first_difference
from speccli.bench.prompts import load_prompts
from speccli.cli.app import tree_choice
from speccli.config import LoadConfig, SamplingConfig, SpecConfig, parse_draft_length
from speccli.errors import UsageError
from speccli.models.kernels.onednn import set_cpu_linear
from speccli.pipeline import load_pipeline
from speccli.prompts import Prompt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompts", nargs="*", help="raw-text prompts")
    parser.add_argument(
        "--prompts",
        dest="prompt_file",
        type=Path,
        help="a .txt or .jsonl prompt file, as `specgen bench` reads it (messages through the chat template)",
    )
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--k", default="1,4,8", help="comma-separated draft lengths: whole numbers or auto")
    parser.add_argument("--tree", action="store_true", help="draft token trees (--draft lookahead always does)")
    parser.add_argument("--no-tree", action="store_true", help="draft chains (neither flag: k auto chooses)")
    args = parser.parse_args()
    try:
        lengths = [parse_draft_length(x) for x in args.k.split(",")]
    except ValueError as error:
        parser.error(str(error))
    try:
        tree = tree_choice(args.tree, args.no_tree)
    except UsageError as error:
        parser.error(str(error))
    prompts = [(text[:40], Prompt.of(text)) for text in args.prompts]
    if args.prompt_file is not None:
        prompts += [(item.name, item.request()) for item in load_prompts(args.prompt_file)]
    if not prompts:
        parser.error("give prompts, or --prompts FILE")

    config = LoadConfig(dtype=args.dtype)
    pipeline = load_pipeline(args.target, args.draft, config, config, progress=lambda m: print(m, file=sys.stderr))
    tokenizer, model = pipeline.tokenizer, pipeline.target.model
    generator = pipeline.speculator()
    failures = 0
    for name, prompt in prompts:
        ids = generator.encode(prompt)
        # The reference is the target as transformers runs it: PyTorch's stock kernels.
        set_cpu_linear(model, pipeline.target.linear, enabled=False)
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens, do_sample=False)
        plain_seconds = time.perf_counter() - started
        set_cpu_linear(model, pipeline.target.linear)
        reference = out[0, len(ids) :].tolist()
        eos = set(pipeline.target.eos_token_ids)
        cut = next((i for i, t in enumerate(reference) if t in eos), len(reference))
        reference = reference[:cut]
        for k in lengths:
            started = time.perf_counter()
            generation = generator.stream(
                ids, SamplingConfig(), SpecConfig(k=k, max_new_tokens=args.max_new_tokens, tree=tree)
            ).run()
            seconds = time.perf_counter() - started
            tokens = generation.token_ids
            acceptance = generation.stats.acceptance_rate or 0.0
            position = first_difference(tokens, reference)
            same = position is None
            detail = ""
            if not same:
                failures += 1
                with torch.inference_mode():
                    logits = model(torch.tensor([ids + reference[:position]])).logits[0, -1].float()
                # A run that stopped at `position` short of the budget ended by end-of-sequence.
                plain_ended = sorted(eos) if position == len(reference) < args.max_new_tokens else []
                spec_ended = sorted(eos) if position == len(tokens) < args.max_new_tokens else []
                divergence = classify(
                    position, reference, tokens, logits, pipeline.target.dtype, plain_ended, spec_ended
                )
                detail = f" {divergence.describe()}"
            print(
                f"{'OK  ' if same else 'DIFF'} k={k} {name!r}: {len(tokens)} tokens, acceptance {acceptance:.0%},"
                f" {generation.stats.tokens_per_step or 0:.2f} tokens/step,"
                f" {generation.stats.mean_pass_size or 0:.1f} tokens/pass,"
                f" {seconds:.1f} s (target generate {plain_seconds:.1f} s){detail}"
                f"; steps: {', '.join(f'{m} {n}' for m, n in generation.stats.methods.most_common())}"
            )
    print(repr(tokenizer.decode(reference)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
